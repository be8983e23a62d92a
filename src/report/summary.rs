//! `summary.json`: the outcome of a run in one small file, for people and scripts.

use std::path::Path;

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub status: String,
    /// Why the run ended (the epochs done, `train.max_steps`, a signal, early stopping).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended: Option<String>,
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

pub fn write_summary(path: &Path, summary: &Summary) -> std::io::Result<()> {
    let json = serde_json::to_string_pretty(summary).expect("summary serializes");
    super::write_atomic(path, json.as_bytes())
}
