//! `metrics.csv`: one row per finished epoch, rewritten whole from the training state.

use std::path::Path;

use super::EpochRecord;

pub fn write_metrics(path: &Path, history: &[EpochRecord]) -> std::io::Result<()> {
    let mut out = String::from(
        "epoch,step,lr,train_loss,train_acc,test_loss,test_acc,img_per_s,epoch_time_s,data_wait_s\n",
    );
    for r in history {
        out.push_str(&format!(
            "{},{},{:.6e},{:.6},{:.6},{},{},{:.1},{:.3},{:.3}\n",
            r.epoch,
            r.step,
            r.lr,
            r.train_loss,
            r.train_acc,
            opt(r.test_loss),
            opt(r.test_acc),
            r.img_per_s,
            r.epoch_time_s,
            r.data_wait_s
        ));
    }
    super::write_atomic(path, out.as_bytes())
}

/// Empty cell for "not measured".
fn opt(v: f64) -> String {
    if v.is_nan() {
        String::new()
    } else {
        format!("{v:.6}")
    }
}
