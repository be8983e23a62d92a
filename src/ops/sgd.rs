//! [`SgdBackend`]: one SGD step of every parameter of a model as one operation.
//!
//! Burn's `Sgd` is about nine tensor operations per parameter (weight decay, momentum,
//! the update), each queued by the host: about 560 per ResNet-18 step and 1,450 per
//! ResNet-50 step. On CUDA the whole step is one operation of the fusion stream and one
//! kernel for up to 32 parameters (`cuda::sgd`; 6-7 launches for ResNet-50's 161
//! parameters): on an H200, ResNet-18 32 px bf16 channels-last about 28% faster than
//! Burn's operations and ResNet-50 a further 15% than one kernel per parameter
//! (BENCHMARKS.md, "Throughput").

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

/// The step's constants, as `torch.optim.SGD` and Burn's `Sgd` take them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStep {
    pub lr: f64,
    /// 0 for none.
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    /// L2 penalty added to the gradient; 0 for none.
    pub weight_decay: f64,
}

/// Parameters after one step, and each one's new velocity (`None` without momentum).
pub type Stepped<B> = (Vec<FloatTensor<B>>, Vec<Option<FloatTensor<B>>>);

pub trait SgdBackend: Backend {
    /// One step of every parameter `params[i]` (f32) with its gradient `grads[i]` and
    /// its velocity `velocities[i]` (`None` on its first step with momentum, when the
    /// velocity becomes the gradient, as Burn's `Sgd` does). The default is Burn's
    /// arithmetic in its tensor operations ([`step_reference`]).
    fn sgd_step(
        params: Vec<FloatTensor<Self>>,
        grads: Vec<FloatTensor<Self>>,
        velocities: Vec<Option<FloatTensor<Self>>>,
        step: SgdStep,
    ) -> Stepped<Self> {
        step_reference::<Self>(params, grads, velocities, step)
    }
}

impl SgdBackend for Flex {}

/// The optimizer works on the inner backend; an autodiff backend has the trait only
/// to be a `ModelBackend`.
impl<B: SgdBackend, C: CheckpointStrategy> SgdBackend for Autodiff<B, C> {}

fn tensor<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// [`SgdBackend::sgd_step`] in Burn's tensor operations, in the order Burn's `Sgd`
/// applies them: weight decay, momentum (Nesterov's if asked), the update.
pub(crate) fn step_reference<B: Backend>(
    params: Vec<FloatTensor<B>>,
    grads: Vec<FloatTensor<B>>,
    velocities: Vec<Option<FloatTensor<B>>>,
    step: SgdStep,
) -> Stepped<B> {
    params
        .into_iter()
        .zip(grads)
        .zip(velocities)
        .map(|((param, grad), velocity)| {
            // Rank does not matter to element-wise operations.
            let (param, mut grad) = (tensor::<B>(param), tensor::<B>(grad));
            if step.weight_decay > 0.0 {
                grad = param.clone().mul_scalar(step.weight_decay).add(grad);
            }
            let mut new_velocity = None;
            if step.momentum > 0.0 {
                let v = match velocity {
                    Some(v) => grad
                        .clone()
                        .mul_scalar(1.0 - step.dampening)
                        .add(tensor::<B>(v).mul_scalar(step.momentum)),
                    None => grad.clone(),
                };
                grad = if step.nesterov {
                    v.clone().mul_scalar(step.momentum).add(grad)
                } else {
                    v.clone()
                };
                new_velocity = Some(v.into_primitive().tensor());
            }
            let param = param - grad.mul_scalar(step.lr);
            (param.into_primitive().tensor(), new_velocity)
        })
        .unzip()
}
