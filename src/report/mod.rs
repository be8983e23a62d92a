//! What a run leaves for its user: `metrics.csv`, `summary.json`, `curves.png`, and
//! the progress shown while it trains. No Burn here; everything takes plain numbers.

mod csv;
mod plot;
mod progress;
mod summary;

pub use csv::write_metrics;
pub use plot::{register_font, write_curves};
pub use progress::{Progress, Ticker};
pub use summary::{Summary, write_summary};

use std::path::Path;

/// Replaces `path` with `bytes` atomically (write a sibling, then rename), so a crash
/// never leaves a half-written report.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
