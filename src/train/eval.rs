//! `kiln eval`: a saved model on a dataset split, BatchNorm in inference mode.

use crate::ops::TrainBackend;
use std::path::PathBuf;

use super::backend::BackendJob;
use super::checkpoint::{self, CheckpointError};
use super::error::TrainError;
use super::evaluator::evaluate;
use super::state::TrainState;
use crate::data::Loader;

pub struct EvalJob {
    pub checkpoint: PathBuf,
    pub state: TrainState,
    pub loader: Loader,
}

impl BackendJob for EvalJob {
    type Output = Result<(f64, f64), TrainError>;

    fn run<B: TrainBackend>(self, devices: Vec<B::Device>) -> Self::Output {
        let device = devices
            .into_iter()
            .next()
            .expect("a device plan always holds at least one device");
        let model = self.state.spec.init::<B::InnerBackend>(&device);
        let model = checkpoint::read_model(&self.checkpoint, model, &device)?;
        Ok(evaluate(&model, &self.loader, &device)?)
    }
}

/// The checkpoint `kiln eval` uses: the newest good one, or the best one.
pub fn pick_checkpoint(
    run_dir: &std::path::Path,
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
