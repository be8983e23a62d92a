//! [`NormBackend`]: BatchNorm's training pass (batch statistics) as one operation with
//! its backward pass written out, so a backend can run each direction as one kernel
//! (on CUDA: cuDNN, `ops::cudnn`). Through Burn's `BatchNorm` module a layer is about
//! a dozen element-wise and reduction operations forward and twice that backward,
//! each queued by the host; the batch-normalisation layers of a ResNet were most of
//! its step once cuDNN ran the convolutions (BENCHMARKS.md).

use std::marker::PhantomData;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{CheckpointStrategy, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::Flex;
use burn::nn::BatchNorm;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};

use super::Layout;
use super::activation::{ActivationBackend, relu};

/// BatchNorm with batch statistics over N, H and W of a tensor in `layout`, and its
/// gradients, optionally with the ReLU after it in the same pass (`relu`). `x` (and
/// `dy`) may be fp32, bf16 or fp16 (channels-last mixed precision); `gamma`, `beta` and
/// the statistics are fp32, and so is the arithmetic. The defaults are Burn's tensor
/// operations ([`train_reference`], [`grad_reference`]).
pub trait NormBackend: Backend {
    /// `x` normalised per channel with its batch mean and biased variance, scaled by
    /// `gamma` and shifted by `beta` (both `[C]`), then with `relu` `max(_, 0)`.
    /// Returns the output (`x`'s dtype), the batch mean and `1 / sqrt(variance +
    /// epsilon)` (both `[C]`).
    fn batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        relu: bool,
    ) -> [FloatTensor<Self>; 3] {
        train_reference::<Self>(x, gamma, beta, epsilon, layout, relu)
    }

    /// The gradients for `x`, `gamma` and `beta` given the output's gradient `dy`
    /// and the statistics the forward pass returned; with `relu`, `dy` is the ReLU
    /// output's gradient, zero where the normalised value was not positive.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_grad(
        x: FloatTensor<Self>,
        [gamma, beta]: [FloatTensor<Self>; 2],
        [mean, inv_std]: [FloatTensor<Self>; 2],
        dy: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        relu: bool,
    ) -> [FloatTensor<Self>; 3] {
        let _ = epsilon;
        grad_reference::<Self>(x, [gamma, beta], [mean, inv_std], dy, layout, relu)
    }

    /// [`NormBackend::batch_norm_train`] that also blends the batch statistics into the
    /// `running` mean and variance (both `[C]`, f32) as Burn's module does, with the
    /// biased variance: `running * (1 - momentum) + batch * momentum`. Returns the
    /// output, mean and inverse deviation, then the new running mean and variance.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_train_running(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        relu: bool,
        running: [FloatTensor<Self>; 2],
        momentum: f64,
    ) -> [FloatTensor<Self>; 5] {
        let [y, mean, inv_std] = Self::batch_norm_train(x, gamma, beta, epsilon, layout, relu);
        let stats = [mean.clone(), inv_std.clone()];
        let [rm, rv] = blend_reference::<Self>(running, stats, epsilon, momentum);
        [y, mean, inv_std, rm, rv]
    }

    /// `relu(batch_norm(x) + residual)`, a residual block's end (`residual` of `x`'s
    /// shape and dtype), with the running statistics' update
    /// ([`NormBackend::batch_norm_train_running`]): returns the output, mean, inverse
    /// deviation, new running mean and variance.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_add_relu_train(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        running: [FloatTensor<Self>; 2],
        momentum: f64,
    ) -> [FloatTensor<Self>; 5] {
        add_relu_train_reference::<Self>(
            x, residual, gamma, beta, epsilon, layout, running, momentum,
        )
    }

    /// The gradients of [`NormBackend::batch_norm_add_relu_train`] given its output
    /// `out` and `out`'s gradient: the input's, gamma's, beta's and the residual's.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_add_relu_grad(
        x: FloatTensor<Self>,
        out: FloatTensor<Self>,
        params: [FloatTensor<Self>; 2],
        stats: [FloatTensor<Self>; 2],
        dout: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
    ) -> [FloatTensor<Self>; 4] {
        add_relu_grad_reference::<Self>(x, out, params, stats, dout, epsilon, layout)
    }

    /// Whether the training pass of a layer in `layout` is better given the ReLU after
    /// it (`relu`) and the running statistics' update
    /// ([`NormBackend::batch_norm_train_running`]) than followed by them: where the
    /// backend's kernels do them in the same pass, which saves a read and a write of
    /// the activation each way and a dozen small operations per layer; at a residual
    /// block's end, the addition too ([`NormBackend::batch_norm_add_relu_train`]).
    fn fuses_norm_epilogue(layout: Layout) -> bool {
        let _ = layout;
        false
    }
}

/// [`NormBackend::batch_norm_add_relu_train`] as the layer's pass, an addition and a
/// ReLU.
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_relu_train_reference<B: NormBackend>(
    x: FloatTensor<B>,
    residual: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    epsilon: f64,
    layout: Layout,
    running: [FloatTensor<B>; 2],
    momentum: f64,
) -> [FloatTensor<B>; 5] {
    let [y, mean, inv_std, rm, rv] =
        B::batch_norm_train_running(x, gamma, beta, epsilon, layout, false, running, momentum);
    let out = burn::tensor::activation::relu(tensor::<B, 4>(y) + tensor(residual));
    [primitive(out), mean, inv_std, rm, rv]
}

/// [`NormBackend::batch_norm_add_relu_grad`] as the ReLU's mask by its output, then
/// the layer's gradients.
pub(crate) fn add_relu_grad_reference<B: NormBackend>(
    x: FloatTensor<B>,
    out: FloatTensor<B>,
    params: [FloatTensor<B>; 2],
    stats: [FloatTensor<B>; 2],
    dout: FloatTensor<B>,
    epsilon: f64,
    layout: Layout,
) -> [FloatTensor<B>; 4] {
    let cut = tensor::<B, 4>(out).lower_equal_elem(0.0);
    let g = primitive(tensor::<B, 4>(dout).mask_fill(cut, 0.0));
    let [dx, dgamma, dbeta] =
        B::batch_norm_grad(x, params, stats, g.clone(), epsilon, layout, false);
    [dx, dgamma, dbeta, g]
}

/// The running statistics blended with a batch's mean and inverse deviation, in Burn's
/// tensor operations.
pub(crate) fn blend_reference<B: Backend>(
    [running_mean, running_var]: [FloatTensor<B>; 2],
    [mean, inv_std]: [FloatTensor<B>; 2],
    epsilon: f64,
    momentum: f64,
) -> [FloatTensor<B>; 2] {
    let var = tensor::<B, 1>(inv_std).recip().square().sub_scalar(epsilon);
    let blend = |running: FloatTensor<B>, batch: Tensor<B, 1>| {
        primitive(
            tensor::<B, 1>(running)
                .mul_scalar(1.0 - momentum)
                .add(batch.mul_scalar(momentum)),
        )
    };
    [blend(running_mean, tensor(mean)), blend(running_var, var)]
}

impl NormBackend for Flex {}

fn tensor<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// The per-channel sum of a tensor in `layout`, `[C]`.
fn channel_sum<B: Backend>(t: Tensor<B, 4>, layout: Layout) -> Tensor<B, 1> {
    match layout {
        Layout::Nchw => {
            let [n, c, h, w] = t.dims();
            t.swap_dims(0, 1)
                .reshape([c, n * h * w])
                .sum_dim(1)
                .reshape([c])
        }
        Layout::Nhwc => {
            let [n, h, w, c] = t.dims();
            t.reshape([n * h * w, c]).sum_dim(0).reshape([c])
        }
    }
}

/// `[C]` shaped to broadcast over a tensor in `layout`.
fn per_channel<B: Backend>(t: Tensor<B, 1>, layout: Layout) -> Tensor<B, 4> {
    let c = t.dims()[0];
    match layout {
        Layout::Nchw => t.reshape([1, c, 1, 1]),
        Layout::Nhwc => t.reshape([1, 1, 1, c]),
    }
}

/// How many values each channel's statistics are taken over.
fn per_channel_count(dims: [usize; 4], layout: Layout) -> f64 {
    (dims.iter().product::<usize>() / dims[layout.channel_axis()]) as f64
}

/// [`NormBackend::batch_norm_train`] in Burn's tensor operations, the arithmetic of
/// Burn's `BatchNorm`, in f32.
pub(crate) fn train_reference<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    epsilon: f64,
    layout: Layout,
    relu: bool,
) -> [FloatTensor<B>; 3] {
    let x = tensor::<B, 4>(x);
    let dtype = x.dtype();
    let x = x.cast(FloatDType::F32);
    let count = per_channel_count(x.dims(), layout);
    let mean = channel_sum(x.clone(), layout).div_scalar(count);
    let centered = x - per_channel(mean.clone(), layout);
    let var = channel_sum(centered.clone().square(), layout).div_scalar(count);
    let inv_std = var.add_scalar(epsilon).sqrt().recip();
    let scale = inv_std.clone() * tensor::<B, 1>(gamma);
    let y = centered * per_channel(scale, layout) + per_channel(tensor::<B, 1>(beta), layout);
    // Rounding to `dtype` keeps the sign, so ReLU before it is ReLU after it.
    let y = if relu { y.clamp_min(0.0) } else { y };
    [
        primitive(y.cast(dtype)),
        primitive(mean),
        primitive(inv_std),
    ]
}

/// `dy` (in `x`'s dtype) zero where the forward pass's normalised `x` was not
/// positive, so where a ReLU after it passed nothing: the gradient through that ReLU.
pub(crate) fn relu_grad_reference<B: Backend>(
    x: FloatTensor<B>,
    [gamma, beta]: [FloatTensor<B>; 2],
    [mean, inv_std]: [FloatTensor<B>; 2],
    dy: FloatTensor<B>,
    layout: Layout,
) -> FloatTensor<B> {
    let x = tensor::<B, 4>(x).cast(FloatDType::F32);
    let scale = tensor::<B, 1>(gamma) * tensor::<B, 1>(inv_std);
    let bias = tensor::<B, 1>(beta) - tensor::<B, 1>(mean) * scale.clone();
    let pre = x * per_channel(scale, layout) + per_channel(bias, layout);
    primitive(tensor::<B, 4>(dy).mask_fill(pre.lower_equal_elem(0.0), 0.0))
}

/// [`NormBackend::batch_norm_grad`] in Burn's tensor operations, in f32.
pub(crate) fn grad_reference<B: Backend>(
    x: FloatTensor<B>,
    [gamma, beta]: [FloatTensor<B>; 2],
    [mean, inv_std]: [FloatTensor<B>; 2],
    dy: FloatTensor<B>,
    layout: Layout,
    relu: bool,
) -> [FloatTensor<B>; 3] {
    let dy = if relu {
        let stats = [mean.clone(), inv_std.clone()];
        relu_grad_reference::<B>(x.clone(), [gamma.clone(), beta], stats, dy, layout)
    } else {
        dy
    };
    let x = tensor::<B, 4>(x);
    let dtype = x.dtype();
    let (x, dy) = (
        x.cast(FloatDType::F32),
        tensor::<B, 4>(dy).cast(FloatDType::F32),
    );
    let inv_std = tensor::<B, 1>(inv_std);
    let count = per_channel_count(x.dims(), layout);
    let c = |t: Tensor<B, 1>| per_channel(t, layout);
    let x_hat = (x - c(tensor::<B, 1>(mean))) * c(inv_std.clone());
    let dbeta = channel_sum(dy.clone(), layout);
    let dgamma = channel_sum(dy.clone() * x_hat.clone(), layout);
    let dx =
        (dy - c(dbeta.clone().div_scalar(count)) - x_hat * c(dgamma.clone().div_scalar(count)))
            * c(tensor::<B, 1>(gamma) * inv_std);
    [
        primitive(dx.cast(dtype)),
        primitive(dgamma),
        primitive(dbeta),
    ]
}

/// `bn.forward(x)` on `x` in `layout`, with the training pass through
/// [`NormBackend`]: the same arithmetic and running-statistics update as Burn's module
/// (biased variance, `momentum`), so checkpoints and evaluation do not change.
/// Inference (a backend without autodiff) is Burn's own element-wise pass, or the same
/// arithmetic written out here for channels-last and low-precision inputs, which
/// Burn's module does not take.
pub fn batch_norm<B: NormBackend>(
    bn: &BatchNorm<B>,
    x: Tensor<B, 4>,
    layout: Layout,
) -> Tensor<B, 4> {
    let device = x.device();
    if !B::ad_enabled(&device) {
        if layout == Layout::Nchw && x.dtype() == DType::F32 {
            return bn.forward(x);
        }
        return inference(bn, x, layout);
    }
    train_pass(bn, x, layout, false)
}

/// `relu(batch_norm(bn, x, layout))`, in one pass where the backend has one
/// ([`NormBackend::fuses_norm_epilogue`]).
pub fn batch_norm_relu<B: NormBackend + ActivationBackend>(
    bn: &BatchNorm<B>,
    x: Tensor<B, 4>,
    layout: Layout,
) -> Tensor<B, 4> {
    if B::fuses_norm_epilogue(layout) && B::ad_enabled(&x.device()) {
        return train_pass(bn, x, layout, true);
    }
    relu(batch_norm(bn, x, layout))
}

/// `relu(batch_norm(bn, x, layout) + residual)`, a residual block's end, in one pass
/// where the backend has one ([`NormBackend::fuses_norm_epilogue`]).
pub fn batch_norm_add_relu<B: NormBackend + ActivationBackend>(
    bn: &BatchNorm<B>,
    x: Tensor<B, 4>,
    residual: Tensor<B, 4>,
    layout: Layout,
) -> Tensor<B, 4> {
    if !(B::fuses_norm_epilogue(layout) && B::ad_enabled(&x.device())) {
        return relu(batch_norm(bn, x, layout) + residual);
    }
    add_relu_pass(bn, x, residual, layout)
}

/// [`batch_norm_add_relu`]'s training pass in one operation, and the running
/// statistics' update.
pub(crate) fn add_relu_pass<B: NormBackend>(
    bn: &BatchNorm<B>,
    x: Tensor<B, 4>,
    residual: Tensor<B, 4>,
    layout: Layout,
) -> Tensor<B, 4> {
    let device = x.device();
    let running =
        [&bn.running_mean, &bn.running_var].map(|r| primitive(r.value_sync().to_device(&device)));
    let [out, _, _, mean, var] = B::batch_norm_add_relu_train(
        primitive(x),
        primitive(residual),
        primitive(bn.gamma.val()),
        primitive(bn.beta.val()),
        bn.epsilon,
        layout,
        running,
        bn.momentum,
    );
    bn.running_mean.update(tensor::<B, 1>(mean).detach());
    bn.running_var.update(tensor::<B, 1>(var).detach());
    tensor(out)
}

/// The training pass of [`batch_norm`] (with `relu`, of [`batch_norm_relu`]) and the
/// running statistics' update: in the pass where the backend fuses it.
fn train_pass<B: NormBackend>(
    bn: &BatchNorm<B>,
    x: Tensor<B, 4>,
    layout: Layout,
    relu: bool,
) -> Tensor<B, 4> {
    train_pass_with(bn, x, layout, relu, B::fuses_norm_epilogue(layout))
}

/// [`train_pass`], the running statistics updated in the pass with `in_pass`.
pub(crate) fn train_pass_with<B: NormBackend>(
    bn: &BatchNorm<B>,
    x: Tensor<B, 4>,
    layout: Layout,
    relu: bool,
    in_pass: bool,
) -> Tensor<B, 4> {
    let device = x.device();
    let (gamma, beta) = (primitive(bn.gamma.val()), primitive(bn.beta.val()));
    let running = || {
        [&bn.running_mean, &bn.running_var].map(|r| primitive(r.value_sync().to_device(&device)))
    };
    let (y, [mean, var]) = if in_pass {
        let [y, _, _, mean, var] = B::batch_norm_train_running(
            primitive(x),
            gamma,
            beta,
            bn.epsilon,
            layout,
            relu,
            running(),
            bn.momentum,
        );
        (y, [mean, var])
    } else {
        let [y, mean, inv_std] =
            B::batch_norm_train(primitive(x), gamma, beta, bn.epsilon, layout, relu);
        let stats = [mean, inv_std].map(|t| primitive(tensor::<B, 1>(t).detach()));
        (
            y,
            blend_reference::<B>(running(), stats, bn.epsilon, bn.momentum),
        )
    };
    bn.running_mean.update(tensor::<B, 1>(mean).detach());
    bn.running_var.update(tensor::<B, 1>(var).detach());
    tensor(y)
}

/// BatchNorm with the running statistics, in f32, the result in `x`'s dtype.
fn inference<B: Backend>(bn: &BatchNorm<B>, x: Tensor<B, 4>, layout: Layout) -> Tensor<B, 4> {
    let dtype = x.dtype();
    let device = x.device();
    let inv_std = bn
        .running_var
        .value()
        .to_device(&device)
        .add_scalar(bn.epsilon)
        .sqrt()
        .recip();
    let scale = bn.gamma.val() * inv_std;
    let shift = bn.beta.val() - bn.running_mean.value().to_device(&device) * scale.clone();
    let y = x.cast(FloatDType::F32) * per_channel(scale, layout) + per_channel(shift, layout);
    y.cast(dtype)
}

/// The training pass as one node of the autodiff graph, its gradients through the
/// inner backend's [`NormBackend`]. Memory-bound: under `kernels.gradient_checkpointing`
/// the output is recomputed in the backward pass rather than kept, as Burn's
/// element-wise BatchNorm was.
impl<B: NormBackend, C: CheckpointStrategy> NormBackend for Autodiff<B, C> {
    fn fuses_norm_epilogue(layout: Layout) -> bool {
        B::fuses_norm_epilogue(layout)
    }

    fn batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        relu: bool,
    ) -> [FloatTensor<Self>; 3] {
        let train = |x, gamma, beta| B::batch_norm_train(x, gamma, beta, epsilon, layout, relu);
        norm_node::<B, C, 3>([x, gamma, beta], epsilon, layout, relu, train)
    }

    fn batch_norm_train_running(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        relu: bool,
        [running_mean, running_var]: [FloatTensor<Self>; 2],
        momentum: f64,
    ) -> [FloatTensor<Self>; 5] {
        let running = [running_mean.primitive, running_var.primitive];
        let train = |x, gamma, beta| {
            B::batch_norm_train_running(x, gamma, beta, epsilon, layout, relu, running, momentum)
        };
        norm_node::<B, C, 5>([x, gamma, beta], epsilon, layout, relu, train)
    }

    fn batch_norm_add_relu_train(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        running: [FloatTensor<Self>; 2],
        momentum: f64,
    ) -> [FloatTensor<Self>; 5] {
        add_relu_node::<B, C>(
            [x, residual, gamma, beta],
            epsilon,
            layout,
            running,
            momentum,
        )
    }
}

/// [`NormBackend::batch_norm_add_relu_train`] as one node that keeps the input and the
/// output (the next layer keeps that anyway), or under activation recomputation the
/// same arithmetic as separate nodes.
fn add_relu_node<B: NormBackend, C: CheckpointStrategy>(
    [x, residual, gamma, beta]: [FloatTensor<Autodiff<B, C>>; 4],
    epsilon: f64,
    layout: Layout,
    [running_mean, running_var]: [FloatTensor<Autodiff<B, C>>; 2],
    momentum: f64,
) -> [FloatTensor<Autodiff<B, C>>; 5] {
    type A<B, C> = Autodiff<B, C>;
    if std::any::TypeId::of::<C>() != std::any::TypeId::of::<NoCheckpointing>() {
        let [y, mean, inv_std, rm, rv] = A::<B, C>::batch_norm_train_running(
            x,
            gamma,
            beta,
            epsilon,
            layout,
            false,
            [running_mean, running_var],
            momentum,
        );
        let out = burn::tensor::activation::relu(tensor::<A<B, C>, 4>(y) + tensor(residual));
        return [primitive(out), mean, inv_std, rm, rv];
    }

    #[derive(Debug)]
    struct NormAddRelu;

    #[derive(Debug, Clone)]
    struct State<T> {
        x: NodeId,
        gamma: NodeId,
        beta: NodeId,
        out: T,
        mean: T,
        inv_std: T,
        epsilon: f64,
        layout: Layout,
    }

    impl<B: NormBackend> Backward<B, 4> for NormAddRelu {
        type State = State<FloatTensor<B>>;

        fn backward(
            self,
            ops: Ops<Self::State, 4>,
            grads: &mut Gradients,
            checkpointer: &mut Checkpointer,
        ) {
            let [node_x, node_residual, node_gamma, node_beta] = ops.parents;
            let dout = grads.consume::<B>(&ops.node);
            let s = ops.state;
            let mut get = |id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id);
            let (x, gamma, beta) = (get(s.x), get(s.gamma), get(s.beta));
            let stats = [s.mean, s.inv_std];
            let [dx, dgamma, dbeta, dresidual] = B::batch_norm_add_relu_grad(
                x,
                s.out,
                [gamma, beta],
                stats,
                dout,
                s.epsilon,
                s.layout,
            );
            let pairs = [
                (node_x, dx),
                (node_residual, dresidual),
                (node_gamma, dgamma),
                (node_beta, dbeta),
            ];
            for (node, grad) in pairs {
                if let Some(node) = node {
                    grads.register::<B>(node.id, grad);
                }
            }
        }
    }

    let running = [running_mean.primitive, running_var.primitive];
    let nodes = [&x, &residual, &gamma, &beta].map(|t| t.node.clone());
    let train = |x, residual, gamma, beta| {
        B::batch_norm_add_relu_train(x, residual, gamma, beta, epsilon, layout, running, momentum)
    };
    match NormAddRelu.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(mut prep) => {
            let (x_state, gamma_state, beta_state) = (
                prep.checkpoint(&x),
                prep.checkpoint(&gamma),
                prep.checkpoint(&beta),
            );
            let [out, mean, inv_std, rm, rv] = train(
                x.primitive,
                residual.primitive,
                gamma.primitive,
                beta.primitive,
            );
            let state = State {
                x: x_state,
                gamma: gamma_state,
                beta: beta_state,
                out: out.clone(),
                mean: mean.clone(),
                inv_std: inv_std.clone(),
                epsilon,
                layout,
            };
            [
                prep.finish(state, out),
                A::<B, C>::from_inner(mean),
                A::<B, C>::from_inner(inv_std),
                A::<B, C>::from_inner(rm),
                A::<B, C>::from_inner(rv),
            ]
        }
        OpsKind::UnTracked(prep) => {
            let [out, mean, inv_std, rm, rv] = train(
                x.primitive,
                residual.primitive,
                gamma.primitive,
                beta.primitive,
            );
            [
                prep.finish(out),
                A::<B, C>::from_inner(mean),
                A::<B, C>::from_inner(inv_std),
                A::<B, C>::from_inner(rm),
                A::<B, C>::from_inner(rv),
            ]
        }
    }
}

/// One node for the training pass `train` (the output, mean and inverse deviation,
/// then what else it returns, untracked).
fn norm_node<B: NormBackend, C: CheckpointStrategy, const K: usize>(
    [x, gamma, beta]: [FloatTensor<Autodiff<B, C>>; 3],
    epsilon: f64,
    layout: Layout,
    relu: bool,
    train: impl FnOnce(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) -> [FloatTensor<B>; K],
) -> [FloatTensor<Autodiff<B, C>>; K] {
    #[derive(Debug)]
    struct Norm;

    #[derive(Debug)]
    struct Retro<B> {
        parents: [NodeId; 3],
        epsilon: f64,
        layout: Layout,
        relu: bool,
        _backend: PhantomData<B>,
    }

    impl<B: NormBackend> RetroForward for Retro<B> {
        fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
            let [x, gamma, beta] = self
                .parents
                .map(|id| states.get_state::<FloatTensor<B>>(&id));
            let [y, _, _] =
                B::batch_norm_train(x, gamma, beta, self.epsilon, self.layout, self.relu);
            states.save(out_node, y)
        }
    }

    /// What the backward pass needs: the input, gamma and beta (checkpointed), the
    /// batch mean and inverse deviation, and how the pass was made.
    #[derive(Debug, Clone)]
    struct State<T> {
        x: NodeId,
        gamma: NodeId,
        beta: NodeId,
        mean: T,
        inv_std: T,
        epsilon: f64,
        layout: Layout,
        relu: bool,
    }

    impl<B: NormBackend> Backward<B, 3> for Norm {
        type State = State<FloatTensor<B>>;

        fn backward(
            self,
            ops: Ops<Self::State, 3>,
            grads: &mut Gradients,
            checkpointer: &mut Checkpointer,
        ) {
            let [node_x, node_gamma, node_beta] = ops.parents;
            let dy = grads.consume::<B>(&ops.node);
            let s = ops.state;
            let mut get = |id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id);
            let (x, gamma, beta) = (get(s.x), get(s.gamma), get(s.beta));
            let stats = [s.mean, s.inv_std];
            let [dx, dgamma, dbeta] =
                B::batch_norm_grad(x, [gamma, beta], stats, dy, s.epsilon, s.layout, s.relu);
            for (node, grad) in [(node_x, dx), (node_gamma, dgamma), (node_beta, dbeta)] {
                if let Some(node) = node {
                    grads.register::<B>(node.id, grad);
                }
            }
        }
    }

    let retro = Retro::<B> {
        parents: [x.node.id, gamma.node.id, beta.node.id],
        epsilon,
        layout,
        relu,
        _backend: PhantomData,
    };
    let outs = match Norm
        .prepare::<C>([x.node.clone(), gamma.node.clone(), beta.node.clone()])
        .memory_bound()
        .retro_forward(retro)
        .parents([&x, &gamma, &beta])
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let (x_state, gamma_state, beta_state) = (
                prep.checkpoint(&x),
                prep.checkpoint(&gamma),
                prep.checkpoint(&beta),
            );
            let outs = train(x.primitive, gamma.primitive, beta.primitive);
            let state = State {
                x: x_state,
                gamma: gamma_state,
                beta: beta_state,
                mean: outs[1].clone(),
                inv_std: outs[2].clone(),
                epsilon,
                layout,
                relu,
            };
            let mut outs = Vec::from(outs).into_iter();
            let y = outs.next().expect("the output comes first");
            let mut all = vec![prep.finish(state, y)];
            all.extend(outs.map(Autodiff::<B, C>::from_inner));
            all
        }
        OpsKind::UnTracked(prep) => {
            let mut outs =
                Vec::from(train(x.primitive, gamma.primitive, beta.primitive)).into_iter();
            let y = outs.next().expect("the output comes first");
            let mut all = vec![prep.finish(y)];
            all.extend(outs.map(Autodiff::<B, C>::from_inner));
            all
        }
    };
    outs.try_into()
        .unwrap_or_else(|_| unreachable!("as many outputs as the inner pass returned"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TestBackend, max_diff, rng_lock, weighed_sum};
    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
    use burn::module::Param;
    use burn::nn::BatchNormConfig;
    use burn::tensor::Distribution;

    fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    /// Two training steps' forward and backward through Burn's `BatchNorm` and
    /// through [`batch_norm`] from the same module, in both layouts: same outputs, same
    /// gradients for the input, gamma and beta, same running statistics. With `relu`,
    /// Burn's module and ReLU against the pass with the ReLU inside it; with `in_pass`,
    /// the running statistics updated by the pass itself.
    fn agrees_with_burn<B: NormBackend + AutodiffBackend>(relu: bool, in_pass: bool) {
        agrees_with_burn_after::<B>(relu, in_pass, false)
    }

    /// [`agrees_with_burn`]; with `add`, a residual added before the ReLU (Burn's
    /// module, an addition and Burn's ReLU against [`add_relu_pass`]), its gradient
    /// compared too.
    fn agrees_with_burn_after<B: NormBackend + AutodiffBackend>(
        relu: bool,
        in_pass: bool,
        add: bool,
    ) {
        let _rng = rng_lock();
        let dev = Default::default();
        // A fresh module per run: clones share their running statistics.
        let make = || {
            let bn = BatchNormConfig::new(5).init::<B>(&dev);
            // Gamma and beta away from 1 and 0, so a gradient that ignores them fails.
            BatchNorm {
                gamma: Param::from_tensor(Tensor::full([5], 1.5, &dev)),
                beta: Param::from_tensor(Tensor::full([5], 0.25, &dev)),
                ..bn
            }
        };
        // `None`: Burn's module.
        let run = |ours: Option<Layout>| {
            let bn = make();
            let mut out = Vec::new();
            for step in 0..2 {
                let x = Tensor::<B, 4>::random([3, 5, 4, 6], Distribution::Normal(2.0, 3.0), &dev)
                    .add_scalar(step as f64)
                    .require_grad();
                let r = Tensor::<B, 4>::random([3, 5, 4, 6], Distribution::Normal(0.0, 1.0), &dev)
                    .require_grad();
                let nhwc = |t: Tensor<B, 4>| t.permute([0, 2, 3, 1]);
                let pass = |x, r, layout| match (add, relu || in_pass) {
                    (true, _) => add_relu_pass(&bn, x, r, layout),
                    (false, true) => train_pass_with(&bn, x, layout, relu, in_pass),
                    (false, false) => batch_norm(&bn, x, layout),
                };
                let y = match ours {
                    Some(Layout::Nchw) => pass(x.clone(), r.clone(), Layout::Nchw),
                    Some(Layout::Nhwc) => {
                        pass(nhwc(x.clone()), nhwc(r.clone()), Layout::Nhwc).permute([0, 3, 1, 2])
                    }
                    None if add => {
                        burn::tensor::activation::relu(bn.forward(x.clone()) + r.clone())
                    }
                    None if relu => burn::tensor::activation::relu(bn.forward(x.clone())),
                    None => bn.forward(x.clone()),
                };
                let grads = weighed_sum(y.clone()).backward();
                let dr = r.grad(&grads).map(values).unwrap_or_default();
                out.push([
                    values(y),
                    values(x.grad(&grads).unwrap()),
                    dr,
                    values(bn.gamma.grad(&grads).unwrap()),
                    values(bn.beta.grad(&grads).unwrap()),
                    values(bn.running_mean.value()),
                    values(bn.running_var.value()),
                ]);
            }
            out
        };
        // Same random inputs for both runs.
        B::seed(&dev, 3);
        let burn = run(None);
        let names = [
            "output",
            "x grad",
            "residual grad",
            "gamma grad",
            "beta grad",
            "running mean",
            "running var",
        ];
        for layout in [Layout::Nchw, Layout::Nhwc] {
            B::seed(&dev, 3);
            let ours = run(Some(layout));
            for (step, (a, b)) in ours.iter().zip(&burn).enumerate() {
                for (name, (p, q)) in names.iter().zip(a.iter().zip(b)) {
                    assert!(
                        max_diff(p, q) < 1e-4,
                        "{layout:?} step {step}: {name} differs: {p:?} vs {q:?}"
                    );
                }
            }
            assert!(
                ours[1][3].iter().any(|v| v.abs() > 1e-3),
                "gamma gradients are all but zero"
            );
            if add {
                assert!(ours[1][2].contains(&0.0) && ours[1][2].iter().any(|&g| g != 0.0));
            }
            if relu || add {
                // The ReLU cut somewhere, and let something through.
                assert!(ours[1][0].contains(&0.0) && ours[1][0].iter().any(|&v| v > 0.0));
            }
        }
    }

    #[test]
    fn batch_norm_matches_burns_module() {
        agrees_with_burn::<TestBackend>(false, false);
    }

    #[test]
    fn batch_norm_matches_with_activation_recomputation() {
        agrees_with_burn::<Autodiff<Flex, BalancedCheckpointing>>(false, false);
    }

    #[test]
    fn batch_norm_updating_running_statistics_in_the_pass_matches_burns_module() {
        agrees_with_burn::<TestBackend>(false, true);
    }

    #[test]
    fn batch_norm_with_relu_inside_matches_burns_module_and_relu() {
        agrees_with_burn::<TestBackend>(true, true);
        agrees_with_burn::<TestBackend>(true, false);
    }

    #[test]
    fn batch_norm_add_relu_in_one_node_matches_burns_module_addition_and_relu() {
        agrees_with_burn_after::<TestBackend>(true, true, true);
    }

    #[test]
    fn batch_norm_add_relu_matches_with_activation_recomputation() {
        agrees_with_burn_after::<Autodiff<Flex, BalancedCheckpointing>>(true, true, true);
    }

    #[test]
    fn batch_norm_with_relu_inside_matches_with_activation_recomputation() {
        agrees_with_burn::<Autodiff<Flex, BalancedCheckpointing>>(true, true);
    }

    /// Inference uses the running statistics, as Burn's module does, in either layout
    /// and (to bf16's precision) on bf16 inputs.
    #[test]
    fn inference_is_burns_module() {
        use burn::module::RunningState;
        let _rng = rng_lock();
        let dev = Default::default();
        let normal = Distribution::Normal(1.0, 2.0);
        let bn = BatchNormConfig::new(3).init::<Flex>(&dev);
        let bn = BatchNorm {
            gamma: Param::from_tensor(Tensor::random([3], normal, &dev)),
            beta: Param::from_tensor(Tensor::random([3], normal, &dev)),
            running_mean: RunningState::new(Tensor::random([3], normal, &dev)),
            running_var: RunningState::new(Tensor::random([3], normal, &dev).abs()),
            ..bn
        };
        let x = Tensor::<Flex, 4>::random([2, 3, 4, 5], normal, &dev);
        let burn = values(bn.forward(x.clone()));
        assert_eq!(values(batch_norm(&bn, x.clone(), Layout::Nchw)), burn);
        let nhwc = batch_norm(&bn, x.clone().permute([0, 2, 3, 1]), Layout::Nhwc);
        assert!(max_diff(&values(nhwc.permute([0, 3, 1, 2])), &burn) < 1e-5);
        let low = batch_norm(&bn, x.cast(FloatDType::BF16), Layout::Nchw);
        assert_eq!(low.dtype(), DType::BF16);
        let low = values(low.cast(FloatDType::F32));
        let scale = burn.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(max_diff(&low, &burn) < 0.02 * scale, "bf16 inference");
    }

    /// A bf16 input's training pass is computed in f32 and agrees with the fp32 pass to
    /// bf16's precision; its output and input gradient are bf16, the rest f32.
    #[test]
    fn low_precision_input_keeps_f32_statistics() {
        let _rng = rng_lock();
        let dev = Default::default();
        let bn = BatchNormConfig::new(4).init::<TestBackend>(&dev);
        let x =
            Tensor::<TestBackend, 4>::random([3, 5, 6, 4], Distribution::Normal(2.0, 3.0), &dev);
        let run = |dtype: FloatDType| {
            let x = x.clone().cast(dtype).require_grad();
            let y = batch_norm(&bn, x.clone(), Layout::Nhwc);
            let grads = weighed_sum(y.clone()).backward();
            let dx = x.grad(&grads).unwrap();
            let dgamma = bn.gamma.grad(&grads).unwrap();
            (
                y.dtype(),
                dx.dtype(),
                dgamma.dtype(),
                values(y.cast(FloatDType::F32)),
                values(dx.cast(FloatDType::F32)),
                values(dgamma),
            )
        };
        let (_, _, _, y32, dx32, dg32) = run(FloatDType::F32);
        let (ty, tdx, tdg, y16, dx16, dg16) = run(FloatDType::BF16);
        assert_eq!((ty, tdx, tdg), (DType::BF16, DType::BF16, DType::F32));
        for (name, a, b) in [
            ("output", &y16, &y32),
            ("x grad", &dx16, &dx32),
            ("gamma grad", &dg16, &dg32),
        ] {
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(max_diff(a, b) < 0.02 * scale, "{name}: {a:?} vs {b:?}");
        }
    }
}
