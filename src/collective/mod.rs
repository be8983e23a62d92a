//! The processes of one multi-process run talking to each other, over TCP: the
//! rendezvous at start-up (every rank connects to rank 0, which checks that all of them
//! train the same config and tells them the run dir and each other's devices), a flag
//! word every step that lets every rank stop at the same step (and shows a rank that
//! left), metric sums, the NCCL group id where GPUs exchange through NCCL, and, on the
//! CPU, the gradient sums and BatchNorm statistics themselves.
//!
//! The collectives are a star through rank 0, which adds the ranks' buffers in rank
//! order: the same numbers every run, and the same order as the single-process learner
//! adds its replicas in, so both give the same update. A rank that dies closes its
//! socket, which its peers see at once: rank 0 tells the others which rank left and
//! every process ends the step with that error instead of waiting. A rank that hangs
//! is noticed by a read timeout. No Burn here: buffers are plain `f32`/`f64` slices.

mod group;
mod wire;

pub use group::{Group, Join, Member};

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error(
        "rank 0 cannot listen on port {port}: {source}; another run may be using it: set KILN_MASTER_PORT to a free port"
    )]
    Bind {
        port: u16,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "rank {rank} could not reach rank 0 at {addr} within {} s (last error: {last}); check that rank 0 started and that the address is reachable",
        waited.as_secs()
    )]
    Unreachable {
        rank: usize,
        addr: String,
        waited: Duration,
        last: String,
    },
    #[error(
        "rank 0 waited {} s for ranks {missing:?} to join at port {port}; they did not start, or cannot reach this host",
        waited.as_secs()
    )]
    Incomplete {
        port: u16,
        missing: Vec<usize>,
        waited: Duration,
    },
    #[error("the ranks disagree: {0}; start every rank with the same command")]
    Mismatch(String),
    #[error("rank {rank}{who} left the run during {during}: {why}")]
    Lost {
        rank: usize,
        who: String,
        during: String,
        why: String,
    },
    #[error(
        "no word from rank {rank}{who} for {} s during {during}; it hung or its host is gone",
        waited.as_secs()
    )]
    Timeout {
        rank: usize,
        who: String,
        during: String,
        waited: Duration,
    },
    #[error("rank 0 ended the run: {0}")]
    Aborted(String),
}
