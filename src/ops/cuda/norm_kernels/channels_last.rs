//! BatchNorm's training pass over channels-last activations (`[N, H, W, C]`), seen as
//! `[rows, channels]` with rows N·H·W, in the three launches each way of the parent
//! module:
//!
//! 1. per-channel partial sums, each cube over a slice of the rows and a span of
//!    channels, read along the channels so that loads coalesce;
//! 2. one cube per vector of channels finishes them (the parent's `stat_finish` and
//!    `grad_finish`);
//! 3. one element-wise pass writes the output (forward) or the input's gradient.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::{
    FINISH_THREADS, Masked, Running, columns_of, finish_cubes, grad_finish, per_channel_f32,
    stat_finish, sum_rows, through_relu, widest_vector,
};

/// Threads per cube of the partial sums.
const THREADS: u32 = 256;
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
        }
    }

    fn count(&self) -> CubeCount {
        CubeCount::Static(self.column_cubes, self.parts as u32, 1)
    }

    fn dim(&self) -> CubeDim {
        CubeDim::new_2d(self.x, self.y)
    }
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

/// The parent's `train_running` for a channels-last `x` (`[N, H, W, C]`).
pub(super) fn train_running<R: CubeRuntime>(
    x: &CubeTensor<R>,
    residual: Option<&CubeTensor<R>>,
    gamma: &CubeTensor<R>,
    beta: &CubeTensor<R>,
    epsilon: f64,
    relu: bool,
    running: Running<'_, R>,
) -> Option<[CubeTensor<R>; 5]> {
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
    let finish = finish_cubes(columns);
    stat_finish::launch::<R>(
        &client,
        finish.0,
        finish.1,
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
        1,
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

/// The parent's `grad_masked` for a channels-last `x`.
pub(super) fn grad_masked<R: CubeRuntime>(
    x: &CubeTensor<R>,
    [gamma, beta]: [&CubeTensor<R>; 2],
    [mean, inv_std]: [&CubeTensor<R>; 2],
    dy: &CubeTensor<R>,
    relu: bool,
    mask_by: Option<&CubeTensor<R>>,
) -> Option<Masked<R>> {
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
    let finish = finish_cubes(columns);
    grad_finish::launch::<R>(
        &client,
        finish.0,
        finish.1,
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
}
