//! Full training checkpoints: model weights (full precision), optimizer state and the
//! [`TrainState`], committed atomically by [`Store`] (`run::checkpoints`, the on-disk
//! layout). When to save and what to restore in `checkpointer.rs`, writing in the
//! background in `writer.rs`.

mod checkpointer;
mod writer;

use crate::ops::SgdBackend;
use std::path::Path;

use burn::module::Module;
use burn::record::{
    BinBytesRecorder, BinFileRecorder, FullPrecisionSettings, Recorder, RecorderError,
};
use burn::tensor::backend::AutodiffBackend;

pub use crate::run::checkpoints::{CheckpointError, Store};
pub use checkpointer::Checkpointer;
pub use writer::Writer;

use super::optim::Optim;
use super::state::TrainState;
use crate::model::ResNet;

fn record_err(path: &Path) -> impl FnOnce(RecorderError) -> CheckpointError + '_ {
    move |e| CheckpointError::Record {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// A checkpoint's files in host memory, taken at one step; [`Writer`] puts them on disk.
pub struct Snapshot {
    pub step: u64,
    pub test_acc: Option<f64>,
    files: Vec<(&'static str, Vec<u8>)>,
}

impl Snapshot {
    /// Weights, optimizer and state as they are now. The bytes are those
    /// `BinFileRecorder` writes, so [`read_tensors`] reads them back.
    pub fn take<B: AutodiffBackend<InnerBackend: SgdBackend>>(
        model: &ResNet<B>,
        optim: &Optim<ResNet<B>, B>,
        state: &TrainState,
        test_acc: Option<f64>,
    ) -> Result<Self, CheckpointError> {
        let rec = BinBytesRecorder::<FullPrecisionSettings>::new();
        let model_bytes = Recorder::<B>::record(&rec, model.clone().into_record(), ())
            .map_err(record_err(Path::new("model.bin")))?;
        let optim_bytes = optim
            .to_bytes()
            .map_err(record_err(Path::new("optim.bin")))?;
        let state_json = serde_json::to_string_pretty(state).expect("state serializes");
        Ok(Snapshot {
            step: state.step,
            test_acc,
            files: vec![
                ("model.bin", model_bytes),
                ("optim.bin", optim_bytes),
                ("state.json", state_json.into_bytes()),
            ],
        })
    }

    /// Writes the files into `dir` (the store's temporary directory).
    fn write(&self, dir: &Path) -> Result<(), CheckpointError> {
        for (name, bytes) in &self.files {
            let path = dir.join(name);
            std::fs::write(&path, bytes).map_err(|source| CheckpointError::Io { path, source })?;
        }
        Ok(())
    }
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
pub fn read_tensors<B: AutodiffBackend<InnerBackend: SgdBackend>>(
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
