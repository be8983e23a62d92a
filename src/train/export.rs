//! A run's saved model read on the CPU, for `kiln export`.

use std::path::Path;

use burn::backend::flex::{Flex, FlexDevice};

use super::checkpoint::{self, CheckpointError};
use super::state::TrainState;
use crate::model::ResNet;

/// The model of checkpoint `dir` (whose state is `state`), on the CPU.
pub fn read_model_on_cpu(dir: &Path, state: &TrainState) -> Result<ResNet<Flex>, CheckpointError> {
    let model = state.spec.init::<Flex>(&FlexDevice);
    checkpoint::read_model(dir, model, &FlexDevice)
}
