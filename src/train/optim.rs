//! The optimizer chosen in `[optim]`, behind one type, with its state saved and
//! loaded through Burn's recorder in full precision.

use std::path::Path;

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, GradientsParams, Optimizer};
use burn::record::{
    BinBytesRecorder, BinFileRecorder, FullPrecisionSettings, Recorder, RecorderError,
};
use burn::tensor::backend::AutodiffBackend;

use super::fused_sgd::FusedSgd;
use crate::config::{OptimConfig, OptimizerKind};
use crate::ops::SgdBackend;

#[derive(Clone)]
pub enum Optim<M: AutodiffModule<B>, B: AutodiffBackend> {
    Sgd(FusedSgd<M, B>),
    AdamW(OptimizerAdaptor<AdamW, M, B>),
}

impl<M: AutodiffModule<B>, B: AutodiffBackend<InnerBackend: SgdBackend>> Optim<M, B> {
    pub fn new(cfg: &OptimConfig) -> Self {
        match cfg.name {
            OptimizerKind::Sgd => {
                Optim::Sgd(FusedSgd::new(cfg.momentum, cfg.nesterov, cfg.weight_decay))
            }
            OptimizerKind::Adamw => Optim::AdamW(
                AdamWConfig::new()
                    .with_beta_1(cfg.beta1 as f32)
                    .with_beta_2(cfg.beta2 as f32)
                    .with_epsilon(cfg.eps as f32)
                    .with_weight_decay(cfg.weight_decay as f32)
                    .init(),
            ),
        }
    }

    pub fn step(&mut self, lr: f64, model: M, grads: GradientsParams) -> M {
        match self {
            Optim::Sgd(o) => o.step(lr, model, grads),
            Optim::AdamW(o) => o.step(lr, model, grads),
        }
    }

    /// The state, serialised (for a checkpoint, or a replica on another device); the
    /// bytes are what `BinFileRecorder` writes, so [`Self::load`] reads them from a file.
    pub fn to_bytes(&self) -> Result<Vec<u8>, RecorderError> {
        let rec = BinBytesRecorder::<FullPrecisionSettings>::new();
        match self {
            Optim::Sgd(o) => Recorder::<B>::record(&rec, o.to_record(), ()),
            Optim::AdamW(o) => Recorder::<B>::record(&rec, o.to_record(), ()),
        }
    }

    /// Takes the state of [`Self::to_bytes`], read onto `device`.
    pub fn load_bytes(self, bytes: Vec<u8>, device: &B::Device) -> Result<Self, RecorderError> {
        let rec = BinBytesRecorder::<FullPrecisionSettings>::new();
        Ok(match self {
            Optim::Sgd(o) => Optim::Sgd(o.load_record(rec.load(bytes, device)?)),
            Optim::AdamW(o) => Optim::AdamW(o.load_record(rec.load(bytes, device)?)),
        })
    }

    /// Reads `stem.bin` onto `device`.
    pub fn load(self, stem: &Path, device: &B::Device) -> Result<Self, RecorderError> {
        let rec = BinFileRecorder::<FullPrecisionSettings>::new();
        Ok(match self {
            Optim::Sgd(o) => Optim::Sgd(o.load_record(rec.load(stem.to_path_buf(), device)?)),
            Optim::AdamW(o) => Optim::AdamW(o.load_record(rec.load(stem.to_path_buf(), device)?)),
        })
    }
}
