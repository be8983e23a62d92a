//! Data errors name the file and what is wrong with it, so the user can fix or replace it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {reason}", path.display())]
    Malformed { path: PathBuf, reason: String },
    #[error("{}: {reason}", path.display())]
    Missing { path: PathBuf, reason: String },
    #[error("{}: cannot decode image", path.display())]
    Decode {
        path: PathBuf,
        #[source]
        source: image::ImageError,
    },
}

impl DataError {
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> DataError {
        let path = path.into();
        move |source| DataError::Io { path, source }
    }

    pub fn malformed(path: impl Into<PathBuf>, reason: impl Into<String>) -> DataError {
        DataError::Malformed {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
