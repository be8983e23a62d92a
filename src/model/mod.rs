//! The ResNet family, generic over Burn's `Backend`.

mod block;
mod flavors;
pub(crate) mod precision;
mod resnet;
pub mod torchvision;

pub use precision::Compute;
pub use resnet::{ModelSpec, ResNet};

use crate::ops::ModelBackend;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// Draws every lazily initialised parameter now. Burn 0.21 initialises a parameter on
/// first use, and a clone of an uninitialised parameter draws its own values: replicas
/// cloned from a fresh model would each get different weights.
pub fn materialize<B: Backend, M: Module<B>>(model: M) -> M {
    struct Touch;
    impl<B: Backend> ModuleVisitor<B> for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let _ = param.val();
        }
    }
    model.visit(&mut Touch);
    model
}

/// A network that maps images to class logits: what the training step needs.
pub trait Classifier<B: Backend>: Module<B> {
    /// `[batch, channels, H, W] -> [batch, classes]`
    fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2>;
}

impl<B: ModelBackend> Classifier<B> for ResNet<B> {
    fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        ResNet::forward(self, images)
    }
}
