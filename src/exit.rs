//! The only mapping from errors to exit codes. A supervisor decides what to do from
//! these: 2 means nothing started because the input was wrong; 75 that a GPU was not
//! available; 1 any other failure. (130, interrupted, is returned by `cmd::train`.)

use std::process::ExitCode;

use crate::collective::CollectiveError;
use crate::config::ConfigError;
use crate::data::DataError;
use crate::device::DeviceError;
use crate::run::run_dir::RunDirError;
use crate::train::{CheckpointError, ExchangeError, ReplicaError, TrainError};

pub const USAGE: u8 = 2;
pub const DEVICE_UNAVAILABLE: u8 = 75;
pub const INTERRUPTED: u8 = 130;

/// A user error found before training started (wrong path, bad flag combination).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

pub fn code_for(err: &anyhow::Error) -> ExitCode {
    ExitCode::from(code_number(err))
}

/// [`code_for`] as a number.
pub fn code_number(err: &anyhow::Error) -> u8 {
    for cause in err.chain() {
        if cause.is::<ConfigError>() || cause.is::<UsageError>() || cause.is::<DataError>() {
            return USAGE;
        }
        if let Some(e) = cause.downcast_ref::<RunDirError>() {
            return match e {
                RunDirError::Create { .. } | RunDirError::Lock { .. } => 1,
                _ => USAGE,
            };
        }
        if let Some(e) = cause.downcast_ref::<DeviceError>() {
            // The machine, not the request: may be different elsewhere.
            return if e.is_unavailable() {
                DEVICE_UNAVAILABLE
            } else {
                USAGE
            };
        }
        if let Some(e) = cause.downcast_ref::<CheckpointError>() {
            return checkpoint_code(e);
        }
        if let Some(e) = cause.downcast_ref::<CollectiveError>() {
            return collective_code(e);
        }
        if cause.is::<ExchangeError>() {
            return DEVICE_UNAVAILABLE;
        }
        if let Some(e) = cause.downcast_ref::<TrainError>() {
            return match e {
                TrainError::BatchTooLarge { .. }
                | TrainError::DeviceWeights { .. }
                | TrainError::Replica(ReplicaError::TooSmall { .. }) => USAGE,
                // A device failed mid-run: restart, perhaps without it.
                TrainError::Replica(ReplicaError::Failed { .. }) => DEVICE_UNAVAILABLE,
                TrainError::Checkpoint(c) => checkpoint_code(c),
                TrainError::Collective(d) => collective_code(d),
                // A peer gone or NCCL's error: restart the run from its checkpoint.
                TrainError::Exchange(_) => DEVICE_UNAVAILABLE,
                TrainError::DevicesPerRank { .. }
                | TrainError::BatchPerRank { .. }
                | TrainError::ExchangeUnavailable(_) => USAGE,
                // Bad data met mid-run: training had started, so not a usage error.
                _ => 1,
            };
        }
    }
    1
}

/// Ranks started inconsistently: fix the command. Any other loss of a peer (it died,
/// hung, or never came): the launcher restarts the whole run from its checkpoint.
fn collective_code(e: &CollectiveError) -> u8 {
    match e {
        CollectiveError::Mismatch(_) => USAGE,
        _ => DEVICE_UNAVAILABLE,
    }
}

/// Nothing to resume from, a corrupt or incompatible checkpoint: the user must choose
/// another run; failing I/O is a plain failure.
fn checkpoint_code(e: &CheckpointError) -> u8 {
    match e {
        CheckpointError::Io { .. } | CheckpointError::Record { .. } => 1,
        _ => USAGE,
    }
}
