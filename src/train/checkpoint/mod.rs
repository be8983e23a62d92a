//! Full training checkpoints: model weights (full precision), optimizer state and the
//! [`TrainState`], committed atomically by [`Store`]. Mechanism in `store.rs`,
//! retention policy in `retention.rs`.

mod retention;
mod store;

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::record::{BinFileRecorder, FullPrecisionSettings, RecorderError};
use burn::tensor::backend::AutodiffBackend;

pub use store::Store;

use super::optim::Optim;
use super::state::TrainState;
use crate::model::ResNet;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint I/O failed on {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("corrupt checkpoint file {}: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error("cannot read or write {}: {message}", path.display())]
    Record { path: PathBuf, message: String },
    #[error("checkpoint {} was made for another setup: {difference}; start a new run instead of resuming", path.display())]
    Incompatible { path: PathBuf, difference: String },
    #[error("no checkpoint to resume from in {}{detail}", path.display())]
    NoneFound { path: PathBuf, detail: String },
}

fn record_err(path: &Path) -> impl FnOnce(RecorderError) -> CheckpointError + '_ {
    move |e| CheckpointError::Record {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Writes weights, optimizer and state into `dir` (the store's temporary directory).
pub fn write<B: AutodiffBackend>(
    dir: &Path,
    model: &ResNet<B>,
    optim: &Optim<ResNet<B>, B>,
    state: &TrainState,
) -> Result<(), CheckpointError> {
    let model_stem = dir.join("model");
    model
        .clone()
        .save_file(
            model_stem.clone(),
            &BinFileRecorder::<FullPrecisionSettings>::new(),
        )
        .map_err(record_err(&model_stem))?;
    let optim_stem = dir.join("optim");
    optim.save(&optim_stem).map_err(record_err(&optim_stem))?;
    let state_path = dir.join("state.json");
    std::fs::write(
        &state_path,
        serde_json::to_string_pretty(state).expect("state serializes"),
    )
    .map_err(|source| CheckpointError::Io {
        path: state_path.clone(),
        source,
    })
}

/// Reads the state of a verified checkpoint directory.
pub fn read_state(dir: &Path) -> Result<TrainState, CheckpointError> {
    let path = dir.join("state.json");
    let text = std::fs::read_to_string(&path).map_err(|source| CheckpointError::Io {
        path: path.clone(),
        source,
    })?;
    let state: TrainState = serde_json::from_str(&text).map_err(|e| CheckpointError::Corrupt {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    if state.version != TrainState::VERSION {
        return Err(CheckpointError::Corrupt {
            path,
            reason: format!(
                "state format {} is not the {} this kiln reads",
                state.version,
                TrainState::VERSION
            ),
        });
    }
    Ok(state)
}

/// Refuses a checkpoint whose network or classes differ from this run's.
pub fn check_compatible(
    dir: &Path,
    saved: &TrainState,
    current: &TrainState,
) -> Result<(), CheckpointError> {
    let mut diffs = Vec::new();
    let (a, b) = (&saved.spec, &current.spec);
    if a.arch != b.arch {
        diffs.push(format!("model.arch {:?} vs {:?}", a.arch, b.arch));
    }
    if a.stem != b.stem {
        diffs.push(format!("model stem {:?} vs {:?}", a.stem, b.stem));
    }
    if a.in_channels != b.in_channels {
        diffs.push(format!(
            "input channels {} vs {}",
            a.in_channels, b.in_channels
        ));
    }
    if a.num_classes != b.num_classes || saved.classes != current.classes {
        diffs.push(format!(
            "dataset classes [{}] vs [{}]",
            saved.classes.join(", "),
            current.classes.join(", ")
        ));
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(CheckpointError::Incompatible {
            path: dir.to_path_buf(),
            difference: format!(
                "checkpoint has {} (checkpoint vs this config)",
                diffs.join("; ")
            ),
        })
    }
}

/// A model and its optimizer.
pub type Trained<B> = (ResNet<B>, Optim<ResNet<B>, B>);

/// Loads weights and optimizer state from a verified checkpoint directory.
pub fn read_tensors<B: AutodiffBackend>(
    dir: &Path,
    model: ResNet<B>,
    optim: Optim<ResNet<B>, B>,
    device: &B::Device,
) -> Result<Trained<B>, CheckpointError> {
    let model = read_model(dir, model, device)?;
    let optim_stem = dir.join("optim");
    let optim = optim
        .load(&optim_stem, device)
        .map_err(record_err(&optim_stem))?;
    Ok((model, optim))
}

/// Loads only the weights (for evaluation).
pub fn read_model<B: burn::tensor::backend::Backend>(
    dir: &Path,
    model: ResNet<B>,
    device: &B::Device,
) -> Result<ResNet<B>, CheckpointError> {
    let model_stem = dir.join("model");
    model
        .load_file(
            model_stem.clone(),
            &BinFileRecorder::<FullPrecisionSettings>::new(),
            device,
        )
        .map_err(record_err(&model_stem))
}
