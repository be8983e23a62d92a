//! Mixed precision (`train.precision`) and the activations' layout
//! (`kernels.channels_last`). Convolutions and the classifier's matmul take bfloat16 or
//! float16 copies of their input and of the fp32 master weights. In NCHW they hand
//! their result back in fp32, so BatchNorm, the residual additions, pooling, the loss
//! and the optimizer stay in fp32. Channels-last keeps the activations in the low
//! precision from the first convolution to the global pool, as PyTorch's autocast with
//! `channels_last` does: BatchNorm takes and returns them in it but computes its
//! statistics in fp32 on fp32 parameters; ReLU and the residual additions run in it;
//! the pool, the loss and the optimizer are fp32. Burn's casts are differentiable: the
//! backward pass runs the convolutions' gradients in the low precision and casts the
//! weight gradients back to fp32.

use burn::nn::conv::Conv2d;
use burn::nn::{Linear, PaddingConfig2d};
use burn::tensor::module::linear;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{FloatDType, Tensor};

use crate::config::Precision;
use crate::ops::{ConvBackend, Layout, conv2d};

/// How the network computes: number format and activation layout. Not part of the
/// weights, so a checkpoint resumes under any of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compute {
    pub precision: Precision,
    pub layout: Layout,
}

impl Compute {
    pub fn new(precision: Precision, channels_last: bool) -> Self {
        let layout = if channels_last {
            Layout::Nhwc
        } else {
            Layout::Nchw
        };
        Compute { precision, layout }
    }

    /// The dtype of the activations between layers: the compute dtype channels-last,
    /// fp32 (`None`) otherwise.
    pub fn activation_dtype(&self) -> Option<FloatDType> {
        match self.layout {
            Layout::Nchw => None,
            Layout::Nhwc => compute_dtype(self.precision),
        }
    }
}

impl Default for Compute {
    fn default() -> Self {
        Compute::new(Precision::Fp32, false)
    }
}

/// The dtype convolutions and matmuls compute in; `None` for fp32 (Burn's own path,
/// TF32 on the tensor cores).
pub fn compute_dtype(precision: Precision) -> Option<FloatDType> {
    match precision {
        Precision::Fp32 => None,
        Precision::Bf16 => Some(FloatDType::BF16),
        Precision::Fp16 => Some(FloatDType::F16),
    }
}

/// `conv.forward(x)` on `x` in `c.layout`, with the arithmetic in `c.precision`,
/// through [`ConvBackend`] (on CUDA, cuDNN where `kernels.convolution` allows); the
/// result has `x`'s dtype in NCHW, the compute dtype channels-last.
pub fn conv<B: ConvBackend>(conv: &Conv2d<B>, x: Tensor<B, 4>, c: Compute) -> Tensor<B, 4> {
    // kiln builds every convolution without bias and with symmetric explicit padding
    // (block::conv); anything else would need Burn's padding arithmetic, which is private.
    let PaddingConfig2d::Explicit(top, left, bottom, right) = conv.padding else {
        unreachable!("kiln's convolutions have explicit padding")
    };
    debug_assert!(top == bottom && left == right && conv.bias.is_none());
    let options = ConvOptions::new(conv.stride, [top, left], conv.dilation, conv.groups);
    // Burn keeps the weight as KCRS; channels-last convolutions take KRSC.
    let Some(low) = compute_dtype(c.precision) else {
        return conv2d(x, c.layout.laid_out(conv.weight.val()), options, c.layout);
    };
    let dtype = x.dtype();
    // Channels-last activations already come in the low precision: a cast to the same
    // dtype would still be a node of the autodiff graph, between the input and its two
    // consumers in a residual block, and the sum of their gradients would then be an
    // addition of its own instead of accumulating into the data gradient
    // (`ConvBackend::conv2d_grad_x_onto`).
    let x = if x.dtype() == low.into() {
        x
    } else {
        x.cast(low)
    };
    let y = conv2d(
        x,
        // The cast writes its result contiguous in the view's order, so the
        // low-precision KRSC weight that cuDNN reads in the forward and data-gradient
        // passes is not copied again; its gradient comes back as a KCRS view of a
        // KRSC buffer, which the optimizer takes as it is (`SgdBackend`).
        c.layout.laid_out(conv.weight.val()).cast(low),
        options,
        c.layout,
    );
    match c.layout {
        Layout::Nchw => y.cast(dtype),
        Layout::Nhwc => y,
    }
}

/// `fc.forward(x)` with the product in `precision`; the bias is added in `x`'s dtype.
/// Where the backend runs convolutions on a library ([`ConvBackend::products_as_convolutions`]:
/// cuDNN) the product is a 1x1 convolution ([`dense_as_convolution`]), since Burn's
/// matmul autotuning compiled about fifty kernels per shape, 60-100 s of a cold first
/// step for this one small layer (BENCHMARKS.md, "Cold start").
pub fn dense<B: ConvBackend>(
    fc: &Linear<B>,
    x: Tensor<B, 2>,
    precision: Precision,
) -> Tensor<B, 2> {
    if B::products_as_convolutions() {
        return dense_as_convolution(fc, x, precision);
    }
    let Some(low) = compute_dtype(precision) else {
        return fc.forward(x);
    };
    let dtype = x.dtype();
    let y = linear(x.cast(low), fc.weight.val().cast(low), None).cast(dtype);
    with_bias(fc, y)
}

/// `fc.forward(x)` as a 1x1 convolution of `[B, F, 1, 1]` through [`ConvBackend`], in
/// `precision`. The parameters stay `Linear`'s, so checkpoints and exports do not
/// depend on which way the product ran.
fn dense_as_convolution<B: ConvBackend>(
    fc: &Linear<B>,
    x: Tensor<B, 2>,
    precision: Precision,
) -> Tensor<B, 2> {
    let [n, features] = x.dims();
    let weight = fc.weight.val(); // [features, classes]
    let classes = weight.dims()[1];
    let dtype = x.dtype();
    let low = |t: Tensor<B, 2>| match compute_dtype(precision) {
        Some(low) => t.cast(low),
        None => t,
    };
    let options = ConvOptions::new([1, 1], [0, 0], [1, 1], 1);
    let y = conv2d(
        low(x).reshape([n, features, 1, 1]),
        low(weight.transpose()).reshape([classes, features, 1, 1]),
        options,
        Layout::Nchw,
    )
    .reshape([n, classes])
    .cast(dtype);
    with_bias(fc, y)
}

fn with_bias<B: ConvBackend>(fc: &Linear<B>, y: Tensor<B, 2>) -> Tensor<B, 2> {
    match &fc.bias {
        Some(b) => y + b.val().unsqueeze(),
        None => y,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::block;
    use crate::test_util::{TestBackend, device, rng_lock};
    use burn::module::Param;
    use burn::nn::LinearConfig;
    use burn::tensor::{DType, Distribution, Tolerance};

    fn input(dims: [usize; 4]) -> Tensor<TestBackend, 4> {
        Tensor::random(dims, Distribution::Normal(0.0, 1.0), &device())
    }

    #[test]
    fn fp32_is_burns_own_convolution() {
        let _rng = rng_lock();
        let c = block::conv::<TestBackend>(3, 4, 3, 2, &device());
        let x = input([2, 3, 9, 9]);
        let ours = conv(&c, x.clone(), Compute::default());
        ours.into_data().assert_eq(&c.forward(x).into_data(), true);
    }

    #[test]
    fn low_precision_convolutions_agree_with_fp32_and_return_fp32() {
        let _rng = rng_lock();
        for (k, stride) in [(3, 1), (3, 2), (1, 2), (7, 2)] {
            let c = block::conv::<TestBackend>(3, 8, k, stride, &device());
            let x = input([2, 3, 16, 16]);
            let reference = c.forward(x.clone());
            for p in [Precision::Bf16, Precision::Fp16] {
                let y = conv(&c, x.clone(), Compute::new(p, false));
                assert_eq!(y.dtype(), DType::F32);
                assert_eq!(y.dims(), reference.dims());
                // bf16 keeps 8 bits of mantissa: relative error about 2^-8 per product.
                y.into_data().assert_approx_eq::<f32>(
                    &reference.clone().into_data(),
                    Tolerance::absolute(0.08).set_relative(0.05),
                );
            }
        }
    }

    #[test]
    fn the_classifier_as_a_convolution_is_burns_linear_layer() {
        let _rng = rng_lock();
        let fc = LinearConfig::new(5, 3).init::<TestBackend>(&device());
        let x = Tensor::<TestBackend, 2>::random([4, 5], Distribution::Normal(0.0, 1.0), &device())
            .require_grad();
        let weights =
            Tensor::<TestBackend, 2>::random([4, 3], Distribution::Normal(0.0, 1.0), &device());
        let run = |ours: bool| {
            let y = if ours {
                dense_as_convolution(&fc, x.clone(), Precision::Fp32)
            } else {
                fc.forward(x.clone())
            };
            let g = (y.clone() * weights.clone()).sum().backward();
            (
                y.into_data(),
                x.grad(&g).unwrap().into_data(),
                fc.weight.val().grad(&g).unwrap().into_data(),
                fc.bias
                    .as_ref()
                    .unwrap()
                    .val()
                    .grad(&g)
                    .unwrap()
                    .into_data(),
            )
        };
        let (ours, burns) = (run(true), run(false));
        let tol = Tolerance::<f32>::absolute(1e-5);
        ours.0.assert_approx_eq::<f32>(&burns.0, tol);
        ours.1.assert_approx_eq::<f32>(&burns.1, tol);
        ours.2.assert_approx_eq::<f32>(&burns.2, tol);
        ours.3.assert_approx_eq::<f32>(&burns.3, tol);
    }

    #[test]
    fn low_precision_gradients_reach_the_fp32_weights() {
        let _rng = rng_lock();
        let c = block::conv::<TestBackend>(2, 3, 3, 1, &device());
        let fc = LinearConfig::new(3, 4).init::<TestBackend>(&device());
        let x = input([2, 2, 6, 6]);
        let grads = |p: Precision| {
            let y = conv(&c, x.clone(), Compute::new(p, false))
                .mean_dim(2)
                .mean_dim(3)
                .flatten(1, 3);
            let loss = dense(&fc, y, p).powi_scalar(2).mean();
            let g = loss.backward();
            let w = c.weight.grad(&g).unwrap();
            let b = fc.bias.as_ref().map(Param::val).unwrap().grad(&g).unwrap();
            (w, b)
        };
        let (w32, b32) = grads(Precision::Fp32);
        for p in [Precision::Bf16, Precision::Fp16] {
            let (w, b) = grads(p);
            assert_eq!(w.dtype(), DType::F32, "{p:?}");
            w.into_data().assert_approx_eq::<f32>(
                &w32.clone().into_data(),
                Tolerance::absolute(0.02).set_relative(0.05),
            );
            b.into_data().assert_approx_eq::<f32>(
                &b32.clone().into_data(),
                Tolerance::absolute(0.02).set_relative(0.05),
            );
        }
    }
}
