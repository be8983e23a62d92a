//! The only mapping from errors to exit codes. A supervisor decides what to do from
//! these: 2 means nothing started because the input was wrong; 75 that a GPU was not
//! available; 1 any other failure. (130, interrupted, is returned by `cmd::train`.)

use std::process::ExitCode;

use crate::config::ConfigError;
use crate::data::DataError;
use crate::device::DeviceError;
use crate::dist::DistError;
use crate::train::{CheckpointError, ReplicaError, TrainError};

pub const USAGE: u8 = 2;
pub const DEVICE_UNAVAILABLE: u8 = 75;
pub const INTERRUPTED: u8 = 130;

/// A user error found before training started (wrong path, bad flag combination).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

pub fn code_for(err: &anyhow::Error) -> ExitCode {
    for cause in err.chain() {
        if cause.is::<ConfigError>() || cause.is::<UsageError>() || cause.is::<DataError>() {
            return ExitCode::from(USAGE);
        }
        if let Some(e) = cause.downcast_ref::<DeviceError>() {
            return ExitCode::from(match e {
                // The machine, not the request: may be different on a retry or elsewhere.
                DeviceError::GpuRequired(_)
                | DeviceError::CudaUnavailable(_)
                | DeviceError::NotEnoughMemory { .. }
                | DeviceError::Unusable { .. } => DEVICE_UNAVAILABLE,
                _ => USAGE,
            });
        }
        if let Some(e) = cause.downcast_ref::<CheckpointError>() {
            return checkpoint_code(e);
        }
        if let Some(e) = cause.downcast_ref::<DistError>() {
            return dist_code(e);
        }
        if let Some(e) = cause.downcast_ref::<TrainError>() {
            return match e {
                TrainError::BatchTooLarge { .. }
                | TrainError::DeviceWeights { .. }
                | TrainError::Replica(ReplicaError::TooSmall { .. }) => ExitCode::from(USAGE),
                // A device failed mid-run: restart, perhaps without it.
                TrainError::Replica(ReplicaError::Failed { .. }) => {
                    ExitCode::from(DEVICE_UNAVAILABLE)
                }
                TrainError::Checkpoint(c) => checkpoint_code(c),
                TrainError::Dist(d) => dist_code(d),
                TrainError::DevicesPerRank { .. } | TrainError::BatchPerRank { .. } => {
                    ExitCode::from(USAGE)
                }
                // Bad data met mid-run: training had started, so not a usage error.
                _ => ExitCode::from(1),
            };
        }
    }
    ExitCode::from(1)
}

/// Ranks started inconsistently: fix the command. Any other loss of a peer (it died,
/// hung, or never came): the launcher restarts the whole run from its checkpoint.
fn dist_code(e: &DistError) -> ExitCode {
    ExitCode::from(match e {
        DistError::Mismatch(_) => USAGE,
        _ => DEVICE_UNAVAILABLE,
    })
}

/// Nothing to resume from, a corrupt or incompatible checkpoint: the user must choose
/// another run; failing I/O is a plain failure.
fn checkpoint_code(e: &CheckpointError) -> ExitCode {
    ExitCode::from(match e {
        CheckpointError::Io { .. } | CheckpointError::Record { .. } => 1,
        _ => USAGE,
    })
}
