//! What a run leaves for its user: `metrics.csv`, `summary.json`, `curves.png`, and
//! the progress shown while it trains. No Burn here; everything takes plain numbers.

mod balance;
mod csv;
mod epoch;
mod plot;
mod progress;
mod summary;
mod tensorboard;

pub use balance::{DeviceLoad, balance_report};
pub use csv::write_metrics;
pub use epoch::{EpochRecord, epoch_line};
pub use plot::{draw_legend, register_font, write_curves};
pub use progress::{Progress, Ticker};
pub use summary::{Summary, write_summary};
pub use tensorboard::{Board, DeviceUsage};

use std::path::Path;

/// Replaces `path` with `bytes` atomically (write a sibling, then rename), so a crash
/// never leaves a half-written report.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // A hidden sibling of kiln's own naming, so no file of the user's is touched.
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.kiln-tmp"));
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        // A full disk must not leave a half-written sibling behind.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
