//! `kiln eval`: a saved model on a dataset split, BatchNorm in inference mode.

use crate::ops::TrainBackend;
use std::path::{Path, PathBuf};

use burn::backend::flex::{Flex, FlexDevice};

use super::backend::BackendJob;
use super::checkpoint::{self, CheckpointError};
use super::error::TrainError;
use super::evaluator::evaluate;
use super::state::TrainState;
use crate::data::Loader;
use crate::model::ResNet;

pub struct EvalJob {
    pub checkpoint: PathBuf,
    pub state: TrainState,
    pub loader: Loader,
}

impl BackendJob for EvalJob {
    type Output = Result<(f64, f64), TrainError>;

    fn run<B: TrainBackend>(self, devices: Vec<B::Device>) -> Self::Output {
        let (model, device) = saved_model::<B>(&self.checkpoint, &self.state, devices)?;
        Ok(evaluate(&model, &self.loader, &device)?)
    }
}

/// The network of checkpoint `dir` (whose state is `state`) for inference, on the
/// first of a plan's `devices`, and that device.
pub(super) fn saved_model<B: TrainBackend>(
    dir: &Path,
    state: &TrainState,
    devices: Vec<B::Device>,
) -> Result<(ResNet<B::InnerBackend>, B::Device), CheckpointError> {
    let device = devices
        .into_iter()
        .next()
        .expect("a device plan always holds at least one device");
    let model = checkpoint::read_model(dir, state.spec.init(&device), &device)?;
    Ok((model, device))
}

/// The network of checkpoint `dir` (whose state is `state`) on the CPU, for `kiln
/// export`.
pub fn read_model_on_cpu(dir: &Path, state: &TrainState) -> Result<ResNet<Flex>, CheckpointError> {
    checkpoint::read_model(dir, state.spec.init(&FlexDevice), &FlexDevice)
}

/// The checkpoint `kiln eval` uses: the newest good one, or the best one.
pub fn pick_checkpoint(
    run_dir: &Path,
    best: bool,
) -> Result<(PathBuf, TrainState), CheckpointError> {
    let store = checkpoint::Store::new(run_dir);
    let found = if best {
        store.best_valid()
    } else {
        store.latest_valid(|_| {})
    };
    let Some((dir, _)) = found else {
        return Err(CheckpointError::NoneFound {
            path: store.root().to_path_buf(),
            detail: if best {
                " with a test accuracy".into()
            } else {
                String::new()
            },
        });
    };
    let state = checkpoint::read_state(&dir)?;
    Ok((dir, state))
}
