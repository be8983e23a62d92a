//! BatchNorm's training pass over NCHW activations, seen as `[N, C, S]` with S = H·W
//! and read in vectors along S, so that each vector's lanes belong to one channel.
//! Each cube of partial sums takes one channel and a slice of its N·S values; the
//! parent's finishing kernels run with one channel per column.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::{
    Masked, Running, finish_cubes, grad_finish, per_channel_f32, stat_finish, through_relu,
    widest_vector,
};

/// Threads per cube of the partial sums (a power of two: the cube adds its threads'
/// sums up by halving).
const THREADS: u32 = 256;
/// Cubes of partial sums to aim for per SM, so that every SM has work and waits
/// between loads are hidden.
const CUBES_PER_SM: usize = 4;
/// Fewer vectors than this per cube and the partial sums cost more than they save.
const MIN_VECTORS_PER_PART: usize = 4 * THREADS as usize;

/// How the partial sums split each channel's `per_channel` vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Split {
    /// Slices per channel, one per cube along y, each `per_part` vectors long (the
    /// last may be shorter), and so partial sums per channel.
    parts: usize,
    per_part: usize,
}

impl Split {
    fn new(per_channel: usize, channels: usize, sms: usize) -> Split {
        let wanted = (sms * CUBES_PER_SM).div_ceil(channels.max(1)).max(1);
        let most = per_channel.div_ceil(MIN_VECTORS_PER_PART).max(1);
        let per_part = per_channel.div_ceil(wanted.min(most)).max(1);
        Split {
            parts: per_channel.div_ceil(per_part).max(1),
            per_part,
        }
    }
}

/// The sum of a vector's lanes.
#[cube]
fn lanes<N: Size>(v: Vector<f32, N>) -> f32 {
    let mut total = f32::new(0.0);
    #[unroll]
    for l in 0..v.size() {
        total += v[l];
    }
    total
}

/// `a` and `b` added up over the cube's threads (one dimension), for its first thread.
#[cube]
fn sum_threads(a: f32, b: f32, #[comptime] threads: usize) -> (f32, f32) {
    let mut shared_a = SharedMemory::<f32>::new(threads);
    let mut shared_b = SharedMemory::<f32>::new(threads);
    let me = UNIT_POS as usize;
    shared_a[me] = a;
    shared_b[me] = b;
    sync_cube();
    let mut half = CUBE_DIM as usize / 2;
    while half > 0 {
        if me < half {
            shared_a[me] = shared_a[me] + shared_a[me + half];
            shared_b[me] = shared_b[me] + shared_b[me + half];
        }
        sync_cube();
        half /= 2;
    }
    (shared_a[0], shared_b[0])
}

/// Where the `j`-th vector of channel `c` lies: image `j / inner`, then its place in
/// that image's run of `inner` vectors.
#[cube]
fn at(j: usize, c: usize, channels: usize, inner: usize) -> usize {
    let n = j / inner;
    (n * channels + c) * inner + (j - n * inner)
}

/// This thread's first vector of its channel and the end of its cube's slice; it
/// steps by `CUBE_DIM`.
#[cube]
fn slice_of(per_channel: usize, per_part: usize) -> (usize, usize) {
    let start = CUBE_POS_Y as usize * per_part;
    let mut end = start + per_part;
    if end > per_channel {
        end = per_channel;
    }
    (start + UNIT_POS as usize, end)
}

/// Forward step 1: per channel (`CUBE_POS_X`) and part, the sums of `x - x[0, c, 0]`
/// and of its square.
#[cube(launch)]
fn stat_parts<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    sums: &mut Tensor<f32>,
    squares: &mut Tensor<f32>,
    channels: usize,
    inner: usize,
    per_channel: usize,
    per_part: usize,
    #[comptime] threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let c = CUBE_POS_X as usize;
    let first = x[c * inner];
    let shift = Vector::<f32, N>::new(f32::cast_from(first[0]));
    let mut sum = Vector::<f32, N>::new(f32::new(0.0));
    let mut square = Vector::<f32, N>::new(f32::new(0.0));
    let (mut j, end) = slice_of(per_channel, per_part);
    while j < end {
        let d = Vector::<f32, N>::cast_from(x[at(j, c, channels, inner)]) - shift;
        sum += d;
        square += d * d;
        j += CUBE_DIM as usize;
    }
    let (s, q) = sum_threads(lanes::<N>(sum), lanes::<N>(square), threads);
    if UNIT_POS == 0 {
        let part = CUBE_POS_Y as usize * channels + c;
        sums[part] = s;
        squares[part] = q;
    }
}

/// Forward step 3: `y = x * scale + bias` per channel, with `add` plus `residual`
/// (a residual block's end), with `relu` then `max(y, 0)`.
#[cube(launch)]
fn normalize<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    residual: &Tensor<Vector<F, N>>,
    scale: &Tensor<f32>,
    bias: &Tensor<f32>,
    y: &mut Tensor<Vector<F, N>>,
    len: usize,
    channels: usize,
    inner: usize,
    #[comptime] add: bool,
    #[comptime] relu: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    let c = (i / inner) % channels;
    let mut v = Vector::<f32, N>::cast_from(x[i]) * Vector::<f32, N>::new(scale[c])
        + Vector::<f32, N>::new(bias[c]);
    if add {
        v += Vector::<f32, N>::cast_from(residual[i]);
    }
    if relu {
        v = max(v, Vector::<f32, N>::new(f32::new(0.0)));
    }
    y[i] = Vector::cast_from(v);
}

/// Backward step 1: per channel and part, the sums of `dy` and of `dy * (x - mean)`
/// (`dy` through the ReLU with `relu`; with `after_add`, through the ReLU after a
/// residual addition, by that ReLU's output `out`, and stored as `masked`).
#[cube(launch)]
fn grad_parts<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    out: &Tensor<Vector<F, N>>,
    masked: &mut Tensor<Vector<F, N>>,
    gamma: &Tensor<f32>,
    beta: &Tensor<f32>,
    mean: &Tensor<f32>,
    inv_std: &Tensor<f32>,
    sums: &mut Tensor<f32>,
    products: &mut Tensor<f32>,
    channels: usize,
    inner: usize,
    per_channel: usize,
    per_part: usize,
    #[comptime] threads: usize,
    #[comptime] relu: bool,
    #[comptime] after_add: bool,
    #[define(F)] _dtype: StorageType,
) {
    let c = CUBE_POS_X as usize;
    // The forward pass's coefficients, as `stat_finish` computed them.
    let k = gamma[c] * inv_std[c];
    let m = Vector::<f32, N>::new(mean[c]);
    let b = Vector::<f32, N>::new(beta[c] - mean[c] * k);
    let k = Vector::<f32, N>::new(k);
    let mut sum = Vector::<f32, N>::new(f32::new(0.0));
    let mut product = Vector::<f32, N>::new(f32::new(0.0));
    let (mut j, end) = slice_of(per_channel, per_part);
    while j < end {
        let i = at(j, c, channels, inner);
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
        j += CUBE_DIM as usize;
    }
    let (s, p) = sum_threads(lanes::<N>(sum), lanes::<N>(product), threads);
    if UNIT_POS == 0 {
        let part = CUBE_POS_Y as usize * channels + c;
        sums[part] = s;
        products[part] = p;
    }
}

/// Backward step 3: the input's gradient (`dy` through the ReLU with `relu`; `k_dy`
/// is the forward pass's `scale`).
#[cube(launch)]
fn grad_input<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    beta: &Tensor<f32>,
    mean: &Tensor<f32>,
    k_dy: &Tensor<f32>,
    k_x: &Tensor<f32>,
    k_1: &Tensor<f32>,
    dx: &mut Tensor<Vector<F, N>>,
    len: usize,
    channels: usize,
    inner: usize,
    #[comptime] relu: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    let c = (i / inner) % channels;
    let v = Vector::<f32, N>::cast_from(x[i]);
    let m = Vector::<f32, N>::new(mean[c]);
    let k = Vector::<f32, N>::new(k_dy[c]);
    let mut g = Vector::<f32, N>::cast_from(dy[i]);
    if relu {
        let b = Vector::<f32, N>::new(beta[c] - mean[c] * k_dy[c]);
        g = through_relu::<N>(g, v, k, b, relu);
    }
    dx[i] = Vector::cast_from(
        g * k + (v - m) * Vector::<f32, N>::new(k_x[c]) + Vector::<f32, N>::new(k_1[c]),
    );
}

/// An NCHW input, contiguous, seen as `[N, C, S]`, and how the kernels read it.
struct Plan<R: CubeRuntime> {
    x: CubeTensor<R>,
    batch: usize,
    channels: usize,
    /// Values per vector (the widest load that divides S).
    vector: usize,
    /// Vectors per image and channel (S / `vector`).
    inner: usize,
    split: Split,
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
        let (batch, channels, spatial) = (dims[0], dims[1], dims[2] * dims[3]);
        if batch == 0 || channels == 0 || spatial == 0 || !per_channel_f32(per_channel, channels) {
            return None;
        }
        let vector = widest_vector(x.client.io_optimized_vector_sizes(x.dtype.size()), spatial);
        let inner = spatial / vector;
        let hardware = &x.client.properties().hardware;
        let sms = hardware.num_streaming_multiprocessors.unwrap_or(32) as usize;
        Some(Plan {
            x: into_contiguous(x.clone()),
            batch,
            channels,
            vector,
            inner,
            split: Split::new(batch * inner, channels, sms),
        })
    }

    /// Vectors per channel over the whole batch.
    fn per_channel(&self) -> usize {
        self.batch * self.inner
    }

    /// Values each channel's statistics are taken over.
    fn count(&self) -> f32 {
        (self.per_channel() * self.vector) as f32
    }

    fn parts_count(&self) -> CubeCount {
        CubeCount::Static(self.channels as u32, self.split.parts as u32, 1)
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
        self.f32s(self.split.parts * self.channels)
    }

    /// One thread per vector of the input.
    fn per_vector(&self) -> (CubeCount, CubeDim, usize) {
        let len = self.channels * self.per_channel();
        let dim = CubeDim::new(&self.x.client, len);
        (
            calculate_cube_count_elemwise(&self.x.client, len, dim),
            dim,
            len,
        )
    }
}

/// The parent's `train_running` for an NCHW `x`.
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
    let (channels, inner) = (plan.channels, plan.inner);
    let [sums, squares] = plan.parts();
    stat_parts::launch::<R>(
        &client,
        plan.parts_count(),
        CubeDim::new_1d(THREADS),
        plan.vector,
        plan.x.clone().into_tensor_arg(),
        sums.clone().into_tensor_arg(),
        squares.clone().into_tensor_arg(),
        channels,
        inner,
        plan.per_channel(),
        plan.split.per_part,
        THREADS as usize,
        dtype,
    );
    let [mean, inv_std, scale, bias, new_mean, new_var] = plan.f32s(channels);
    let finish = finish_cubes(channels);
    // One value per load here, so that `x` reads as scalars for each channel's shift.
    stat_finish::launch::<R>(
        &client,
        finish.0,
        finish.1,
        1,
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
        channels,
        inner * plan.vector,
        plan.split.parts,
        plan.count(),
        epsilon as f32,
        momentum as f32,
        super::FINISH_THREADS as usize,
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
        channels,
        inner,
        residual.is_some(),
        relu,
        dtype,
    );
    Some([y, mean, inv_std, new_mean, new_var])
}

/// The parent's `grad_masked` for an NCHW `x`.
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
    // Written only with `mask_by`; otherwise a one-vector stand-in.
    let masked = match out {
        Some(_) => plan.empty(plan.x.meta.shape().clone(), plan.x.dtype),
        None => plan.empty(Shape::new([plan.vector]), plan.x.dtype),
    };
    let client = plan.x.client.clone();
    let dtype: StorageType = plan.x.dtype.into();
    let (channels, inner) = (plan.channels, plan.inner);
    let [sums, products] = plan.parts();
    grad_parts::launch::<R>(
        &client,
        plan.parts_count(),
        CubeDim::new_1d(THREADS),
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
        channels,
        inner,
        plan.per_channel(),
        plan.split.per_part,
        THREADS as usize,
        relu,
        out.is_some(),
        dtype,
    );
    // Step 3 reads the masked gradient where there is one.
    let dy = if out.is_some() { masked.clone() } else { dy };
    let [d_gamma, d_beta, k_dy, k_x, k_1] = plan.f32s(channels);
    let finish = finish_cubes(channels);
    grad_finish::launch::<R>(
        &client,
        finish.0,
        finish.1,
        1,
        sums.into_tensor_arg(),
        products.into_tensor_arg(),
        gamma.into_tensor_arg(),
        inv_std.into_tensor_arg(),
        d_gamma.clone().into_tensor_arg(),
        d_beta.clone().into_tensor_arg(),
        k_dy.clone().into_tensor_arg(),
        k_x.clone().into_tensor_arg(),
        k_1.clone().into_tensor_arg(),
        channels,
        plan.split.parts,
        plan.count(),
        super::FINISH_THREADS as usize,
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
        channels,
        inner,
        relu,
        dtype,
    );
    Some(([dx, d_gamma, d_beta], out.map(|_| masked)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every vector of a channel is in exactly one part.
    #[test]
    fn the_parts_cover_every_vector_once() {
        for (per_channel, channels) in [
            (1, 1),
            (3, 5),
            (256 * 256, 64),
            (256 * 4, 512),
            (128 * 49, 2048),
            (10_001, 3),
        ] {
            for sms in [1, 132] {
                let s = Split::new(per_channel, channels, sms);
                assert!(s.parts * s.per_part >= per_channel, "{s:?}");
                assert!((s.parts - 1) * s.per_part < per_channel, "{s:?}");
            }
        }
    }

    #[test]
    fn large_inputs_spread_over_every_sm() {
        let s = Split::new(256 * 256, 64, 132);
        assert!(64 * s.parts >= 132 * CUBES_PER_SM, "{s:?}");
        assert_eq!(Split::new(40, 8, 132).parts, 1);
    }
}
