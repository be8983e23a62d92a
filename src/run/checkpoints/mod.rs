//! A run dir's checkpoints on disk, without Burn: the layout (`step-N/` directories
//! with a manifest, committed by rename), their verification and retention. What goes
//! inside them (weights, optimizer, state) is `train::checkpoint`'s.

mod retention;
mod store;

pub use store::Store;

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint I/O failed on {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("corrupt checkpoint file {}: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error("cannot read or write {}: {message}", path.display())]
    Record { path: PathBuf, message: String },
    #[error("checkpoint {} was made for another setup: {difference}; start a new run instead of resuming", path.display())]
    Incompatible { path: PathBuf, difference: String },
    #[error("no checkpoint to resume from in {}{detail}", path.display())]
    NoneFound { path: PathBuf, detail: String },
}
