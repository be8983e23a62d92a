//! One finished epoch: its record (a row of `metrics.csv`, a point of `curves.png`)
//! and the line printed for it.

use serde::{Deserialize, Serialize};

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

/// The line printed at the end of an epoch.
pub fn epoch_line(r: &EpochRecord, epochs: u32) -> String {
    let test = if r.test_acc.is_nan() {
        String::new()
    } else {
        format!(
            " | test loss {:.4} acc {:.2}%",
            r.test_loss,
            r.test_acc * 100.0
        )
    };
    format!(
        "epoch {}/{}: train loss {:.4} acc {:.2}%{test} | {:.0} img/s | {:.1} s (waiting for data {:.0}%) | lr {:.4}",
        r.epoch,
        epochs,
        r.train_loss,
        r.train_acc * 100.0,
        r.img_per_s,
        r.epoch_time_s,
        100.0 * r.data_wait_s / r.epoch_time_s.max(1e-9),
        r.lr
    )
}
