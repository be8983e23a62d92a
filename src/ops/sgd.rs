//! [`SgdBackend`]: one SGD step of every parameter of a model as one operation.
//!
//! Burn's `Sgd` is about nine tensor operations per parameter (weight decay, momentum,
//! the update), each queued by the host: about 560 per ResNet-18 step and 1,450 per
//! ResNet-50 step. On CUDA the whole step is one operation of the fusion stream and one
//! kernel per parameter (`cuda`): ResNet-18 32 px bf16 channels-last about 28% faster
//! on an H200, ResNet-50 unchanged (BENCHMARKS.md, fourteenth session).

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

#[cfg(feature = "cuda")]
mod cuda {
    use burn::cubecl::cuda::CudaRuntime;
    use burn::tensor::ops::FloatTensor;
    use burn::tensor::{DType, Shape};
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use cubecl::calculate_cube_count_elemwise;
    use cubecl::prelude::*;

    use super::{SgdBackend, SgdStep, Stepped, step_reference};
    use crate::ops::channels_last_norm::widest_vector;

    /// One parameter's step, per vector of elements: weight decay, momentum, update.
    #[cube(launch)]
    fn sgd_kernel<N: Size>(
        param: &Tensor<Vector<f32, N>>,
        grad: &Tensor<Vector<f32, N>>,
        velocity: &Tensor<Vector<f32, N>>,
        new_param: &mut Tensor<Vector<f32, N>>,
        new_velocity: &mut Tensor<Vector<f32, N>>,
        len: usize,
        lr: f32,
        momentum: f32,
        dampening: f32,
        weight_decay: f32,
        #[comptime] decay: bool,
        #[comptime] with_momentum: bool,
        #[comptime] first: bool,
        #[comptime] nesterov: bool,
    ) {
        let i = ABSOLUTE_POS;
        if i >= len {
            terminate!();
        }
        let p = param[i];
        let mut g = grad[i];
        if comptime!(decay) {
            g = p * Vector::new(weight_decay) + g;
        }
        if comptime!(with_momentum) {
            let mut v = g;
            if comptime!(!first) {
                v = g * Vector::new(f32::new(1.0) - dampening)
                    + velocity[i] * Vector::new(momentum);
            }
            new_velocity[i] = v;
            if comptime!(nesterov) {
                g = v * Vector::new(momentum) + g;
            } else {
                g = v;
            }
        }
        new_param[i] = p - g * Vector::new(lr);
    }

    /// An f32 tensor of `shape` on `t`'s device.
    fn empty_like<R: CubeRuntime>(t: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
        empty_device_contiguous_dtype(t.client.clone(), t.device.clone(), shape, DType::F32)
    }

    /// One kernel for one parameter, its gradient and its velocity (all f32, of one
    /// shape).
    fn step_one<R: CubeRuntime>(
        param: &CubeTensor<R>,
        grad: &CubeTensor<R>,
        velocity: Option<&CubeTensor<R>>,
        step: SgdStep,
    ) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
        let (param, grad) = (
            into_contiguous(param.clone()),
            into_contiguous(grad.clone()),
        );
        let with_momentum = step.momentum > 0.0;
        let first = velocity.is_none();
        // Without a velocity, the gradient stands in for the argument (not read).
        let velocity = velocity.map_or_else(|| grad.clone(), |v| into_contiguous(v.clone()));
        let client = param.client.clone();
        let elements = param.meta.shape().num_elements();
        let vector = widest_vector(
            client.io_optimized_vector_sizes(DType::F32.size()),
            elements,
        );
        let len = elements / vector;
        let new_param = empty_like(&param, param.meta.shape().clone());
        let new_velocity = with_momentum.then(|| empty_like(&param, param.meta.shape().clone()));
        // Without momentum the kernel writes no velocity: one vector stands in.
        let velocity_out = new_velocity
            .clone()
            .unwrap_or_else(|| empty_like(&param, Shape::new([vector])));
        let dim = CubeDim::new(&client, len);
        sgd_kernel::launch::<R>(
            &client,
            calculate_cube_count_elemwise(&client, len, dim),
            dim,
            vector,
            param.into_tensor_arg(),
            grad.into_tensor_arg(),
            velocity.into_tensor_arg(),
            new_param.clone().into_tensor_arg(),
            velocity_out.into_tensor_arg(),
            len,
            step.lr as f32,
            step.momentum as f32,
            step.dampening as f32,
            step.weight_decay as f32,
            step.weight_decay > 0.0,
            with_momentum,
            first,
            step.nesterov,
        );
        (new_param, new_velocity)
    }

    impl<F: FloatElement, I: IntElement, BT: BoolElement> SgdBackend
        for CubeBackend<CudaRuntime, F, I, BT>
    {
        fn sgd_step(
            params: Vec<FloatTensor<Self>>,
            grads: Vec<FloatTensor<Self>>,
            velocities: Vec<Option<FloatTensor<Self>>>,
            step: SgdStep,
        ) -> Stepped<Self> {
            let fits = params
                .iter()
                .zip(&grads)
                .zip(&velocities)
                .all(|((p, g), v)| {
                    let same = |t: &CubeTensor<CudaRuntime>| {
                        t.dtype == DType::F32 && t.meta.shape() == p.meta.shape()
                    };
                    same(p) && same(g) && v.as_ref().is_none_or(same)
                });
            if !fits {
                return step_reference::<Self>(params, grads, velocities, step);
            }
            params
                .iter()
                .zip(&grads)
                .zip(&velocities)
                .map(|((p, g), v)| step_one(p, g, v.as_ref(), step))
                .unzip()
        }
    }
}

/// On a GPU only (`--ignored`): the CUDA kernels against Burn's operations.
#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::test_util::rel_diff;
    use burn::backend::cuda::{Cuda, CudaDevice};
    use burn::tensor::Distribution;

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn sgd_kernels_match_burns_operations_on_the_gpu() {
        let dev = CudaDevice::new(0);
        // A shape of no vector width, one of vectors, and a convolution weight's.
        let shapes = [vec![5], vec![64], vec![32, 16, 3, 3]];
        let inputs = |seed: u64| {
            <Cuda as Backend>::seed(&dev, seed);
            let make = || {
                shapes
                    .iter()
                    .map(|s| {
                        let n = s.iter().product::<usize>();
                        Tensor::<Cuda, 1>::random([n], Distribution::Normal(0.0, 1.0), &dev)
                            .into_primitive()
                            .tensor()
                    })
                    .collect::<Vec<_>>()
            };
            (make(), make(), make())
        };
        let values = |t: FloatTensor<Cuda>| tensor::<Cuda>(t).into_data().to_vec::<f32>().unwrap();
        for (momentum, nesterov, weight_decay, first) in [
            (0.9, false, 5e-4, true),
            (0.9, false, 5e-4, false),
            (0.9, true, 5e-4, false),
            (0.0, false, 5e-4, true),
            (0.9, false, 0.0, false),
        ] {
            let step = SgdStep {
                lr: 0.1,
                momentum,
                dampening: 0.0,
                nesterov,
                weight_decay,
            };
            let run = |kernels: bool| {
                let (p, g, v) = inputs(9);
                let v = v.into_iter().map(|v| (!first).then_some(v)).collect();
                if kernels {
                    <Cuda as SgdBackend>::sgd_step(p, g, v, step)
                } else {
                    step_reference::<Cuda>(p, g, v, step)
                }
            };
            let ((p1, v1), (p2, v2)) = (run(true), run(false));
            for (a, b) in p1.into_iter().zip(p2) {
                let rel = rel_diff(&values(a), &values(b));
                assert!(
                    rel < 1e-6,
                    "{step:?} first {first}: parameters differ by {rel}"
                );
            }
            for (a, b) in v1.into_iter().zip(v2) {
                assert_eq!(a.is_some(), b.is_some(), "{step:?}: velocities");
                if let (Some(a), Some(b)) = (a, b) {
                    let rel = rel_diff(&values(a), &values(b));
                    assert!(
                        rel < 1e-6,
                        "{step:?} first {first}: velocities differ by {rel}"
                    );
                }
            }
        }
    }
}
