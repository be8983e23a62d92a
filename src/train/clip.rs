//! Clipping by the global L2 norm of all gradients, as `torch.nn.utils.clip_grad_norm_`.
//! (Burn's optimizer clipping works per parameter tensor.) The scale is computed on
//! the device, so clipping adds no host synchronisation.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

struct SquaredNorm<'a, B: Backend> {
    grads: &'a GradientsParams,
    sum: Option<Tensor<B, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let s = g.square().sum();
            self.sum = Some(match self.sum.take() {
                Some(acc) => acc + s,
                None => s,
            });
        }
    }
}

struct Scale<'a, B: Backend> {
    grads: &'a mut GradientsParams,
    factor: Tensor<B, 1>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let f = self.factor.clone().reshape([1; D]);
            self.grads.register::<B::InnerBackend, D>(param.id, g * f);
        }
    }
}

/// Scales `grads` so their global norm is at most `max_norm`; returns the norm before
/// clipping, as a device tensor (read it only when logging).
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> Option<Tensor<B::InnerBackend, 1>> {
    let mut norm = SquaredNorm::<B::InnerBackend> { grads, sum: None };
    model.visit(&mut norm);
    let total = norm.sum?.sqrt();
    // min(1, max_norm / (norm + 1e-6)), as PyTorch.
    let factor = total
        .clone()
        .add_scalar(1e-6)
        .recip()
        .mul_scalar(max_norm)
        .clamp_max(1.0);
    let mut scale = Scale::<B::InnerBackend> { grads, factor };
    model.visit(&mut scale);
    Some(total)
}
