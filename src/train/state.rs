//! Training state that is not tensors: where the run is, what it has measured so far.
//! Saved as JSON beside the weights in every checkpoint; it is the single source for
//! `metrics.csv`, `summary.json` and `curves.png`.

use serde::{Deserialize, Serialize};

use super::loss_scale::LossScale;
use crate::model::ModelSpec;

/// One finished epoch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochRecord {
    /// 1-based.
    pub epoch: u32,
    /// Optimizer steps completed at the end of this epoch.
    pub step: u64,
    /// Learning rate of the epoch's last step.
    pub lr: f64,
    pub train_loss: f64,
    pub train_acc: f64,
    /// NaN when the test split was not evaluated after this epoch.
    pub test_loss: f64,
    pub test_acc: f64,
    /// Training images per second over the epoch (data loading included).
    pub img_per_s: f64,
    pub epoch_time_s: f64,
    /// Time the training loop waited for the loader's next batch during the epoch: near
    /// zero when loading keeps up, a large share when the devices wait for data.
    #[serde(default)]
    pub data_wait_s: f64,
}

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
}
