//! Everything that can be wrong with a configuration, worded for the user who wrote it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not valid TOML: {message}", path.display())]
    Syntax { path: PathBuf, message: String },
    #[error("{origin}: unknown key `{key}`{hint}")]
    UnknownKey {
        /// The file, or the `--set` argument, that holds the key.
        origin: String,
        key: String,
        /// "; did you mean `x`?" or "; valid keys here: ...".
        hint: String,
    },
    #[error("--set {arg}: {reason}")]
    BadSet { arg: String, reason: String },
    #[error("{origin}: {key}: {message}")]
    Type {
        origin: String,
        key: String,
        message: String,
    },
    #[error("{key} = {value} is not allowed: expected {allowed}")]
    Invalid {
        key: String,
        value: String,
        allowed: String,
    },
}
