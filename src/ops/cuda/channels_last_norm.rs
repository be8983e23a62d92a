//! BatchNorm's training pass over channels-last activations in kiln's own cubecl
//! kernels (`kernels.batch_norm = "auto"` with `kernels.channels_last`), on cubecl's
//! stream like every other kernel of the step.
//!
//! cuDNN's channels-last batch norm runs persistent kernels that need the whole GPU at
//! once; they cannot be ordered against cubecl's stream on the GPU (`stream_order`),
//! so the host waited for each of them: 106 times per ResNet-50 step, the largest
//! wait left in it. Here each direction is three
//! launches that queue like any other:
//!
//! 1. per-channel partial sums, each cube over a slice of the rows (N·H·W) and a span
//!    of channels, read along the channels so that loads coalesce;
//! 2. one cube per vector of channels adds the partial sums up (its threads share out
//!    the parts) and turns them into the statistics and the per-channel coefficients
//!    of step 3;
//! 3. one element-wise pass writes the output (forward) or the input's gradient.
//!
//! Forward sums are of `x - x[0, c]`: one shift per channel that every cube reads, so
//! partial sums still add, and the variance does not lose its digits to a mean far
//! from zero. Sums are f32 whatever the input's type; the reduction order is fixed,
//! so results are reproducible.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether channels-last batch norm runs on these kernels. Set once, before training.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Threads per cube of the partial sums.
const THREADS: u32 = 256;
/// Threads per cube of the finishing kernels, all along the parts.
const FINISH_THREADS: u32 = 256;
/// Cubes of partial sums to aim for per SM, so that every SM has work and waits
/// between loads are hidden.
const CUBES_PER_SM: usize = 4;
/// Fewer rows than this per cube and the partial sums cost more than they save.
const MIN_ROWS_PER_PART: usize = 32;

/// How the partial sums split a `[rows, columns]` matrix of vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Grid {
    /// Threads per cube along the columns and along the rows; `x * y = THREADS`,
    /// `y` a power of two (the cube adds its rows up by halving).
    x: u32,
    y: u32,
    /// Cubes along the columns.
    column_cubes: u32,
    /// Slices of rows, one per cube along y, each `rows_per_part` long (the last
    /// may be shorter), and so partial sums per channel.
    parts: usize,
    rows_per_part: usize,
    columns: usize,
}

impl Grid {
    fn new(rows: usize, columns: usize, sms: usize) -> Grid {
        let x = columns.next_power_of_two().clamp(1, 32) as u32;
        let y = THREADS / x;
        let column_cubes = columns.div_ceil(x as usize);
        let wanted = (sms * CUBES_PER_SM).div_ceil(column_cubes).max(1);
        let most = rows.div_ceil(MIN_ROWS_PER_PART).max(1);
        let rows_per_part = rows.div_ceil(wanted.min(most)).max(1);
        Grid {
            x,
            y,
            column_cubes: column_cubes as u32,
            parts: rows.div_ceil(rows_per_part).max(1),
            rows_per_part,
            columns,
        }
    }

    fn count(&self) -> CubeCount {
        CubeCount::Static(self.column_cubes, self.parts as u32, 1)
    }

    fn dim(&self) -> CubeDim {
        CubeDim::new_2d(self.x, self.y)
    }

    /// The finishing kernels: one cube per column, its threads sharing out the parts.
    /// A cube per span of columns, its rows of threads each adding tens of parts one
    /// load after another, took 14-20 µs per layer (1.8 ms of a ResNet-50 step on an
    /// H200), waiting on memory with a few cubes on the whole GPU.
    fn finish_count(&self) -> CubeCount {
        CubeCount::Static(self.columns.max(1) as u32, 1, 1)
    }

    fn finish_dim(&self) -> CubeDim {
        CubeDim::new_2d(1, FINISH_THREADS)
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

/// Adds `a` and `b` up over the cube's rows of threads and stores the sums as this
/// cube's part of column `column`.
#[cube]
fn store_part<N: Size>(
    a: Vector<f32, N>,
    b: Vector<f32, N>,
    out_a: &mut Tensor<Vector<f32, N>>,
    out_b: &mut Tensor<Vector<f32, N>>,
    column: usize,
    columns: usize,
    #[comptime] threads: usize,
) {
    let (sum_a, sum_b) = sum_rows::<N>(a, b, threads);
    if UNIT_POS_Y == 0 && column < columns {
        let at = CUBE_POS_Y as usize * columns + column;
        out_a[at] = sum_a;
        out_b[at] = sum_b;
    }
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

/// This thread's first row and the end of its cube's slice; it steps by `CUBE_DIM_Y`.
#[cube]
fn rows_of(rows: usize, rows_per_part: usize) -> (usize, usize) {
    let start = CUBE_POS_Y as usize * rows_per_part;
    let mut end = start + rows_per_part;
    if end > rows {
        end = rows;
    }
    (start + UNIT_POS_Y as usize, end)
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

/// Forward step 1: per part, the sums of `x - x[0]` and of its square.
#[cube(launch)]
fn stat_parts<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    sums: &mut Tensor<Vector<f32, N>>,
    squares: &mut Tensor<Vector<f32, N>>,
    rows: usize,
    columns: usize,
    rows_per_part: usize,
    #[comptime] threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (column, read) = columns_of(columns);
    let shift = Vector::<f32, N>::cast_from(x[read]);
    let mut sum = Vector::<f32, N>::new(f32::new(0.0));
    let mut square = Vector::<f32, N>::new(f32::new(0.0));
    let (mut row, end) = rows_of(rows, rows_per_part);
    while row < end {
        let d = Vector::<f32, N>::cast_from(x[row * columns + read]) - shift;
        sum += d;
        square += d * d;
        row += CUBE_DIM_Y as usize;
    }
    store_part::<N>(sum, square, sums, squares, column, columns, threads);
}

/// Forward step 2, per channel: the mean, `1 / sqrt(variance + epsilon)`, the
/// output's `scale` and `bias` (`y = x * scale + bias`), and with `running` the
/// running statistics blended with the batch's. One cube per column (a vector of
/// channels); its threads share out the parts.
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
        let m = Vector::<f32, N>::cast_from(x[c]) + shifted_mean;
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

/// Forward step 3: `y = x * scale + bias` per channel, with `add` plus `residual`
/// (a residual block's end), with `relu` then `max(y, 0)`.
#[cube(launch)]
fn normalize<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    residual: &Tensor<Vector<F, N>>,
    scale: &Tensor<Vector<f32, N>>,
    bias: &Tensor<Vector<f32, N>>,
    y: &mut Tensor<Vector<F, N>>,
    len: usize,
    columns: usize,
    #[comptime] add: bool,
    #[comptime] relu: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    let c = i % columns;
    let mut v = Vector::<f32, N>::cast_from(x[i]) * scale[c] + bias[c];
    if add {
        v += Vector::<f32, N>::cast_from(residual[i]);
    }
    if relu {
        v = max(v, Vector::<f32, N>::new(f32::new(0.0)));
    }
    y[i] = Vector::cast_from(v);
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

/// Backward step 1: per part, the sums of `dy` and of `dy * (x - mean)` (`dy` through
/// the ReLU with `relu`; with `after_add`, through the ReLU after a residual addition,
/// by that ReLU's output `out`, and stored as `masked`).
#[cube(launch)]
fn grad_parts<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    out: &Tensor<Vector<F, N>>,
    masked: &mut Tensor<Vector<F, N>>,
    gamma: &Tensor<Vector<f32, N>>,
    beta: &Tensor<Vector<f32, N>>,
    mean: &Tensor<Vector<f32, N>>,
    inv_std: &Tensor<Vector<f32, N>>,
    sums: &mut Tensor<Vector<f32, N>>,
    products: &mut Tensor<Vector<f32, N>>,
    rows: usize,
    columns: usize,
    rows_per_part: usize,
    #[comptime] threads: usize,
    #[comptime] relu: bool,
    #[comptime] after_add: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (column, read) = columns_of(columns);
    let m = mean[read];
    // The forward pass's coefficients, as `stat_finish` computed them.
    let k = gamma[read] * inv_std[read];
    let b = beta[read] - m * k;
    let mut sum = Vector::<f32, N>::new(f32::new(0.0));
    let mut product = Vector::<f32, N>::new(f32::new(0.0));
    let (mut row, end) = rows_of(rows, rows_per_part);
    while row < end {
        let i = row * columns + read;
        let v = Vector::<f32, N>::cast_from(x[i]);
        let mut d = Vector::<f32, N>::cast_from(dy[i]);
        if after_add {
            // Through the ReLU after the addition, by its output; kept for the
            // residual branch and step 3. Exact: `d` holds a value of `F`.
            let zero = Vector::<f32, N>::new(f32::new(0.0));
            d = select_many(
                Vector::<f32, N>::cast_from(out[i]).greater_than(zero),
                d,
                zero,
            );
            masked[i] = Vector::cast_from(d);
        }
        let g = through_relu::<N>(d, v, k, b, relu);
        sum += g;
        product += g * (v - m);
        row += CUBE_DIM_Y as usize;
    }
    store_part::<N>(sum, product, sums, products, column, columns, threads);
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

/// Backward step 3: the input's gradient (`dy` through the ReLU with `relu`; `k_dy`
/// is the forward pass's `scale`).
#[cube(launch)]
fn grad_input<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    beta: &Tensor<Vector<f32, N>>,
    mean: &Tensor<Vector<f32, N>>,
    k_dy: &Tensor<Vector<f32, N>>,
    k_x: &Tensor<Vector<f32, N>>,
    k_1: &Tensor<Vector<f32, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    len: usize,
    columns: usize,
    #[comptime] relu: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    let c = i % columns;
    let v = Vector::<f32, N>::cast_from(x[i]);
    let m = mean[c];
    let k = k_dy[c];
    let mut g = Vector::<f32, N>::cast_from(dy[i]);
    if relu {
        g = through_relu::<N>(g, v, k, beta[c] - m * k, relu);
    }
    dx[i] = Vector::cast_from(g * k + (v - m) * k_x[c] + k_1[c]);
}

/// A channels-last input, contiguous, seen as `[rows, channels]`, and how the kernels
/// read it.
struct Plan<R: CubeRuntime> {
    x: CubeTensor<R>,
    rows: usize,
    channels: usize,
    /// Channels per vector (the widest load that divides the channel count).
    vector: usize,
    grid: Grid,
}

impl<R: CubeRuntime> Plan<R> {
    /// `None` where these kernels do not apply: `x` not 4-D, or not f32, bf16 or fp16,
    /// or one of `per_channel` not f32 of shape `[C]`. Checked before `x` is made
    /// contiguous, which may copy it.
    fn new(x: &CubeTensor<R>, per_channel: &[&CubeTensor<R>]) -> Option<Plan<R>> {
        let dims = x.meta.shape();
        if dims.num_dims() != 4 || !matches!(x.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return None;
        }
        let channels = dims[3];
        let rows = dims.num_elements() / channels.max(1);
        if rows == 0 || channels == 0 || !per_channel_f32(per_channel, channels) {
            return None;
        }
        let vector = widest_vector(x.client.io_optimized_vector_sizes(x.dtype.size()), channels);
        let hardware = &x.client.properties().hardware;
        let sms = hardware.num_streaming_multiprocessors.unwrap_or(32) as usize;
        Some(Plan {
            x: into_contiguous(x.clone()),
            rows,
            channels,
            vector,
            grid: Grid::new(rows, channels / vector, sms),
        })
    }

    fn columns(&self) -> usize {
        self.channels / self.vector
    }

    /// A contiguous tensor beside the input (the kernels index every tensor linearly).
    fn empty(&self, shape: Shape, dtype: DType) -> CubeTensor<R> {
        let (client, device) = (self.x.client.clone(), self.x.device.clone());
        empty_device_contiguous_dtype(client, device, shape, dtype)
    }

    /// `K` f32 tensors of `[len]`.
    fn f32s<const K: usize>(&self, len: usize) -> [CubeTensor<R>; K] {
        std::array::from_fn(|_| self.empty(Shape::new([len]), DType::F32))
    }

    /// Two `[parts, channels]` f32 tensors for the partial sums.
    fn parts(&self) -> [CubeTensor<R>; 2] {
        let shape = || Shape::new([self.grid.parts, self.channels]);
        [
            self.empty(shape(), DType::F32),
            self.empty(shape(), DType::F32),
        ]
    }

    /// One thread per vector of the input.
    fn per_vector(&self) -> (CubeCount, CubeDim, usize) {
        let len = self.rows * self.columns();
        let dim = CubeDim::new(&self.x.client, len);
        (
            calculate_cube_count_elemwise(&self.x.client, len, dim),
            dim,
            len,
        )
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

/// [`NormBackend::batch_norm_train`](crate::ops::NormBackend) for a channels-last `x`
/// (`[N, H, W, C]`, f32, bf16 or fp16) and f32 `gamma`, `beta`, with `relu` a ReLU
/// after it in the same pass; `None` where these kernels do not apply.
pub(crate) fn train<R: CubeRuntime>(
    x: &CubeTensor<R>,
    gamma: &CubeTensor<R>,
    beta: &CubeTensor<R>,
    epsilon: f64,
    relu: bool,
) -> Option<[CubeTensor<R>; 3]> {
    let [y, mean, inv_std, _, _] = train_running(x, None, gamma, beta, epsilon, relu, None)?;
    Some([y, mean, inv_std])
}

/// [`train`], with `running` (mean, variance, momentum) also the running statistics
/// blended with the batch's (`NormBackend::batch_norm_train_running`), returned last
/// (without it, the last two are scratch); with `residual` (`x`'s shape and dtype)
/// added to the output before the ReLU.
pub(crate) fn train_running<R: CubeRuntime>(
    x: &CubeTensor<R>,
    residual: Option<&CubeTensor<R>>,
    gamma: &CubeTensor<R>,
    beta: &CubeTensor<R>,
    epsilon: f64,
    relu: bool,
    running: Option<([&CubeTensor<R>; 2], f64)>,
) -> Option<[CubeTensor<R>; 5]> {
    if residual.is_some_and(|r| r.dtype != x.dtype || r.meta.shape() != x.meta.shape()) {
        return None;
    }
    let given = running.as_ref().map_or(vec![], |(r, _)| r.to_vec());
    let plan = Plan::new(x, &[&[gamma, beta][..], &given].concat())?;
    let residual = residual.map(|r| into_contiguous(r.clone()));
    let (old_mean, old_var, momentum) = match running {
        Some(([m, v], momentum)) => (
            into_contiguous(m.clone()),
            into_contiguous(v.clone()),
            momentum,
        ),
        None => (gamma.clone(), beta.clone(), 0.0),
    };
    let (gamma, beta) = (
        into_contiguous(gamma.clone()),
        into_contiguous(beta.clone()),
    );
    let client = plan.x.client.clone();
    let dtype: StorageType = plan.x.dtype.into();
    let (g, columns) = (plan.grid, plan.columns());
    let [sums, squares] = plan.parts();
    stat_parts::launch::<R>(
        &client,
        g.count(),
        g.dim(),
        plan.vector,
        plan.x.clone().into_tensor_arg(),
        sums.clone().into_tensor_arg(),
        squares.clone().into_tensor_arg(),
        plan.rows,
        columns,
        g.rows_per_part,
        THREADS as usize,
        dtype,
    );
    let [mean, inv_std, scale, bias, new_mean, new_var] = plan.f32s(plan.channels);
    stat_finish::launch::<R>(
        &client,
        g.finish_count(),
        g.finish_dim(),
        plan.vector,
        plan.x.clone().into_tensor_arg(),
        sums.into_tensor_arg(),
        squares.into_tensor_arg(),
        gamma.into_tensor_arg(),
        beta.into_tensor_arg(),
        mean.clone().into_tensor_arg(),
        inv_std.clone().into_tensor_arg(),
        scale.clone().into_tensor_arg(),
        bias.clone().into_tensor_arg(),
        old_mean.into_tensor_arg(),
        old_var.into_tensor_arg(),
        new_mean.clone().into_tensor_arg(),
        new_var.clone().into_tensor_arg(),
        columns,
        g.parts,
        plan.rows as f32,
        epsilon as f32,
        momentum as f32,
        FINISH_THREADS as usize,
        running.is_some(),
        dtype,
    );
    let y = plan.empty(plan.x.meta.shape().clone(), plan.x.dtype);
    let (count, dim, len) = plan.per_vector();
    normalize::launch::<R>(
        &client,
        count,
        dim,
        plan.vector,
        plan.x.clone().into_tensor_arg(),
        residual
            .as_ref()
            .unwrap_or(&plan.x)
            .clone()
            .into_tensor_arg(),
        scale.into_tensor_arg(),
        bias.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        len,
        columns,
        residual.is_some(),
        relu,
        dtype,
    );
    Some([y, mean, inv_std, new_mean, new_var])
}

/// [`NormBackend::batch_norm_grad`](crate::ops::NormBackend) for the inputs of
/// [`train`] (and its `relu`), its statistics and the output's gradient `dy` (`x`'s
/// shape and dtype); `None` where these kernels do not apply.
pub(crate) fn grad<R: CubeRuntime>(
    x: &CubeTensor<R>,
    params: [&CubeTensor<R>; 2],
    stats: [&CubeTensor<R>; 2],
    dy: &CubeTensor<R>,
    relu: bool,
) -> Option<[CubeTensor<R>; 3]> {
    grad_masked(x, params, stats, dy, relu, None).map(|(grads, _)| grads)
}

/// The gradients of a layer whose output was added to a residual and passed through a
/// ReLU with output `out` ([`train_running`] with a residual), given `out`'s gradient:
/// the input's, gamma's, beta's, and the residual's (`dout` through the ReLU).
pub(crate) fn grad_after_add<R: CubeRuntime>(
    x: &CubeTensor<R>,
    params: [&CubeTensor<R>; 2],
    stats: [&CubeTensor<R>; 2],
    out: &CubeTensor<R>,
    dout: &CubeTensor<R>,
) -> Option<[CubeTensor<R>; 4]> {
    if out.dtype != x.dtype || out.meta.shape() != x.meta.shape() {
        return None;
    }
    let ([dx, d_gamma, d_beta], masked) = grad_masked(x, params, stats, dout, false, Some(out))?;
    Some([dx, d_gamma, d_beta, masked?])
}

/// The input's, gamma's and beta's gradients, and the masked output gradient there is
/// one.
type Masked<R> = ([CubeTensor<R>; 3], Option<CubeTensor<R>>);

/// [`grad`], with `mask_by` first masking `dy` by that ReLU output (returned too).
fn grad_masked<R: CubeRuntime>(
    x: &CubeTensor<R>,
    [gamma, beta]: [&CubeTensor<R>; 2],
    [mean, inv_std]: [&CubeTensor<R>; 2],
    dy: &CubeTensor<R>,
    relu: bool,
    mask_by: Option<&CubeTensor<R>>,
) -> Option<Masked<R>> {
    if dy.dtype != x.dtype || dy.meta.shape() != x.meta.shape() {
        return None;
    }
    let plan = Plan::new(x, &[gamma, beta, mean, inv_std])?;
    let [gamma, beta, mean, inv_std, dy] =
        [gamma, beta, mean, inv_std, dy].map(|t| into_contiguous(t.clone()));
    let out = mask_by.map(|t| into_contiguous(t.clone()));
    // Written only with `mask_by`; otherwise a one-element stand-in.
    let masked = match out {
        Some(_) => plan.empty(plan.x.meta.shape().clone(), plan.x.dtype),
        None => plan.empty(Shape::new([plan.vector]), plan.x.dtype),
    };
    let client = plan.x.client.clone();
    let dtype: StorageType = plan.x.dtype.into();
    let (g, columns) = (plan.grid, plan.columns());
    let [sums, products] = plan.parts();
    grad_parts::launch::<R>(
        &client,
        g.count(),
        g.dim(),
        plan.vector,
        plan.x.clone().into_tensor_arg(),
        dy.clone().into_tensor_arg(),
        out.as_ref().unwrap_or(&dy).clone().into_tensor_arg(),
        masked.clone().into_tensor_arg(),
        gamma.clone().into_tensor_arg(),
        beta.clone().into_tensor_arg(),
        mean.clone().into_tensor_arg(),
        inv_std.clone().into_tensor_arg(),
        sums.clone().into_tensor_arg(),
        products.clone().into_tensor_arg(),
        plan.rows,
        columns,
        g.rows_per_part,
        THREADS as usize,
        relu,
        out.is_some(),
        dtype,
    );
    // Step 3 reads the masked gradient where there is one.
    let dy = if out.is_some() { masked.clone() } else { dy };
    let [d_gamma, d_beta, k_dy, k_x, k_1] = plan.f32s(plan.channels);
    grad_finish::launch::<R>(
        &client,
        g.finish_count(),
        g.finish_dim(),
        plan.vector,
        sums.into_tensor_arg(),
        products.into_tensor_arg(),
        gamma.into_tensor_arg(),
        inv_std.into_tensor_arg(),
        d_gamma.clone().into_tensor_arg(),
        d_beta.clone().into_tensor_arg(),
        k_dy.clone().into_tensor_arg(),
        k_x.clone().into_tensor_arg(),
        k_1.clone().into_tensor_arg(),
        columns,
        g.parts,
        plan.rows as f32,
        FINISH_THREADS as usize,
    );
    let dx = plan.empty(plan.x.meta.shape().clone(), plan.x.dtype);
    let (count, dim, len) = plan.per_vector();
    grad_input::launch::<R>(
        &client,
        count,
        dim,
        plan.vector,
        plan.x.clone().into_tensor_arg(),
        dy.into_tensor_arg(),
        beta.into_tensor_arg(),
        mean.into_tensor_arg(),
        k_dy.into_tensor_arg(),
        k_x.into_tensor_arg(),
        k_1.into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        len,
        columns,
        relu,
        dtype,
    );
    Some(([dx, d_gamma, d_beta], out.map(|_| masked)))
}

/// Whether each of `tensors` is f32 of shape `[channels]`.
fn per_channel_f32<R: CubeRuntime>(tensors: &[&CubeTensor<R>], channels: usize) -> bool {
    tensors
        .iter()
        .all(|t| t.dtype == DType::F32 && t.meta.shape().as_slice() == [channels])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row and column is covered exactly once, within the hardware's cube.
    #[test]
    fn the_grid_covers_every_row_and_column() {
        for (rows, columns) in [
            (1, 1),
            (1, 5),
            (6 * 7 * 9, 5),
            (128 * 112 * 112, 8),
            (128 * 7 * 7, 256),
            (256 * 32 * 32, 8),
            (33, 300),
        ] {
            for sms in [1, 132] {
                let g = Grid::new(rows, columns, sms);
                assert_eq!(g.x * g.y, THREADS, "{rows}x{columns}: {g:?}");
                assert!(g.y.is_power_of_two(), "{g:?}");
                assert!(g.column_cubes as usize * g.x as usize >= columns, "{g:?}");
                assert!(
                    (g.column_cubes as usize - 1) * (g.x as usize) < columns,
                    "{g:?}"
                );
                assert!(g.parts * g.rows_per_part >= rows, "{g:?}");
                assert!((g.parts - 1) * g.rows_per_part < rows, "{g:?}");
            }
        }
    }

    #[test]
    fn large_inputs_spread_over_every_sm() {
        let g = Grid::new(128 * 112 * 112, 8, 132);
        assert!(
            g.column_cubes as usize * g.parts >= 132 * CUBES_PER_SM,
            "{g:?}"
        );
        let small = Grid::new(40, 8, 132);
        assert_eq!(small.parts, 2, "{small:?}");
    }

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
