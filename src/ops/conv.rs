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

use super::Layout;

/// A 2-D convolution without bias (kiln's convolutions have none: BatchNorm follows
/// each) and its two gradients, with every tensor in `layout`. The defaults are Burn's
/// own kernels ([`burn_conv2d`]).
pub trait ConvBackend: Backend {
    /// Whether a matrix product is better run as a 1x1 convolution here
    /// (`model::precision::dense`): where the convolutions are a library's (cuDNN),
    /// which plans a shape without compiling kernels. Burn's own kernels take the
    /// product as it is.
    fn products_as_convolutions() -> bool {
        false
    }

    fn conv2d_nobias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        burn_conv2d::<Self>(ConvPass::Forward, x, weight, None, options, layout)
    }

    /// The gradient with respect to the input, given the output's gradient.
    fn conv2d_grad_x(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        burn_conv2d::<Self>(
            ConvPass::GradX,
            x,
            weight,
            Some(output_grad),
            options,
            layout,
        )
    }

    /// [`ConvBackend::conv2d_grad_x`] added to `onto`, a gradient of the same input
    /// from its other consumer (a residual block's input feeds its first convolution
    /// and its shortcut). A library that accumulates into its output (cuDNN) does the
    /// sum in the same pass instead of writing the gradient and adding it after.
    fn conv2d_grad_x_onto(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        onto: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        let dx = Self::conv2d_grad_x(x, weight, output_grad, options, layout);
        Self::float_add(dx, onto)
    }

    /// The gradient with respect to the weight, given the output's gradient.
    fn conv2d_grad_weight(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        let grad = Some(output_grad);
        burn_conv2d::<Self>(ConvPass::GradWeight, x, weight, grad, options, layout)
    }
}

impl ConvBackend for Flex {}

/// One part of the convolution on Burn's kernels, which take NCHW: channels-last
/// tensors go in and come out as permuted views (`grad` is the output's gradient, for
/// the two backward parts).
pub(crate) fn burn_conv2d<B: Backend>(
    part: ConvPass,
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: Option<FloatTensor<B>>,
    options: ConvOptions<2>,
    layout: Layout,
) -> FloatTensor<B> {
    let (x, weight) = (layout.nchw_view::<B>(x), layout.nchw_view::<B>(weight));
    let grad = grad.map(|g| layout.nchw_view::<B>(g));
    let out = match (part, grad) {
        (ConvPass::Forward, _) => B::conv2d(x, weight, None, options),
        (ConvPass::GradX, Some(g)) => B::conv2d_x_backward(x, weight, g, options),
        (ConvPass::GradWeight, Some(g)) => B::conv2d_weight_backward(x, weight, g, options),
        (_, None) => unreachable!("a convolution's gradient needs the output's gradient"),
    };
    layout.laid_out_view::<B>(out)
}

/// `conv2d(x, weight)` on tensors in `layout`, through [`ConvBackend`].
pub fn conv2d<B: ConvBackend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    options: ConvOptions<2>,
    layout: Layout,
) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::conv2d_nobias(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        options,
        layout,
    )))
}

/// The backward pass routes both gradients through the inner backend's
/// [`ConvBackend`], so its kernels serve training, not only inference.
impl<B: ConvBackend, C: CheckpointStrategy> ConvBackend for Autodiff<B, C> {
    fn products_as_convolutions() -> bool {
        B::products_as_convolutions()
    }

    fn conv2d_nobias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct Conv2d;

        impl<B: ConvBackend> Backward<B, 2> for Conv2d {
            /// The last part finds the gradient that the input's other consumer
            /// registered before this step runs: Burn looks gradients up by tensor, so
            /// it is the input's handle, with the weight's buffer (which the step keeps
            /// anyway) in place of the input's, which it may not keep.
            type State = (
                NodeId,
                NodeId,
                ConvOptions<2>,
                Layout,
                FloatTensor<Autodiff<B>>,
            );

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                checkpointer: &mut Checkpointer,
            ) {
                let [node_x, node_weight] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (x_state, weight_state, options, layout, input_key) = ops.state;
                let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x_state);
                let weight = checkpointer.retrieve_node_output::<FloatTensor<B>>(weight_state);
                if let Some(node) = node_x {
                    let (x, w, g) = (x.clone(), weight.clone(), grad.clone());
                    let o = options.clone();
                    let dx = match grads.remove::<B>(&input_key) {
                        Some(onto) => B::conv2d_grad_x_onto(x, w, g, onto, o, layout),
                        None => B::conv2d_grad_x(x, w, g, o, layout),
                    };
                    grads.register::<B>(node.id, dx);
                }
                if let Some(node) = node_weight {
                    let dw = B::conv2d_grad_weight(x, weight, grad, options, layout);
                    grads.register::<B>(node.id, dw);
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
                let mut input_key = x.clone();
                input_key.primitive = weight.primitive.clone();
                let y = B::conv2d_nobias(x.primitive, weight.primitive, options.clone(), layout);
                prep.finish((x_state, weight_state, options, layout, input_key), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::conv2d_nobias(
                x.primitive,
                weight.primitive,
                options,
                layout,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TestBackend, max_diff, rel_diff, rng_lock, weighed_sum};
    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
    use burn::tensor::backend::AutodiffBackend;
    use burn::tensor::{Distribution, module};

    fn values<B: Backend>(t: Tensor<B, 4>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    /// The same convolution through Burn's autodiff and through ours, in both layouts:
    /// same output, same gradients for input and weight, for a stride-1 and two
    /// strided cases, with the input feeding a second consumer as well.
    fn agrees_with_burn<B: ConvBackend + AutodiffBackend>() {
        let _rng = rng_lock();
        let dev = Default::default();
        let cases = [(1, 1, 6), (2, 1, 7), (2, 0, 8)];
        for ((stride, padding, size), layout) in cases
            .into_iter()
            .flat_map(|c| [(c, Layout::Nchw), (c, Layout::Nhwc)])
        {
            let normal = Distribution::Normal(0.0, 1.0);
            let x = Tensor::<B, 4>::random([2, 3, size, size], normal, &dev);
            let w = Tensor::<B, 4>::random([4, 3, 3, 3], normal, &dev);
            let options = ConvOptions::new([stride, stride], [padding, padding], [1, 1], 1);
            let run = |ours: bool| {
                let (x, w) = (x.clone().require_grad(), w.clone().require_grad());
                let nhwc = |t: Tensor<B, 4>| t.permute([0, 2, 3, 1]);
                // The convolution's input has a second consumer, recorded after it (as
                // a residual block's shortcut is), so that its gradient is there when
                // the convolution's backward step runs and the data gradient adds
                // onto it.
                let (y, input) = match (ours, layout) {
                    (true, Layout::Nchw) => (
                        conv2d(x.clone(), w.clone(), options.clone(), layout),
                        x.clone(),
                    ),
                    // Channels-last views in, an NCHW view of the output back out; the
                    // gradients reach the NCHW leaves through the permutations.
                    (true, Layout::Nhwc) => {
                        let input = nhwc(x.clone());
                        let y = conv2d(input.clone(), nhwc(w.clone()), options.clone(), layout);
                        (y.permute([0, 3, 1, 2]), input)
                    }
                    (false, _) => (
                        module::conv2d(x.clone(), w.clone(), None, options.clone()),
                        x.clone(),
                    ),
                };
                let shortcut = match (ours, layout) {
                    (true, Layout::Nhwc) => input.permute([0, 3, 1, 2]),
                    _ => input,
                };
                let loss = weighed_sum(y.clone()) + weighed_sum(shortcut * 0.5);
                let grads = loss.backward();
                (
                    values(y),
                    values(x.grad(&grads).unwrap()),
                    values(w.grad(&grads).unwrap()),
                )
            };
            let (y1, dx1, dw1) = run(true);
            let (y2, dx2, dw2) = run(false);
            let case = format!("{layout:?} stride {stride}");
            assert!(max_diff(&y1, &y2) < 1e-4, "{case}: outputs differ");
            assert!(
                rel_diff(&dx1, &dx2) < 1e-6,
                "{case}: input gradients differ"
            );
            assert!(
                rel_diff(&dw1, &dw2) < 1e-6,
                "{case}: weight gradients differ"
            );
            assert!(
                dw1.iter().any(|v| v.abs() > 0.1),
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

/// The three parts of a convolution a backend can replace.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConvPass {
    Forward,
    GradX,
    GradWeight,
}
