//! Clipping by the global L2 norm of all gradients, as `torch.nn.utils.clip_grad_norm_`.
//! (Burn's optimizer clipping works per parameter tensor.) The scale is computed on
//! the device, so clipping adds no host synchronisation.

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::grads::{map_each, sum_each};

/// Scales `grads` so their global norm is at most `max_norm`; returns the norm before
/// clipping, as a device tensor (read it only when logging).
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> Option<Tensor<B::InnerBackend, 1>> {
    let total = sum_each::<B, M>(model, grads, |g| g.square().sum())?.sqrt();
    // min(1, max_norm / (norm + 1e-6)), as PyTorch.
    let factor = total
        .clone()
        .add_scalar(1e-6)
        .recip()
        .mul_scalar(max_norm)
        .clamp_max(1.0);
    map_each::<B, M>(model, grads, |g| g * factor.clone());
    Some(total)
}
