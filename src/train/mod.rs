//! Burn-generic training: model + optimizer + loss on a backend, the loop, evaluation
//! and checkpoints. `backend.rs` is the only file that names a concrete backend.

pub mod backend;
mod bench;
mod checkpoint;
mod clip;
mod eval;
mod fused_sgd;
mod grads;
mod loss;
mod loss_scale;
mod optim;
mod parallel;
mod ranks;
mod schedule;
mod state;
mod step;
mod trainer;
mod transfer;
mod warmup;
mod watchdog;

pub use bench::BenchJob;
pub use checkpoint::CheckpointError;
pub use eval::{EvalJob, pick_checkpoint};
pub use parallel::ReplicaError;
pub use state::{EpochRecord, TrainState};
pub use trainer::{Outcome, TrainError, TrainJob};
pub use warmup::WarmupJob;
