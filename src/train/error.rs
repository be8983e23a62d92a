//! What can end a training run, worded for the user; `exit.rs` maps each to an exit
//! code the supervisor decides on.

use std::path::PathBuf;

use super::checkpoint::CheckpointError;
use super::exchange::ExchangeError;
use super::strategy::ReplicaError;
use crate::collective::CollectiveError;
use crate::data::DataError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(
        "train.batch_size = {batch} is larger than the training set ({images} images); lower it or use more data"
    )]
    BatchTooLarge { batch: usize, images: usize },
    #[error("the loss became {value} at step {step}; lower optim.lr or set train.grad_clip_norm")]
    NonFinite { step: u64, value: f64 },
    #[error("cannot write {}: {message}", path.display())]
    Report { path: PathBuf, message: String },
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error(
        "parallel.device_weights has {weights} entries but {devices} devices are used; give one weight per device or []"
    )]
    DeviceWeights { weights: usize, devices: usize },
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// The gradient exchange failed: a peer gone, NCCL's error.
    #[error("the gradient exchange failed: {0}")]
    Exchange(#[from] ExchangeError),
    /// The exchange asked for cannot run here (no NCCL, no CUDA).
    #[error("{0}")]
    ExchangeUnavailable(String),
    #[error(
        "a multi-process run trains on one device per process, but this process was given {devices}; start one process per GPU"
    )]
    DevicesPerRank { devices: usize },
    #[error(
        "train.batch_size = {batch} cannot be shared by {ranks} processes{why}; make it a multiple of {multiple}"
    )]
    BatchPerRank {
        batch: usize,
        ranks: usize,
        why: &'static str,
        multiple: usize,
    },
}
