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

impl ConfigError {
    /// `key = value` is out of range; `allowed` says what would be accepted.
    pub fn invalid(key: &str, value: impl ToString, allowed: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.to_string(),
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }
}

/// `Err` unless `value` is at most `limit`: sizes that allocate memory, threads or
/// files get an upper bound, so a typo (`1e12`) is an error instead of a process that
/// grows until the kernel kills it.
pub fn at_most(key: &str, value: u64, limit: u64, why: &str) -> Result<(), ConfigError> {
    if value > limit {
        return Err(ConfigError::invalid(
            key,
            value,
            format!("at most {limit} ({why})"),
        ));
    }
    Ok(())
}
