//! The user's configuration: TOML file, `--set` overrides, one section per component
//! and its validation. No Burn and no devices here; loading a config never touches
//! CUDA.

mod checkpoint;
mod data;
mod devices;
mod diff;
mod error;
mod eval;
mod faults;
mod kernels;
mod load;
mod model;
mod optim;
mod parallel;
mod schema;
mod train;
mod watchdog;

pub use checkpoint::*;
pub use data::*;
pub use devices::*;
pub use diff::diff;
pub use error::ConfigError;
pub use eval::*;
pub use faults::*;
pub use kernels::*;
pub use load::{load, load_str, to_toml};
pub use model::*;
pub use optim::*;
pub use parallel::*;
pub use schema::*;
pub use train::*;
pub use watchdog::*;
