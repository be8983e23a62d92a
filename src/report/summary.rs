//! `summary.json`: the outcome of a run in one small file, for people and scripts.

use std::path::Path;

use serde::Serialize;

use crate::train::TrainState;

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub status: String,
    pub epochs_completed: u32,
    pub steps: u64,
    pub final_test_acc: Option<f64>,
    pub final_test_loss: Option<f64>,
    pub best_test_acc: Option<f64>,
    pub best_epoch: Option<u32>,
    pub wall_time_s: f64,
    /// Mean training throughput over epochs (data loading included), excluding the
    /// first epoch of each process when there are later ones (it includes compilation).
    pub img_per_s: Option<f64>,
    pub first_step_s: Vec<f64>,
    /// Time training waited for checkpoints (copying them to host memory, or for the
    /// previous one to reach the disk), and its share of `wall_time_s`.
    pub checkpoint_s: f64,
    pub checkpoint_share: f64,
    pub checkpoints_written: u64,
    /// Time the background writer spent putting them on disk, beside training.
    pub checkpoint_write_s: f64,
    /// fp16 only: the loss scale at the end and the steps skipped on overflow.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u64>,
    pub config_sha256: String,
    pub devices: Vec<String>,
    pub model: String,
    pub classes: usize,
}

impl Summary {
    pub fn from_state(state: &TrainState, status: &str) -> Self {
        let last_eval = state.history.iter().rev().find(|r| !r.test_acc.is_nan());
        let best = state.best();
        let rates: Vec<f64> = if state.history.len() > 1 {
            state.history[1..].iter().map(|r| r.img_per_s).collect()
        } else {
            state.history.iter().map(|r| r.img_per_s).collect()
        };
        Summary {
            status: status.to_string(),
            epochs_completed: state.history.len() as u32,
            steps: state.step,
            final_test_acc: last_eval.map(|r| r.test_acc),
            final_test_loss: last_eval.map(|r| r.test_loss),
            best_test_acc: best.map(|b| b.0),
            best_epoch: best.map(|b| b.1),
            wall_time_s: state.elapsed_s,
            img_per_s: (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64),
            first_step_s: state.first_step_s.clone(),
            checkpoint_s: state.checkpoint_s,
            checkpoint_share: if state.elapsed_s > 0.0 {
                state.checkpoint_s / state.elapsed_s
            } else {
                0.0
            },
            checkpoints_written: state.checkpoints_written,
            checkpoint_write_s: state.checkpoint_write_s,
            loss_scale: state.loss_scale.map(|l| l.scale),
            skipped_steps: state.loss_scale.map(|l| l.skipped_steps),
            config_sha256: state.config_sha256.clone(),
            devices: state.devices.clone(),
            model: format!("{:?} ({:?} stem)", state.spec.arch, state.spec.stem).to_lowercase(),
            classes: state.spec.num_classes,
        }
    }
}

pub fn write_summary(path: &Path, summary: &Summary) -> std::io::Result<()> {
    let json = serde_json::to_string_pretty(summary).expect("summary serializes");
    super::write_atomic(path, json.as_bytes())
}
