//! The user's configuration: TOML file, `--set` overrides, schema and validation.
//! No Burn and no devices here; loading a config never touches CUDA.

mod diff;
mod error;
mod load;
mod schema;

pub use diff::diff;
pub use error::ConfigError;
pub use load::{load, load_str, to_toml};
pub use schema::*;
