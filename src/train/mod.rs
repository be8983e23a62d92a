//! Burn-generic training. `fit` is the loop; around it, each component decides its own
//! "when": the checkpointer (`checkpoint/`), the evaluator, the watchdog, the fault
//! injector. How a step is taken on one device, several, or across processes is a
//! strategy's (`strategy/`), each holding its gradient exchange (`exchange/`).
//! `build` makes model, optimizer and loaders once for `train`, `bench` and `warmup`;
//! `backend.rs` is the only file that names a concrete backend.

pub mod backend;
mod build;
mod checkpoint;
mod clip;
mod early_stop;
mod error;
mod eval;
mod evaluator;
mod exchange;
mod faults;
mod fit;
mod fused_sgd;
mod grads;
mod learner;
mod loss;
mod loss_scale;
mod lr_schedule;
mod optim;
mod precompile;
mod predict;
mod state;
mod step;
mod strategy;
mod throughput;
mod watchdog;

pub use checkpoint::CheckpointError;
pub use error::TrainError;
pub use eval::{EvalJob, pick_checkpoint, read_model_on_cpu};
pub use exchange::ExchangeError;
pub use fit::{Outcome, TrainJob};
pub use precompile::WarmupJob;
pub use predict::{PredictJob, top_k};
pub use strategy::ReplicaError;
#[cfg(feature = "cuda")]
pub use throughput::PoolUsage;
pub use throughput::{BenchJob, PoolProbe};
