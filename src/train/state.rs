//! Training state that is not tensors: where the run is, what it has measured so far.
//! Saved as JSON beside the weights in every checkpoint; it is the single source for
//! `metrics.csv`, `summary.json` and `curves.png`.

use serde::{Deserialize, Serialize};

use super::loss_scale::LossScale;
use crate::data::InputSpec;
use crate::model::ModelSpec;
use crate::report::{EpochRecord, Summary};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Format of this file; bump when fields change meaning.
    pub version: u32,
    /// Epoch in progress, 0-based.
    pub epoch: u32,
    /// Batches of `epoch` already trained on.
    pub batch_in_epoch: u64,
    /// Optimizer steps completed.
    pub step: u64,
    /// Training wall time so far, over all processes of this run.
    pub elapsed_s: f64,
    pub spec: ModelSpec,
    pub classes: Vec<String>,
    /// Devices of the process that wrote this state.
    pub devices: Vec<String>,
    pub history: Vec<EpochRecord>,
    /// First optimizer step time of each process of this run (kernel compilation shows here).
    pub first_step_s: Vec<f64>,
    /// `Config::training_hash` of the config that wrote this state.
    #[serde(default)]
    pub config_sha256: String,
    /// Wall time spent writing checkpoints before this one, over all processes.
    #[serde(default)]
    pub checkpoint_s: f64,
    #[serde(default)]
    pub checkpoints_written: u64,
    /// Time the background writer spent putting checkpoints on disk (beside training),
    /// over all processes, up to the one before this.
    #[serde(default)]
    pub checkpoint_write_s: f64,
    /// fp16's dynamic loss scale (None for fp32 and bf16).
    #[serde(default)]
    pub loss_scale: Option<LossScale>,
    /// A checkpoint taken inside an epoch: the epoch's training metrics and times up
    /// to it, so that the epoch's row after a resume covers the whole epoch.
    #[serde(default)]
    pub epoch_so_far: Option<EpochSoFar>,
    /// What the network takes (absent in checkpoints written before it was recorded).
    #[serde(default)]
    pub input: Option<InputSpec>,
}

/// An epoch's running training totals and times, up to a checkpoint inside it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochSoFar {
    /// Loss × images, correct predictions, images, over every device of the run.
    pub loss: f64,
    pub correct: f64,
    pub images: usize,
    pub seconds: f64,
    pub data_wait_s: f64,
}

impl EpochSoFar {
    /// These totals plus `(loss, correct, images)`.
    pub fn plus(self, t: (f64, f64, usize), seconds: f64, data_wait_s: f64) -> Self {
        EpochSoFar {
            loss: self.loss + t.0,
            correct: self.correct + t.1,
            images: self.images + t.2,
            seconds: self.seconds + seconds,
            data_wait_s: self.data_wait_s + data_wait_s,
        }
    }
}

impl TrainState {
    pub const VERSION: u32 = 1;

    pub fn new(spec: ModelSpec, classes: Vec<String>, devices: Vec<String>) -> Self {
        TrainState {
            version: Self::VERSION,
            epoch: 0,
            batch_in_epoch: 0,
            step: 0,
            elapsed_s: 0.0,
            spec,
            classes,
            devices,
            history: Vec::new(),
            first_step_s: Vec::new(),
            config_sha256: String::new(),
            checkpoint_s: 0.0,
            checkpoints_written: 0,
            checkpoint_write_s: 0.0,
            loss_scale: None,
            epoch_so_far: None,
            input: None,
        }
    }

    /// Best test accuracy so far and the epoch that reached it.
    pub fn best(&self) -> Option<(f64, u32)> {
        self.history
            .iter()
            .filter(|r| !r.test_acc.is_nan())
            .map(|r| (r.test_acc, r.epoch))
            .max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)))
    }

    /// `summary.json` for this state, whose run is `status` (and `ended` why, once
    /// it has).
    pub fn summary(&self, status: &str, ended: Option<&str>) -> Summary {
        let last_eval = self.history.iter().rev().find(|r| !r.test_acc.is_nan());
        let best = self.best();
        let rates: Vec<f64> = if self.history.len() > 1 {
            self.history[1..].iter().map(|r| r.img_per_s).collect()
        } else {
            self.history.iter().map(|r| r.img_per_s).collect()
        };
        Summary {
            status: status.to_string(),
            ended: ended.map(str::to_string),
            epochs_completed: self.history.len() as u32,
            steps: self.step,
            final_test_acc: last_eval.map(|r| r.test_acc),
            final_test_loss: last_eval.map(|r| r.test_loss),
            best_test_acc: best.map(|b| b.0),
            best_epoch: best.map(|b| b.1),
            wall_time_s: self.elapsed_s,
            img_per_s: (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64),
            first_step_s: self.first_step_s.clone(),
            checkpoint_s: self.checkpoint_s,
            checkpoint_share: if self.elapsed_s > 0.0 {
                self.checkpoint_s / self.elapsed_s
            } else {
                0.0
            },
            checkpoints_written: self.checkpoints_written,
            checkpoint_write_s: self.checkpoint_write_s,
            loss_scale: self.loss_scale.map(|l| l.scale),
            skipped_steps: self.loss_scale.map(|l| l.skipped_steps),
            config_sha256: self.config_sha256.clone(),
            devices: self.devices.clone(),
            model: format!("{:?} ({:?} stem)", self.spec.arch, self.spec.stem).to_lowercase(),
            classes: self.spec.num_classes,
        }
    }
}
