//! cuDNN's batch normalisation behind Burn's CUDA backend (`kernels.batch_norm`): the
//! training pass (batch statistics) forward and backward as one cuDNN call each, on
//! the stream the convolutions use (see the parent module).

use std::ffi::c_void;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, Ordering};

use burn::cubecl::cuda::CudaRuntime;
use burn::cubecl::server::Handle;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cudarc::cudnn::{result as dnn, sys};

use super::super::kiln_stream::{After, Client, Lane};
use super::super::norm_kernels;
use super::{
    Dnn, Planned, Tensor, data_type, dims, has_symbols, on_cudnn_planned, scaling, tensor_format,
    warn_once,
};
use crate::ops::norm::{
    add_relu_grad_reference, add_relu_train_reference, blend_reference, grad_reference,
    relu_grad_reference, train_reference,
};
use crate::ops::{Layout, LibraryCall, NormBackend};

static BATCH_NORM: AtomicBool = AtomicBool::new(false);

/// Whether BatchNorm's training pass runs on cuDNN (after [`probe_batch_norm`]
/// succeeded). Set once, before training.
pub fn set_batch_norm(on: bool) {
    BATCH_NORM.store(on, Ordering::Relaxed);
}

/// Whether the cuDNN that [`probe`] loaded has the batch normalisation entry points
/// (cuDNN 9 keeps them in its legacy operations library, which a slimmed install may
/// leave out; cudarc would panic at the first call).
pub fn probe_batch_norm() -> Result<(), String> {
    has_symbols(&[
        "cudnnDeriveBNTensorDescriptor",
        "cudnnBatchNormalizationForwardTraining",
        "cudnnBatchNormalizationBackward",
    ])
}

/// What one batch-normalisation input's descriptors depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct NormKey {
    /// NCHW order, whatever the layout.
    dims: [i32; 4],
    layout: Layout,
    data: sys::cudnnDataType_t,
}

impl NormKey {
    /// Batch statistics over N, H and W (per channel), as BatchNorm in training.
    /// Channels-last takes cuDNN's persistent kernels, as PyTorch does there: its
    /// plain NHWC kernels ran ResNet-50 at a sixth of the NCHW speed on an H200.
    fn mode(&self) -> sys::cudnnBatchNormMode_t {
        match self.layout {
            Layout::Nchw => sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL,
            Layout::Nhwc => sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL_PERSISTENT,
        }
    }

    /// The persistent kernels keep every SM busy at once and wait for all their
    /// blocks: queued behind them, cubecl's spinning hand-over kernel (`stream_order`)
    /// held part of one SM and the first channels-last ResNet step never ended. So
    /// where they run on kiln's stream the host waits for it after them instead (on
    /// cubecl's own stream nothing spins and nothing waits).
    fn after(&self) -> After {
        match self.mode() {
            sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL_PERSISTENT => After::Host,
            _ => After::Gpu,
        }
    }
}

/// The descriptor of `x` and the per-channel one cuDNN derives from it for the
/// parameters and statistics (f32, also for bf16 and fp16 inputs); destroyed on drop.
pub(super) struct NormDescriptors {
    x: sys::cudnnTensorDescriptor_t,
    channel: sys::cudnnTensorDescriptor_t,
    mode: sys::cudnnBatchNormMode_t,
    /// Set where cuDNN's extended calls run this input.
    ex: Option<ExWorkspace>,
}

/// The workspace of cuDNN's extended (`...Ex`) batch-norm calls, forward and backward.
///
/// On NHWC input only these reach the kernels PyTorch runs for channels-last
/// (`batchnorm_*_nhwc_semiPersist`): the plain calls in the same persistent mode ran
/// `bn_*_1C11_singleread` kernels, 1.1-1.6 ms per ResNet-50 layer at batch 64 on an
/// H200 (Nsight Compute), over 20x PyTorch's.
#[derive(Debug, Clone, Copy)]
struct ExWorkspace {
    forward: usize,
    backward: usize,
}

const OPS_BN: sys::cudnnBatchNormOps_t = sys::cudnnBatchNormOps_t::CUDNN_BATCHNORM_OPS_BN;

impl NormDescriptors {
    pub(in crate::ops::cuda::cudnn) fn new(
        key: NormKey,
        handle: sys::cudnnHandle_t,
    ) -> Result<Self, String> {
        let err = |what: &str, e: dnn::CudnnError| format!("batch norm {what} {key:?}: {e:?}");
        let mut d = NormDescriptors {
            x: null_mut(),
            channel: null_mut(),
            mode: key.mode(),
            ex: None,
        };
        d.x = dnn::create_tensor_descriptor().map_err(|e| err("descriptor", e))?;
        d.channel = dnn::create_tensor_descriptor().map_err(|e| err("descriptor", e))?;
        // SAFETY: both descriptors were created above and are alive.
        unsafe {
            dnn::set_tensor4d_descriptor(d.x, tensor_format(key.layout), key.data, key.dims)
                .map_err(|e| err("input", e))?;
            sys::cudnnDeriveBNTensorDescriptor(d.channel, d.x, d.mode)
                .result()
                .map_err(|e| err("channels", e))?;
        }
        if key.layout == Layout::Nhwc {
            d.ex = d
                .ex_workspace(handle)
                .inspect_err(|e| note_plain(key, e))
                .ok();
        }
        Ok(d)
    }

    /// What the extended calls need, or why they cannot run here. Reserve space
    /// would have to travel from forward to backward, which kiln's batch norm (its
    /// statistics only) does not carry, so cuDNN asking for any refuses them.
    fn ex_workspace(&self, handle: sys::cudnnHandle_t) -> Result<ExWorkspace, String> {
        has_symbols(&[
            "cudnnBatchNormalizationForwardTrainingEx",
            "cudnnBatchNormalizationBackwardEx",
            "cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize",
            "cudnnGetBatchNormalizationBackwardExWorkspaceSize",
            "cudnnGetBatchNormalizationTrainingExReserveSpaceSize",
        ])?;
        let (mode, x, c) = (self.mode, self.x, self.channel);
        let (mut forward, mut backward, mut reserve) = (0, 0, 0);
        // SAFETY: live handle and descriptors; no activation, no residual input (null
        // descriptors, as cuDNN documents for `CUDNN_BATCHNORM_OPS_BN`).
        unsafe {
            sys::cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
                handle,
                mode,
                OPS_BN,
                x,
                null_mut(),
                x,
                c,
                null_mut(),
                &mut forward,
            )
            .result()
            .map_err(|e| format!("forward workspace: {e:?}"))?;
            sys::cudnnGetBatchNormalizationBackwardExWorkspaceSize(
                handle,
                mode,
                OPS_BN,
                x,
                x,
                x,
                null_mut(),
                x,
                c,
                null_mut(),
                &mut backward,
            )
            .result()
            .map_err(|e| format!("backward workspace: {e:?}"))?;
            sys::cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
                handle,
                mode,
                OPS_BN,
                null_mut(),
                x,
                &mut reserve,
            )
            .result()
            .map_err(|e| format!("reserve space: {e:?}"))?;
        }
        if reserve > 0 {
            return Err(format!("it asks for {reserve} bytes of reserve space"));
        }
        Ok(ExWorkspace { forward, backward })
    }
}

/// Says once that cuDNN's extended NHWC batch norm is out of reach, and why.
fn note_plain(key: NormKey, why: &str) {
    static NOTED: AtomicBool = AtomicBool::new(false);
    if !NOTED.swap(true, Ordering::Relaxed) {
        crate::say!(
            "kiln: note: cuDNN's extended channels-last batch norm cannot run {:?} ({why}); its plain calls run instead (slower)",
            key.dims
        );
    }
}

impl Drop for NormDescriptors {
    fn drop(&mut self) {
        // SAFETY: each pointer is either null (never created) or a live descriptor.
        unsafe {
            for d in [self.x, self.channel] {
                if !d.is_null() {
                    let _ = dnn::destroy_tensor_descriptor(d);
                }
            }
        }
    }
}

/// The tensors of one batch-normalisation call, contiguous, after checking what
/// cuDNN takes: `tensors[0]` 4-D (f32, bf16 or fp16), the others `[C]` in f32 or of
/// `x`'s shape and dtype (`full` lists which). Returns them with `x`'s descriptor key.
fn norm_inputs<const N: usize>(
    tensors: [&Tensor; N],
    full: &[usize],
    layout: Layout,
) -> Result<([Tensor; N], NormKey), String> {
    let x = tensors[0];
    if x.meta.shape().num_dims() != 4 {
        return Err("cuDNN batch norm takes 4-D tensors".into());
    }
    let data = data_type(x.dtype)?;
    for (i, t) in tensors.iter().enumerate() {
        let want = if full.contains(&i) {
            x.dtype
        } else {
            DType::F32
        };
        if t.dtype != want {
            return Err(format!(
                "no cuDNN batch norm for {:?} with {:?}",
                t.dtype, x.dtype
            ));
        }
    }
    let key = NormKey {
        dims: dims(x, layout),
        layout,
        data,
    };
    Ok((tensors.map(|t| into_contiguous(t.clone())), key))
}

/// The buffers of a batch-norm call's three outputs: one of `x`'s size and dtype, two
/// f32 per channel.
fn norm_buffers(client: &Client, x: &Tensor, key: &NormKey) -> [Handle; 3] {
    let channels = key.dims[1] as usize;
    [
        client.empty(x.meta.shape().num_elements() * x.dtype.size()),
        client.empty(channels * 4),
        client.empty(channels * 4),
    ]
}

/// A batch-norm call's three outputs as tensors: the first of `x`'s shape and dtype,
/// the other two per channel, f32.
fn norm_outputs(
    client: &Client,
    x: &Tensor,
    key: &NormKey,
    [full, a, b]: [Handle; 3],
) -> [Tensor; 3] {
    let shape = x.meta.shape();
    let channel = Shape::new([key.dims[1] as usize]);
    let tensor = |shape: Shape, handle, dtype| {
        Tensor::new_contiguous(client.clone(), x.device.clone(), shape, handle, dtype)
    };
    [
        tensor(shape.clone(), full, x.dtype),
        tensor(channel.clone(), a, DType::F32),
        tensor(channel, b, DType::F32),
    ]
}

/// [`NormBackend::batch_norm_train`] through cuDNN.
fn norm_train(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    epsilon: f64,
    layout: Layout,
) -> Result<[Tensor; 3], String> {
    let ([x, gamma, beta], key) = norm_inputs([x, gamma, beta], &[0], layout)?;
    let inputs = [&x, &gamma, &beta].map(|t| t.handle.clone()).to_vec();
    queue_norm(&x, key, Pass::Train, inputs, move |descs, h, p| {
        let (a, b) = scaling(false);
        // SAFETY: contiguous buffers of the described shapes and dtypes, the
        // workspace as large as cuDNN asked; the running statistics (both null) are
        // updated by the caller, as Burn's module does.
        unsafe {
            match descs.ex {
                Some(ex) => sys::cudnnBatchNormalizationForwardTrainingEx(
                    h,
                    descs.mode,
                    OPS_BN,
                    a,
                    b,
                    descs.x,
                    p[0],
                    null_mut(),
                    null(),
                    descs.x,
                    p[3],
                    descs.channel,
                    p[1],
                    p[2],
                    0.0,
                    null_mut(),
                    null_mut(),
                    epsilon,
                    p[4],
                    p[5],
                    null_mut(),
                    p[6],
                    ex.forward,
                    null_mut(),
                    0,
                ),
                None => sys::cudnnBatchNormalizationForwardTraining(
                    h,
                    descs.mode,
                    a,
                    b,
                    descs.x,
                    p[0],
                    descs.x,
                    p[3],
                    descs.channel,
                    p[1],
                    p[2],
                    0.0,
                    null_mut(),
                    null_mut(),
                    epsilon,
                    p[4],
                    p[5],
                ),
            }
        }
    })
}

/// [`NormBackend::batch_norm_grad`] through cuDNN.
fn norm_grad(
    x: &Tensor,
    gamma: &Tensor,
    mean: &Tensor,
    inv_std: &Tensor,
    dy: &Tensor,
    epsilon: f64,
    layout: Layout,
) -> Result<[Tensor; 3], String> {
    let ([x, gamma, mean, inv_std, dy], key) =
        norm_inputs([x, gamma, mean, inv_std, dy], &[0, 4], layout)?;
    let inputs = [&x, &gamma, &mean, &inv_std, &dy]
        .map(|t| t.handle.clone())
        .to_vec();
    queue_norm(&x, key, Pass::Grad, inputs, move |descs, h, p| {
        let (a, b) = scaling(false);
        // SAFETY: contiguous buffers of the described shapes and dtypes, the
        // workspace as large as cuDNN asked; mean and inverse deviation are the
        // forward pass's, computed with the same epsilon.
        unsafe {
            match descs.ex {
                Some(ex) => sys::cudnnBatchNormalizationBackwardEx(
                    h,
                    descs.mode,
                    OPS_BN,
                    a,
                    b,
                    a,
                    b,
                    descs.x,
                    p[0],
                    null_mut(),
                    null(),
                    descs.x,
                    p[4],
                    null_mut(),
                    null_mut(),
                    descs.x,
                    p[5],
                    descs.channel,
                    p[1],
                    null(),
                    p[6],
                    p[7],
                    epsilon,
                    p[2],
                    p[3],
                    null_mut(),
                    p[8],
                    ex.backward,
                    null_mut(),
                    0,
                ),
                None => sys::cudnnBatchNormalizationBackward(
                    h,
                    descs.mode,
                    a,
                    b,
                    a,
                    b,
                    descs.x,
                    p[0],
                    descs.x,
                    p[4],
                    descs.x,
                    p[5],
                    descs.channel,
                    p[1],
                    p[6],
                    p[7],
                    epsilon,
                    p[2],
                    p[3],
                ),
            }
        }
    })
}

/// Which batch-norm call a [`queue_norm`] makes.
#[derive(Clone, Copy)]
enum Pass {
    Train,
    Grad,
}

/// Queues one batch-norm call of `pass` over `x` (described by `key`) on cuDNN (as a
/// round trip for the shape's first call, `on_cudnn_planned`): `call` gets the
/// descriptors, the handle and the addresses of `inputs`, then of the three outputs
/// made here, then of the workspace cuDNN's extended calls ask for (null without).
fn queue_norm(
    x: &Tensor,
    key: NormKey,
    pass: Pass,
    inputs: Vec<Handle>,
    call: impl FnOnce(&NormDescriptors, sys::cudnnHandle_t, &[*mut c_void]) -> sys::cudnnStatus_t
    + Send
    + 'static,
) -> Result<[Tensor; 3], String> {
    let client = x.client.clone();
    let outputs = norm_buffers(&client, x, &key);
    let (planned, kind, what) = match pass {
        Pass::Train => (Planned::NormTrain(key), LibraryCall::NormForward, "forward"),
        Pass::Grad => (
            Planned::NormGrad(key),
            LibraryCall::NormBackward,
            "backward",
        ),
    };
    let job = {
        let (client, outputs) = (client.clone(), outputs.clone());
        move |dnn: &mut Dnn, lane: &mut Lane, h: sys::cudnnHandle_t| {
            let descs = dnn.norm(key, h)?;
            let bytes = descs.ex.map(|ex| match pass {
                Pass::Train => ex.forward,
                Pass::Grad => ex.backward,
            });
            let pws = dnn.workspace(bytes.unwrap_or(0))?;
            let buffers = inputs.iter().chain(&outputs).map(Some).collect::<Vec<_>>();
            lane.queue(&client, &buffers, key.after(), kind, |_, p| {
                let p = p.iter().copied().chain([pws]).collect::<Vec<_>>();
                call(&descs, h, &p)
                    .result()
                    .map_err(|e| format!("batch norm {what} {key:?}: {e:?}"))
            })
        }
    };
    on_cudnn_planned(&client, &x.device, planned, job)?;
    Ok(norm_outputs(&client, x, &key, outputs))
}

/// cuDNN's result, or `None` (Burn's operations) when BatchNorm is not routed to
/// cuDNN or it failed; a failure is reported once.
fn norm_through_cudnn(run: impl FnOnce() -> Result<[Tensor; 3], String>) -> Option<[Tensor; 3]> {
    if !BATCH_NORM.load(Ordering::Relaxed) {
        return None;
    }
    static WARNED: AtomicBool = AtomicBool::new(false);
    warn_once(run(), &WARNED, "a batch norm", "operations")
}

/// kiln's own kernels where they are on (`norm_kernels`, both layouts, the ReLU, a
/// residual addition and the running statistics' update in their passes), then cuDNN
/// where it is on, then Burn's operations; on cuDNN and Burn's operations a ReLU runs
/// beside the layer.
impl<F: FloatElement, I: IntElement, BT: BoolElement> NormBackend
    for CubeBackend<CudaRuntime, F, I, BT>
{
    fn fuses_norm_epilogue(_layout: Layout) -> bool {
        norm_kernels::enabled()
    }

    fn batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        relu: bool,
    ) -> [FloatTensor<Self>; 3] {
        if norm_kernels::enabled()
            && let Some([y, mean, inv_std, _, _]) =
                norm_kernels::train_running(layout, &x, None, &gamma, &beta, epsilon, relu, None)
        {
            return [y, mean, inv_std];
        }
        let [y, mean, inv_std] =
            match norm_through_cudnn(|| norm_train(&x, &gamma, &beta, epsilon, layout)) {
                Some(out) => out,
                None => train_reference::<Self>(x, gamma, beta, epsilon, layout, false),
            };
        let y = if relu {
            <Self as burn::tensor::ops::ActivationOps<Self>>::relu(y)
        } else {
            y
        };
        [y, mean, inv_std]
    }

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
        if norm_kernels::enabled() {
            let given = Some(([&running[0], &running[1]], momentum));
            if let Some(out) =
                norm_kernels::train_running(layout, &x, None, &gamma, &beta, epsilon, relu, given)
            {
                return out;
            }
        }
        let [y, mean, inv_std] = Self::batch_norm_train(x, gamma, beta, epsilon, layout, relu);
        let stats = [mean.clone(), inv_std.clone()];
        let [rm, rv] = blend_reference::<Self>(running, stats, epsilon, momentum);
        [y, mean, inv_std, rm, rv]
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
        if norm_kernels::enabled() {
            let given = Some(([&running[0], &running[1]], momentum));
            if let Some(out) = norm_kernels::train_running(
                layout,
                &x,
                Some(&residual),
                &gamma,
                &beta,
                epsilon,
                true,
                given,
            ) {
                return out;
            }
        }
        add_relu_train_reference::<Self>(
            x, residual, gamma, beta, epsilon, layout, running, momentum,
        )
    }

    fn batch_norm_add_relu_grad(
        x: FloatTensor<Self>,
        out: FloatTensor<Self>,
        [gamma, beta]: [FloatTensor<Self>; 2],
        [mean, inv_std]: [FloatTensor<Self>; 2],
        dout: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
    ) -> [FloatTensor<Self>; 4] {
        if norm_kernels::enabled()
            && let Some(grads) = norm_kernels::grad_after_add(
                layout,
                &x,
                [&gamma, &beta],
                [&mean, &inv_std],
                &out,
                &dout,
            )
        {
            return grads;
        }
        let (params, stats) = ([gamma, beta], [mean, inv_std]);
        add_relu_grad_reference::<Self>(x, out, params, stats, dout, epsilon, layout)
    }

    fn batch_norm_grad(
        x: FloatTensor<Self>,
        [gamma, beta]: [FloatTensor<Self>; 2],
        [mean, inv_std]: [FloatTensor<Self>; 2],
        dy: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        relu: bool,
    ) -> [FloatTensor<Self>; 3] {
        if norm_kernels::enabled()
            && let Some(out) =
                norm_kernels::grad(layout, &x, [&gamma, &beta], [&mean, &inv_std], &dy, relu)
        {
            return out;
        }
        let dy = if relu {
            let stats = [mean.clone(), inv_std.clone()];
            relu_grad_reference::<Self>(x.clone(), [gamma.clone(), beta.clone()], stats, dy, layout)
        } else {
            dy
        };
        let cudnn = || norm_grad(&x, &gamma, &mean, &inv_std, &dy, epsilon, layout);
        match norm_through_cudnn(cudnn) {
            Some(out) => out,
            None => {
                let stats = [mean, inv_std];
                grad_reference::<Self>(x, [gamma, beta], stats, dy, layout, false)
            }
        }
    }
}

/// On a GPU only (`cargo test --release -- --ignored cudnn_batch_norm`, or the test
/// binary with `--ignored` on a GPU machine): cuDNN against Burn's operations, through
/// autodiff and the fusion stream, in both layouts and every precision.
#[cfg(test)]
mod tests {
    use super::super::probe;
    use super::*;
    use crate::test_util::{rel_diff, weighed_sum};
    use burn::backend::Autodiff;
    use burn::backend::cuda::{Cuda, CudaDevice};
    use burn::tensor::{Distribution, FloatDType, Tensor as T};

    type B = Autodiff<Cuda>;

    fn normal(mean: f64, std: f64) -> Distribution {
        Distribution::Normal(mean, std)
    }

    /// Which kernels a [`norm`] runs on.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Kernels {
        Burn,
        Cudnn,
        Kiln,
    }

    /// Batch norm's output, statistics, updated running statistics and gradients
    /// through autodiff and fusion, on an input of mean `center` in `layout` and
    /// `dtype` (the parameters and statistics are f32), of `[batch, channels, height,
    /// width]`. With `relu`, a ReLU follows: passed to the layer, or for
    /// [`Kernels::Burn`] Burn's own ReLU after it.
    fn norm(
        kernels: Kernels,
        layout: Layout,
        dtype: FloatDType,
        [batch, channels, height, width]: [usize; 4],
        center: f64,
        relu: bool,
    ) -> Vec<Vec<f32>> {
        set_batch_norm(kernels == Kernels::Cudnn);
        norm_kernels::set_enabled(kernels == Kernels::Kiln);
        let dev = CudaDevice::new(0);
        <B as burn::tensor::backend::Backend>::seed(&dev, 11);
        let x = T::<B, 4>::random([batch, channels, height, width], normal(center, 2.0), &dev);
        let x = in_layout(x.cast(dtype), layout);
        let gamma = T::<B, 1>::random([channels], normal(1.0, 0.5), &dev);
        let beta = T::<B, 1>::random([channels], normal(0.0, 0.5), &dev);
        let (x, gamma, beta) = (x.require_grad(), gamma.require_grad(), beta.require_grad());
        let p = |t: T<B, 1>| t.into_primitive().tensor();
        let running = [
            T::<B, 1>::random([channels], normal(0.5, 0.5), &dev),
            T::<B, 1>::random([channels], normal(2.0, 0.5), &dev).abs(),
        ];
        let [y, mean, inv_std, running_mean, running_var] = B::batch_norm_train_running(
            x.clone().into_primitive().tensor(),
            p(gamma.clone()),
            p(beta.clone()),
            1e-5,
            layout,
            relu && kernels != Kernels::Burn,
            running.map(p),
            0.1,
        );
        let y = T::<B, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(y));
        let y = if relu && kernels == Kernels::Burn {
            burn::tensor::activation::relu(y)
        } else {
            y
        };
        assert_eq!(y.dtype(), dtype.into());
        let stat = |t| T::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(t));
        let grads = weighed_sum(y.clone()).backward();
        let v = |t: burn::tensor::TensorData| t.convert::<f32>().to_vec::<f32>().unwrap();
        vec![
            v(y.into_data()),
            v(stat(mean).into_data()),
            v(stat(inv_std).into_data()),
            v(stat(running_mean).into_data()),
            v(stat(running_var).into_data()),
            v(x.grad(&grads).unwrap().into_data()),
            v(gamma.grad(&grads).unwrap().into_data()),
            v(beta.grad(&grads).unwrap().into_data()),
        ]
    }

    /// An NCHW tensor in `layout`.
    fn in_layout(t: T<B, 4>, layout: Layout) -> T<B, 4> {
        match layout {
            Layout::Nchw => t,
            Layout::Nhwc => t.permute([0, 2, 3, 1]),
        }
    }

    /// `kernels` against Burn's operations, per case `(layout, dtype, tolerance)`, on
    /// inputs of each of `shapes` (`[batch, channels, height, width]`) and of mean
    /// `center`.
    fn compare(
        kernels: Kernels,
        cases: &[(Layout, FloatDType, f32)],
        shapes: &[[usize; 4]],
        center: f64,
        relu: bool,
    ) {
        let names = [
            "output",
            "mean",
            "inverse deviation",
            "running mean",
            "running variance",
            "x grad",
            "gamma grad",
            "beta grad",
        ];
        for &(layout, dtype, tol) in cases {
            for &shape in shapes {
                let ours = norm(kernels, layout, dtype, shape, center, relu);
                let burn = norm(Kernels::Burn, layout, dtype, shape, center, relu);
                let c = shape[1];
                for (name, (a, b)) in names.iter().zip(ours.iter().zip(&burn)) {
                    let rel = rel_diff(a, b);
                    assert!(
                        rel < tol,
                        "{kernels:?} {layout:?} {dtype:?} {c} channels, mean {center}, relu \
                         {relu}: {name} differs by {rel} relative"
                    );
                }
            }
        }
        set_batch_norm(false);
        norm_kernels::set_enabled(false);
    }

    /// Both sides compute in f32 and round the output and input gradient to bf16.
    const KILN: [(Layout, FloatDType, f32); 6] = [
        (Layout::Nhwc, FloatDType::F32, 1e-3),
        (Layout::Nhwc, FloatDType::BF16, 2e-2),
        (Layout::Nhwc, FloatDType::F16, 5e-3),
        (Layout::Nchw, FloatDType::F32, 1e-3),
        (Layout::Nchw, FloatDType::BF16, 2e-2),
        (Layout::Nchw, FloatDType::F16, 5e-3),
    ];

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn kiln_kernels_match_burns_operations_on_the_gpu() {
        // Channels-last: no vector, vectors of 8 in two cubes of columns, the last cut
        // short, more parts of partial sums than the finishing cube has rows of threads
        // (32,256 rows). NCHW: no vector along 7x9 pixels, vectors along 8x8 and 32x32,
        // one part per channel and several (512 images), more channels than an SM takes
        // cubes. And an input whose mean is far from zero against its spread.
        let shapes = [
            [6, 5, 7, 9],
            [6, 16, 7, 9],
            [6, 520, 7, 9],
            [512, 16, 7, 9],
            [6, 16, 8, 8],
            [64, 3, 32, 32],
        ];
        for relu in [false, true] {
            compare(Kernels::Kiln, &KILN, &shapes, 1.0, relu);
        }
        for layout in [Layout::Nhwc, Layout::Nchw] {
            let f32_only = [(layout, FloatDType::F32, 1e-3)];
            let shapes = [[6, 16, 7, 9], [6, 16, 8, 8]];
            compare(Kernels::Kiln, &f32_only, &shapes, 300.0, false);
        }
    }

    /// A residual block's end, `relu(batch_norm(x) + residual)`, through autodiff and
    /// fusion: in one pass on kiln's kernels, or as Burn's operations, an addition and
    /// Burn's ReLU. Returns the output, running statistics and the gradients of the
    /// input, residual, gamma and beta.
    fn add_relu(
        kernels: Kernels,
        layout: Layout,
        dtype: FloatDType,
        shape: [usize; 4],
    ) -> Vec<Vec<f32>> {
        norm_kernels::set_enabled(kernels == Kernels::Kiln);
        let dev = CudaDevice::new(0);
        <B as burn::tensor::backend::Backend>::seed(&dev, 13);
        let channels = shape[1];
        let x = in_layout(T::<B, 4>::random(shape, normal(1.0, 2.0), &dev), layout);
        let r = in_layout(T::<B, 4>::random(shape, normal(0.0, 1.0), &dev), layout);
        let (x, r) = (x.cast(dtype), r.cast(dtype));
        let gamma = T::<B, 1>::random([channels], normal(1.0, 0.5), &dev);
        let beta = T::<B, 1>::random([channels], normal(0.0, 0.5), &dev);
        let running = [
            T::<B, 1>::random([channels], normal(0.5, 0.5), &dev),
            T::<B, 1>::random([channels], normal(2.0, 0.5), &dev).abs(),
        ];
        // Gamma and beta as 4-D leaves, so one closure reads every gradient.
        let [x, r, gamma, beta] =
            [x, r, gamma.unsqueeze(), beta.unsqueeze()].map(|t| t.require_grad());
        let p4 = |t: &T<B, 4>| t.clone().into_primitive().tensor();
        let p1 = |t: &T<B, 4>| t.clone().flatten::<1>(0, 3).into_primitive().tensor();
        let f = |t| T::<B, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(t));
        let f1 = |t| T::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(t));
        let running = running.map(|t| t.into_primitive().tensor());
        let (out, rm, rv) = if kernels == Kernels::Burn {
            let [y, _, _, rm, rv] = B::batch_norm_train_running(
                p4(&x),
                p1(&gamma),
                p1(&beta),
                1e-5,
                layout,
                false,
                running,
                0.1,
            );
            (burn::tensor::activation::relu(f(y) + r.clone()), rm, rv)
        } else {
            let [out, _, _, rm, rv] = B::batch_norm_add_relu_train(
                p4(&x),
                p4(&r),
                p1(&gamma),
                p1(&beta),
                1e-5,
                layout,
                running,
                0.1,
            );
            (f(out), rm, rv)
        };
        let grads = weighed_sum(out.clone()).backward();
        let v = |t: burn::tensor::TensorData| t.convert::<f32>().to_vec::<f32>().unwrap();
        let grad = |t: &T<B, 4>| v(t.grad(&grads).unwrap().into_data());
        norm_kernels::set_enabled(false);
        vec![
            v(out.into_data()),
            v(f1(rm).into_data()),
            v(f1(rv).into_data()),
            grad(&x),
            grad(&r),
            grad(&gamma),
            grad(&beta),
        ]
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn kiln_add_relu_matches_burns_operations_on_the_gpu() {
        let names = [
            "output",
            "running mean",
            "running variance",
            "x grad",
            "residual grad",
        ];
        let names = names.into_iter().chain(["gamma grad", "beta grad"]);
        let shapes = [[6, 5, 7, 9], [6, 16, 7, 9], [512, 16, 7, 9], [6, 16, 8, 8]];
        let cases = [(FloatDType::F32, 1e-3), (FloatDType::BF16, 2e-2)];
        for layout in [Layout::Nhwc, Layout::Nchw] {
            for ((dtype, tol), shape) in cases.iter().flat_map(|c| shapes.map(|s| (*c, s))) {
                let ours = add_relu(Kernels::Kiln, layout, dtype, shape);
                let burn = add_relu(Kernels::Burn, layout, dtype, shape);
                for (name, (a, b)) in names.clone().zip(ours.iter().zip(&burn)) {
                    let rel = rel_diff(a, b);
                    assert!(
                        rel < tol,
                        "{layout:?} {dtype:?} {shape:?}: {name} differs by {rel} relative"
                    );
                }
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU and cuDNN"]
    fn cudnn_batch_norm_matches_burns_operations_on_the_gpu() {
        probe(0).expect("cuDNN should load on this machine");
        probe_batch_norm().expect("cuDNN should have batch norm");
        let cases = [
            (Layout::Nchw, FloatDType::F32, 1e-3),
            (Layout::Nhwc, FloatDType::F32, 1e-3),
            // Both sides compute in f32 and round the output and input gradient to bf16.
            (Layout::Nhwc, FloatDType::BF16, 2e-2),
            (Layout::Nhwc, FloatDType::F16, 5e-3),
        ];
        // An odd channel count and one cuDNN's NHWC kernels can vectorise.
        for relu in [false, true] {
            compare(
                Kernels::Cudnn,
                &cases,
                &[[6, 5, 7, 9], [6, 16, 7, 9]],
                1.0,
                relu,
            );
        }
    }
}
