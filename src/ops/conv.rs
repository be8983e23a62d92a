//! [`ConvBackend`]: the convolution kiln's models call, with Burn's kernels by default
//! and the backward pass written out here, so a backend can put other kernels behind
//! all three parts (on CUDA: cuDNN, `ops::cudnn`).

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor};
use burn::tensor::{Tensor, TensorPrimitive};

/// A 2-D convolution without bias (kiln's convolutions have none: BatchNorm follows
/// each) and its two gradients. The defaults are Burn's own kernels.
pub trait ConvBackend: Backend {
    fn conv2d_nobias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d(x, weight, None, options)
    }

    /// The gradient with respect to the input, given the output's gradient.
    fn conv2d_grad_x(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d_x_backward(x, weight, output_grad, options)
    }

    /// The gradient with respect to the weight, given the output's gradient.
    fn conv2d_grad_weight(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d_weight_backward(x, weight, output_grad, options)
    }
}

impl ConvBackend for Flex {}

/// `conv2d(x, weight)` on tensors, through [`ConvBackend`].
pub fn conv2d<B: ConvBackend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    options: ConvOptions<2>,
) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::conv2d_nobias(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        options,
    )))
}

/// The backward pass routes both gradients through the inner backend's
/// [`ConvBackend`], so its kernels serve training, not only inference.
impl<B: ConvBackend, C: CheckpointStrategy> ConvBackend for Autodiff<B, C> {
    fn conv2d_nobias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct Conv2d;

        impl<B: ConvBackend> Backward<B, 2> for Conv2d {
            type State = (NodeId, NodeId, ConvOptions<2>);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                checkpointer: &mut Checkpointer,
            ) {
                let [node_x, node_weight] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (x_state, weight_state, options) = ops.state;
                let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x_state);
                let weight = checkpointer.retrieve_node_output::<FloatTensor<B>>(weight_state);
                if let Some(node) = node_x {
                    let dx =
                        B::conv2d_grad_x(x.clone(), weight.clone(), grad.clone(), options.clone());
                    grads.register::<B>(node.id, dx);
                }
                if let Some(node) = node_weight {
                    grads.register::<B>(node.id, B::conv2d_grad_weight(x, weight, grad, options));
                }
            }
        }

        match Conv2d
            .prepare::<C>([x.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let weight_state = prep.checkpoint(&weight);
                let y = B::conv2d_nobias(x.primitive, weight.primitive, options.clone());
                prep.finish((x_state, weight_state, options), y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::conv2d_nobias(x.primitive, weight.primitive, options))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TestBackend, max_diff, rng_lock};
    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
    use burn::tensor::backend::AutodiffBackend;
    use burn::tensor::{Distribution, module};

    fn values<B: Backend>(t: Tensor<B, 4>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    /// The same convolution through Burn's autodiff and through ours: same output,
    /// same gradients for input and weight, for a stride-1 and two strided cases.
    fn agrees_with_burn<B: ConvBackend + AutodiffBackend>() {
        let _rng = rng_lock();
        let dev = Default::default();
        for (stride, padding, size) in [(1, 1, 6), (2, 1, 7), (2, 0, 8)] {
            let normal = Distribution::Normal(0.0, 1.0);
            let x = Tensor::<B, 4>::random([2, 3, size, size], normal, &dev);
            let w = Tensor::<B, 4>::random([4, 3, 3, 3], normal, &dev);
            let options = ConvOptions::new([stride, stride], [padding, padding], [1, 1], 1);
            let run = |ours: bool| {
                let (x, w) = (x.clone().require_grad(), w.clone().require_grad());
                let y = if ours {
                    conv2d(x.clone(), w.clone(), options.clone())
                } else {
                    module::conv2d(x.clone(), w.clone(), None, options.clone())
                };
                // A loss that weighs every output differently, so a transposed or
                // misplaced gradient cannot pass.
                let n = y.shape().num_elements() as i64;
                let weights = Tensor::<B, 1, burn::tensor::Int>::arange(0..n, &dev)
                    .float()
                    .reshape(y.shape());
                let grads = (y.clone() * weights).sum().backward();
                (
                    values(y),
                    values(x.grad(&grads).unwrap()),
                    values(w.grad(&grads).unwrap()),
                )
            };
            let (y1, dx1, dw1) = run(true);
            let (y2, dx2, dw2) = run(false);
            assert!(max_diff(&y1, &y2) < 1e-4, "stride {stride}: outputs differ");
            assert!(
                max_diff(&dx1, &dx2) < 1e-2,
                "stride {stride}: input gradients differ"
            );
            assert!(
                max_diff(&dw1, &dw2) < 1e-2,
                "stride {stride}: weight gradients differ"
            );
            assert!(
                dw1.iter().any(|v| v.abs() > 1.0),
                "weight gradients are all but zero"
            );
        }
    }

    #[test]
    fn gradients_match_burns_convolution() {
        agrees_with_burn::<TestBackend>();
    }

    #[test]
    fn gradients_match_with_activation_recomputation() {
        agrees_with_burn::<Autodiff<Flex, BalancedCheckpointing>>();
    }
}
