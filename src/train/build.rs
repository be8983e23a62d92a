//! What a run trains, built in one place for `train`, `bench` and `warmup`: the
//! network fitted to the dataset, its initial weights (seeded), the optimizer and the
//! loaders.

use super::optim::Optim;
use crate::config::Config;
use crate::data::{Dataset, Loader};
use crate::model::{Compute, ModelSpec, ResNet};
use crate::ops::TrainBackend;

pub struct Built<B: TrainBackend> {
    pub spec: ModelSpec,
    pub model: ResNet<B>,
    pub optim: Optim<ResNet<B>, B>,
    pub train: Loader,
    pub test: Loader,
}

/// The network `[model]` describes, fitted to the dataset's channels, classes and size.
pub fn model_spec(cfg: &Config, dataset: &Dataset) -> ModelSpec {
    let shape = dataset.shape();
    ModelSpec::new(
        cfg.model.arch,
        cfg.model.stem,
        shape.channels,
        dataset.classes.len(),
        shape.height.min(shape.width),
    )
}

/// Model (initialised from `train.seed` on `device`), optimizer and loaders of `cfg`.
pub fn build<B: TrainBackend>(cfg: &Config, dataset: &Dataset, device: &B::Device) -> Built<B> {
    let spec = model_spec(cfg, dataset);
    B::seed(device, cfg.train.seed);
    let model = spec
        .init::<B>(device)
        .with_compute(Compute::new(cfg.train.precision, cfg.kernels.channels_last));
    let (train, test) = dataset.loaders(&cfg.data, cfg.train.batch_size, cfg.train.seed);
    Built {
        spec,
        model,
        optim: Optim::new(&cfg.optim),
        train,
        test,
    }
}
