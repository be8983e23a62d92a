//! [`ActivationBackend`]: ReLU whose backward pass keeps its output instead of its
//! input.
//!
//! Burn's autodiff ReLU keeps its input for the backward pass. In a ResNet that input
//! is a BatchNorm output (or a residual sum) that nothing else needs, while the output
//! is kept anyway by the convolution that reads it: so every ReLU held one activation
//! more than PyTorch's in-place ReLU does, 2.3 of the 7.7 GiB that ResNet-50 at batch
//! 128 held after its forward pass (BENCHMARKS.md, "Memory"). The output says as much
//! as the input (`y > 0` exactly where `x > 0`), and Burn's `relu_backward` masks with
//! the output already.

use std::any::TypeId;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{CheckpointStrategy, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{ActivationOps, FloatTensor};
use burn::tensor::{Tensor, TensorPrimitive};

/// ReLU as kiln's models call it. The default is Burn's.
pub trait ActivationBackend: Backend {
    fn relu_keeping_output(x: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as ActivationOps<Self>>::relu(x)
    }
}

impl ActivationBackend for Flex {}

/// `max(x, 0)` through [`ActivationBackend`].
pub fn relu<B: ActivationBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::relu_keeping_output(
        x.into_primitive().tensor(),
    )))
}

/// One autodiff node that keeps the output. Under gradient checkpointing Burn's own
/// ReLU stays: there its input is not kept but recomputed, and the output is what
/// would be recomputed for the next convolution.
impl<B: Backend, C: CheckpointStrategy> ActivationBackend for Autodiff<B, C> {
    fn relu_keeping_output(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if TypeId::of::<C>() != TypeId::of::<NoCheckpointing>() {
            return <Self as ActivationOps<Self>>::relu(x);
        }

        #[derive(Debug)]
        struct Relu;

        impl<B: Backend> Backward<B, 1> for Relu {
            /// The output.
            type State = FloatTensor<B>;

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let [parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                if let Some(parent) = parent {
                    grads.register::<B>(parent.id, B::relu_backward(ops.state, grad));
                }
            }
        }

        match Relu
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::relu(x.primitive);
                prep.finish(y.clone(), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::relu(x.primitive)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TestBackend, max_diff, rng_lock};
    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
    use burn::tensor::Distribution;
    use burn::tensor::backend::AutodiffBackend;

    fn values<B: Backend>(t: Tensor<B, 4>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    /// Output and input gradient equal Burn's ReLU's, through a product after it (so
    /// the gradient reaching the ReLU is not all ones) and with exact zeros in the
    /// input (where both take the gradient as zero).
    fn agrees_with_burn<B: ActivationBackend + AutodiffBackend>() {
        let _rng = rng_lock();
        let dev = Default::default();
        let x = Tensor::<B, 4>::random([2, 3, 5, 4], Distribution::Normal(0.0, 1.0), &dev)
            .mask_fill(
                Tensor::<B, 4>::random([2, 3, 5, 4], Distribution::Uniform(0.0, 1.0), &dev)
                    .lower_elem(0.1),
                0.0,
            );
        let w = Tensor::<B, 4>::random([2, 3, 5, 4], Distribution::Normal(0.0, 1.0), &dev);
        let run = |ours: bool| {
            let x = x.clone().require_grad();
            let y = if ours {
                relu(x.clone())
            } else {
                burn::tensor::activation::relu(x.clone())
            };
            let grads = (y.clone() * w.clone()).sum().backward();
            let dx = x.grad(&grads).unwrap();
            (values(y.inner()), values(dx))
        };
        let (ours, burns) = (run(true), run(false));
        assert_eq!(max_diff(&ours.0, &burns.0), 0.0, "output");
        assert_eq!(max_diff(&ours.1, &burns.1), 0.0, "gradient");
        assert!(ours.1.contains(&0.0) && ours.1.iter().any(|&g| g != 0.0));
    }

    #[test]
    fn relu_matches_burns_relu() {
        agrees_with_burn::<TestBackend>();
    }

    #[test]
    fn under_activation_recomputation_burns_relu_runs_and_agrees() {
        agrees_with_burn::<Autodiff<Flex, BalancedCheckpointing>>();
    }

    /// The node keeps the output, not the input: once the forward pass lets go of
    /// the input, the test's own copy is its only holder (Burn's ReLU fails this).
    #[test]
    fn relu_keeps_its_output_not_its_input() {
        let _rng = rng_lock();
        let dev = Default::default();
        let x = Tensor::<TestBackend, 2>::random([4, 4], Distribution::Normal(0.0, 1.0), &dev)
            .require_grad();
        let pre = x.clone() * 2.0;
        let held = pre.clone().into_primitive().tensor().primitive;
        let y = relu(pre);
        assert!(held.is_unique(), "the ReLU's input is still held");
        let grads = (y * 3.0).sum().backward();
        let dx: Vec<f32> = x.grad(&grads).unwrap().into_data().to_vec().unwrap();
        let x: Vec<f32> = x.into_data().to_vec().unwrap();
        for (g, v) in dx.iter().zip(&x) {
            assert_eq!(*g, if *v > 0.0 { 6.0 } else { 0.0 });
        }
    }
}
