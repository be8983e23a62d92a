//! BatchNorm's training pass in kiln's own cubecl kernels (`kernels.batch_norm =
//! "auto"`), in both layouts, on cubecl's stream like every other kernel of the step.
//!
//! cuDNN's channels-last batch norm runs persistent kernels that need the whole GPU at
//! once; they cannot be ordered against cubecl's stream on the GPU (`stream_order`),
//! so the host waited for each of them: 106 times per ResNet-50 step, the largest
//! wait left in it. cuDNN's NCHW kernels queue, but take the ReLU after a layer, a
//! residual addition and the running statistics' update as separate kernels. Here
//! each direction is three launches that queue like any other and take those in:
//!
//! 1. per-channel partial sums, each cube over a slice of one or more channels' values
//!    (`channels_last`, `nchw`: how each layout is read);
//! 2. one cube per vector of channels adds the partial sums up (its threads share out
//!    the parts) and turns them into the statistics and the per-channel coefficients
//!    of step 3 ([`stat_finish`], [`grad_finish`], shared by both layouts);
//! 3. one element-wise pass writes the output (forward) or the input's gradient.
//!
//! Forward sums are of `x - x[0, c]`: one shift per channel that every cube reads, so
//! partial sums still add, and the variance does not lose its digits to a mean far
//! from zero. Sums are f32 whatever the input's type; the reduction order is fixed,
//! so results are reproducible.

mod channels_last;
mod nchw;

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::ops::Layout;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether batch norm runs on these kernels. Set once, before training.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Threads per cube of the finishing kernels, all along the parts.
const FINISH_THREADS: u32 = 256;

/// The finishing kernels' cubes: one per column (a vector of channels, or a channel),
/// its threads sharing out the parts. A cube per span of columns, its rows of threads
/// each adding tens of parts one load after another, took 14-20 µs per layer (1.8 ms
/// of a ResNet-50 step on an H200), waiting on memory with a few cubes on the whole
/// GPU.
fn finish_cubes(columns: usize) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(columns.max(1) as u32, 1, 1),
        CubeDim::new_2d(1, FINISH_THREADS),
    )
}

/// The running statistics and their momentum, where a pass blends them.
type Running<'a, R> = Option<([&'a CubeTensor<R>; 2], f64)>;

/// [`NormBackend::batch_norm_train_running`](crate::ops::NormBackend) for `x` in
/// `layout` (f32, bf16 or fp16) and f32 `gamma`, `beta`: with `running` (mean,
/// variance, momentum) the running statistics blended with the batch's, returned last
/// (without it, the last two are scratch); with `residual` (`x`'s shape and dtype)
/// added to the output before the ReLU, `relu` after. `None` where these kernels do
/// not apply (not 4-D, another dtype, parameters not f32 `[C]`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn train_running<R: CubeRuntime>(
    layout: Layout,
    x: &CubeTensor<R>,
    residual: Option<&CubeTensor<R>>,
    gamma: &CubeTensor<R>,
    beta: &CubeTensor<R>,
    epsilon: f64,
    relu: bool,
    running: Running<'_, R>,
) -> Option<[CubeTensor<R>; 5]> {
    if residual.is_some_and(|r| r.dtype != x.dtype || r.meta.shape() != x.meta.shape()) {
        return None;
    }
    match layout {
        Layout::Nhwc => {
            channels_last::train_running(x, residual, gamma, beta, epsilon, relu, running)
        }
        Layout::Nchw => nchw::train_running(x, residual, gamma, beta, epsilon, relu, running),
    }
}

/// [`NormBackend::batch_norm_grad`](crate::ops::NormBackend) for the inputs of
/// [`train_running`] (and its `relu`), its statistics and the output's gradient `dy`
/// (`x`'s shape and dtype); `None` where these kernels do not apply.
pub(crate) fn grad<R: CubeRuntime>(
    layout: Layout,
    x: &CubeTensor<R>,
    params: [&CubeTensor<R>; 2],
    stats: [&CubeTensor<R>; 2],
    dy: &CubeTensor<R>,
    relu: bool,
) -> Option<[CubeTensor<R>; 3]> {
    grad_masked(layout, x, params, stats, dy, relu, None).map(|(grads, _)| grads)
}

/// The gradients of a layer whose output was added to a residual and passed through a
/// ReLU with output `out` ([`train_running`] with a residual), given `out`'s gradient:
/// the input's, gamma's, beta's, and the residual's (`dout` through the ReLU).
pub(crate) fn grad_after_add<R: CubeRuntime>(
    layout: Layout,
    x: &CubeTensor<R>,
    params: [&CubeTensor<R>; 2],
    stats: [&CubeTensor<R>; 2],
    out: &CubeTensor<R>,
    dout: &CubeTensor<R>,
) -> Option<[CubeTensor<R>; 4]> {
    if out.dtype != x.dtype || out.meta.shape() != x.meta.shape() {
        return None;
    }
    let ([dx, d_gamma, d_beta], masked) =
        grad_masked(layout, x, params, stats, dout, false, Some(out))?;
    Some([dx, d_gamma, d_beta, masked?])
}

/// [`grad`], with `mask_by` first masking `dy` by that ReLU output (returned too).
fn grad_masked<R: CubeRuntime>(
    layout: Layout,
    x: &CubeTensor<R>,
    params: [&CubeTensor<R>; 2],
    stats: [&CubeTensor<R>; 2],
    dy: &CubeTensor<R>,
    relu: bool,
    mask_by: Option<&CubeTensor<R>>,
) -> Option<Masked<R>> {
    if dy.dtype != x.dtype || dy.meta.shape() != x.meta.shape() {
        return None;
    }
    match layout {
        Layout::Nhwc => channels_last::grad_masked(x, params, stats, dy, relu, mask_by),
        Layout::Nchw => nchw::grad_masked(x, params, stats, dy, relu, mask_by),
    }
}

/// `a` and `b` added up over the cube's rows of threads: every thread gets the sums
/// of its column of threads.
#[cube]
fn sum_rows<N: Size>(
    a: Vector<f32, N>,
    b: Vector<f32, N>,
    #[comptime] threads: usize,
) -> (Vector<f32, N>, Vector<f32, N>) {
    let mut shared_a = SharedMemory::<Vector<f32, N>>::new(threads);
    let mut shared_b = SharedMemory::<Vector<f32, N>>::new(threads);
    let width = CUBE_DIM_X as usize;
    let me = UNIT_POS_Y as usize * width + UNIT_POS_X as usize;
    shared_a[me] = a;
    shared_b[me] = b;
    sync_cube();
    let mut half = CUBE_DIM_Y as usize / 2;
    while half > 0 {
        if (UNIT_POS_Y as usize) < half {
            let other = me + half * width;
            shared_a[me] = shared_a[me] + shared_a[other];
            shared_b[me] = shared_b[me] + shared_b[other];
        }
        sync_cube();
        half /= 2;
    }
    let top = UNIT_POS_X as usize;
    (shared_a[top], shared_b[top])
}

/// The column this thread sums, and the one it reads (the last, past the end: every
/// thread takes part in the cube's additions).
#[cube]
fn columns_of(columns: usize) -> (usize, usize) {
    let column = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let mut read = column;
    if read >= columns {
        read = columns - 1;
    }
    (column, read)
}

/// The two sums of column `read` over every part (`[parts, columns]` each), the
/// parts shared out over the cube's rows of threads: one thread per channel adding
/// hundreds of parts in turn took 27 µs per layer on an H200.
#[cube]
fn add_parts<N: Size>(
    a: &Tensor<Vector<f32, N>>,
    b: &Tensor<Vector<f32, N>>,
    read: usize,
    columns: usize,
    parts: usize,
    #[comptime] threads: usize,
) -> (Vector<f32, N>, Vector<f32, N>) {
    let mut sum_a = Vector::<f32, N>::new(f32::new(0.0));
    let mut sum_b = Vector::<f32, N>::new(f32::new(0.0));
    let mut p = UNIT_POS_Y as usize;
    while p < parts {
        sum_a += a[p * columns + read];
        sum_b += b[p * columns + read];
        p += CUBE_DIM_Y as usize;
    }
    sum_rows::<N>(sum_a, sum_b, threads)
}

/// Forward step 2, per channel: the mean, `1 / sqrt(variance + epsilon)`, the
/// output's `scale` and `bias` (`y = x * scale + bias`), and with `running` the
/// running statistics blended with the batch's. One cube per column (a vector of
/// channels, or one channel); its threads share out the parts. The partial sums are of
/// `x - x[c * shift_stride]` (each channel's first value).
#[cube(launch)]
fn stat_finish<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    sums: &Tensor<Vector<f32, N>>,
    squares: &Tensor<Vector<f32, N>>,
    gamma: &Tensor<Vector<f32, N>>,
    beta: &Tensor<Vector<f32, N>>,
    mean: &mut Tensor<Vector<f32, N>>,
    inv_std: &mut Tensor<Vector<f32, N>>,
    scale: &mut Tensor<Vector<f32, N>>,
    bias: &mut Tensor<Vector<f32, N>>,
    running_mean: &Tensor<Vector<f32, N>>,
    running_var: &Tensor<Vector<f32, N>>,
    new_mean: &mut Tensor<Vector<f32, N>>,
    new_var: &mut Tensor<Vector<f32, N>>,
    columns: usize,
    shift_stride: usize,
    parts: usize,
    count: f32,
    epsilon: f32,
    momentum: f32,
    #[comptime] threads: usize,
    #[comptime] running: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (c, read) = columns_of(columns);
    let (sum, square) = add_parts::<N>(sums, squares, read, columns, parts, threads);
    if UNIT_POS_Y == 0 && c < columns {
        let n = Vector::<f32, N>::new(count);
        let shifted_mean = sum / n;
        let variance = max(
            square / n - shifted_mean * shifted_mean,
            Vector::<f32, N>::new(f32::new(0.0)),
        );
        let m = Vector::<f32, N>::cast_from(x[c * shift_stride]) + shifted_mean;
        let s = Vector::<f32, N>::new(f32::new(1.0))
            / Vector::<f32, N>::sqrt(variance + Vector::<f32, N>::new(epsilon));
        mean[c] = m;
        inv_std[c] = s;
        let k = gamma[c] * s;
        scale[c] = k;
        bias[c] = beta[c] - m * k;
        if running {
            let keep = Vector::<f32, N>::new(f32::new(1.0) - momentum);
            let take = Vector::<f32, N>::new(momentum);
            new_mean[c] = running_mean[c] * keep + m * take;
            new_var[c] = running_var[c] * keep + variance * take;
        }
    }
}

/// `dy`, with `relu` zero where the forward pass's `x * scale + bias` was not
/// positive (where ReLU's output was zero): the same arithmetic as [`stat_finish`] and
/// [`normalize`], so the same elements.
#[cube]
fn through_relu<N: Size>(
    dy: Vector<f32, N>,
    x: Vector<f32, N>,
    scale: Vector<f32, N>,
    bias: Vector<f32, N>,
    #[comptime] relu: bool,
) -> Vector<f32, N> {
    let mut g = dy;
    if relu {
        let zero = Vector::<f32, N>::new(f32::new(0.0));
        g = select_many((x * scale + bias).greater_than(zero), dy, zero);
    }
    g
}

/// Backward step 2, per channel: the parameters' gradients and the coefficients of
/// `dx = k_dy * dy + k_x * (x - mean) + k_1`. Cubes as in [`stat_finish`].
#[cube(launch)]
fn grad_finish<N: Size>(
    sums: &Tensor<Vector<f32, N>>,
    products: &Tensor<Vector<f32, N>>,
    gamma: &Tensor<Vector<f32, N>>,
    inv_std: &Tensor<Vector<f32, N>>,
    d_gamma: &mut Tensor<Vector<f32, N>>,
    d_beta: &mut Tensor<Vector<f32, N>>,
    k_dy: &mut Tensor<Vector<f32, N>>,
    k_x: &mut Tensor<Vector<f32, N>>,
    k_1: &mut Tensor<Vector<f32, N>>,
    columns: usize,
    parts: usize,
    count: f32,
    #[comptime] threads: usize,
) {
    let (c, read) = columns_of(columns);
    let (sum, product) = add_parts::<N>(sums, products, read, columns, parts, threads);
    if UNIT_POS_Y == 0 && c < columns {
        let n = Vector::<f32, N>::new(count);
        let s = inv_std[c];
        let k = gamma[c] * s;
        d_beta[c] = sum;
        d_gamma[c] = product * s;
        k_dy[c] = k;
        // cubecl's CUDA code has no unary minus for vectors.
        let zero = Vector::<f32, N>::new(f32::new(0.0));
        k_x[c] = zero - k * s * s * product / n;
        k_1[c] = zero - k * sum / n;
    }
}

/// The widest of the `offered` vector widths that divides `channels` (for the SGD
/// kernels, a parameter's element count).
pub(crate) fn widest_vector(offered: impl Iterator<Item = usize>, channels: usize) -> usize {
    offered
        .filter(|v| *v > 0 && channels.is_multiple_of(*v))
        .max()
        .unwrap_or(1)
}

/// Whether each of `tensors` is f32 of shape `[channels]`.
fn per_channel_f32<R: CubeRuntime>(tensors: &[&CubeTensor<R>], channels: usize) -> bool {
    tensors
        .iter()
        .all(|t| t.dtype == DType::F32 && t.meta.shape().as_slice() == [channels])
}

/// The input's, gamma's and beta's gradients, and the masked output gradient there is
/// one.
type Masked<R> = ([CubeTensor<R>; 3], Option<CubeTensor<R>>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_divide_the_channels() {
        let offered = || [8, 4, 2, 1].into_iter();
        assert_eq!(widest_vector(offered(), 64), 8);
        assert_eq!(widest_vector(offered(), 12), 4);
        assert_eq!(widest_vector(offered(), 6), 2);
        assert_eq!(widest_vector(offered(), 5), 1);
        assert_eq!(widest_vector([4, 2, 1].into_iter(), 64), 4);
    }
}
