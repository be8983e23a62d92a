//! cuDNN's convolutions behind Burn's CUDA backend ([`ConvBackend`]): one call per
//! pass (forward, data gradient, weight gradient) on the shape's plan, queued in order
//! with cubecl's work; a shape cuDNN refuses runs on Burn's kernels.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::cubecl::cuda::CudaRuntime;
use burn::tensor::Shape;
use burn::tensor::ops::{ConvOptions, FloatTensor, FloatTensorOps};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::server::Handle;
use cudarc::cudnn::{result as dnn, sys};

use super::super::kiln_stream::{After, Lane};
use super::graph::{self, GraphPlan};
use super::legacy::{Algo, Descriptors, Plan, data_type, scaling};
use super::{Dnn, Planned, Tensor, has_symbols, on_cudnn_planned};
use crate::ops::conv::burn_conv2d;
use crate::ops::{ConvBackend, ConvPass, Layout, LibraryCall, conv2d_output_dims};

static CONVOLUTIONS: AtomicBool = AtomicBool::new(false);

/// Whether the CUDA backend's convolutions run on cuDNN (after [`probe`] succeeded),
/// in every dtype and layout. Set once, before training.
pub fn set_convolutions(on: bool) {
    CONVOLUTIONS.store(on, Ordering::Relaxed);
}

pub(super) fn routed() -> bool {
    CONVOLUTIONS.load(Ordering::Relaxed)
}

/// What one convolution's plan depends on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct ConvKey {
    pub(super) part: ConvPass,
    pub(super) data: sys::cudnnDataType_t,
    /// Input, filter, output, in cuDNN's order whatever the layout (NCHW, KCRS, NKPQ).
    pub(super) dims: [[i32; 4]; 3],
    pub(super) options: ConvOptions<2>,
    pub(super) layout: Layout,
    /// The result is added to what the output buffer holds (cuDNN's `beta` 1), for a
    /// data gradient onto another gradient of the same input.
    pub(super) accumulate: bool,
}

/// One convolution shape, ready to run.
pub(super) enum Conv {
    /// A finalized execution plan of cuDNN's graph API, which a call only executes.
    Graph(GraphPlan),
    /// The legacy call's descriptors and algorithm, where the graph API could not
    /// plan the shape: cuDNN builds a graph inside every such call.
    Legacy { descs: Descriptors, plan: Plan },
}

impl Conv {
    pub(super) fn workspace(&self) -> usize {
        match self {
            Conv::Graph(g) => g.workspace,
            Conv::Legacy { plan, .. } => plan.workspace,
        }
    }
}

/// Whether cuDNN has its graph API's entry points (looked up once).
pub(super) fn graph_api() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        has_symbols(&graph::SYMBOLS)
            .inspect_err(|e| crate::say!("kiln: note: {e}; cuDNN's convolutions take its legacy calls (slower on the host)"))
            .is_ok()
    })
}

/// `t`'s dimensions in NCHW (KCRS) order, as cuDNN's descriptors take them.
pub(super) fn dims(t: &Tensor, layout: Layout) -> [i32; 4] {
    let s = t.meta.shape();
    layout.nchw_dims([s[0], s[1], s[2], s[3]]).map(|d| d as i32)
}

/// One part of the convolution through cuDNN. `grad` is the output's gradient
/// (the two backward parts); `onto`, a contiguous buffer of the output's shape and
/// dtype that the result is added to, in place (the data gradient only).
pub(super) fn run(
    part: ConvPass,
    x: &Tensor,
    w: &Tensor,
    grad: Option<&Tensor>,
    onto: Option<Handle>,
    options: &ConvOptions<2>,
    layout: Layout,
) -> Result<Tensor, String> {
    let data = data_type(x.dtype)?;
    if w.dtype != x.dtype || grad.is_some_and(|g| g.dtype != x.dtype) {
        return Err("mixed dtypes".into());
    }
    // Only the operands a part reads are made contiguous: of the other its shape is
    // enough, and in channels-last the weight is a permuted view, so making it
    // contiguous for the weight gradient would be a copy per convolution and step.
    let (x, w) = match part {
        ConvPass::Forward => (into_contiguous(x.clone()), into_contiguous(w.clone())),
        ConvPass::GradX => (x.clone(), into_contiguous(w.clone())),
        ConvPass::GradWeight => (into_contiguous(x.clone()), w.clone()),
    };
    let grad = grad.map(|g| into_contiguous(g.clone()));
    let (xd, wd) = (dims(&x, layout), dims(&w, layout));
    let yd = match &grad {
        Some(g) => dims(g, layout),
        None => {
            let size = |d: [i32; 4]| d.map(|v| v as usize);
            conv2d_output_dims(size(xd), size(wd), options, Layout::Nchw).map(|v| v as i32)
        }
    };
    let out_dims = match part {
        ConvPass::Forward => yd,
        ConvPass::GradX => xd,
        ConvPass::GradWeight => wd,
    };
    let key = ConvKey {
        part,
        data,
        dims: [xd, wd, yd],
        options: options.clone(),
        layout,
        accumulate: onto.is_some(),
    };
    let client = x.client.clone();
    let bytes = out_dims.iter().map(|&d| d as usize).product::<usize>() * x.dtype.size();
    let out = onto.unwrap_or_else(|| client.empty(bytes));
    let job = {
        let (client, key, out) = (client.clone(), key.clone(), out.clone());
        let x = (part != ConvPass::GradX).then(|| x.handle.clone());
        let w = (part != ConvPass::GradWeight).then(|| w.handle.clone());
        let grad = grad.as_ref().map(|g| g.handle.clone());
        move |dnn: &mut Dnn, lane: &mut Lane, h: sys::cudnnHandle_t| {
            let conv = dnn.conv(&key, h)?;
            let ws = conv.workspace();
            let pws = dnn.workspace(ws)?;
            let buffers = [x.as_ref(), w.as_ref(), Some(&out), grad.as_ref()];
            let kind = match part {
                ConvPass::Forward => LibraryCall::ConvForward,
                ConvPass::GradX => LibraryCall::ConvGradX,
                ConvPass::GradWeight => LibraryCall::ConvGradWeight,
            };
            lane.queue(&client, &buffers, After::Gpu, kind, |_, p| {
                let [px, pw, pout, pgrad] = [p[0], p[1], p[2], p[3]];
                let (descs, plan) = match &*conv {
                    Conv::Graph(g) => {
                        let forward_roles = match part {
                            ConvPass::Forward => [px, pw, pout],
                            ConvPass::GradX => [pout, pw, pgrad],
                            ConvPass::GradWeight => [px, pout, pgrad],
                        };
                        // SAFETY: `execute`'s contract: the buffers are contiguous in
                        // the key's layout and dtype, the workspace as large as the
                        // plan asked, cubecl's buffers 512-byte aligned, and `queue`
                        // orders the stream.
                        return unsafe { g.execute(h, forward_roles, pws) }
                            .map_err(|e| format!("{key:?}: {e}"));
                    }
                    Conv::Legacy { descs, plan } => (descs, plan),
                };
                let (a, b) = scaling(key.accumulate);
                let err = |e: dnn::CudnnError| format!("{key:?}: {e:?}");
                // SAFETY: the pointers are live device buffers of the sizes the
                // descriptors state (contiguous, in the described layout, checked
                // dtypes) and the workspace is as large as cuDNN asked (`queue` orders
                // the stream). The descriptor carries the plan's math type from
                // `choose` on.
                unsafe {
                    match plan.algo {
                        Algo::Forward(algo) => dnn::convolution_forward(
                            h, a, descs.x, px, descs.w, pw, descs.conv, algo, pws, ws, b, descs.y,
                            pout,
                        ),
                        Algo::GradX(algo) => dnn::convolution_backward_data(
                            h, a, descs.w, pw, descs.y, pgrad, descs.conv, algo, pws, ws, b,
                            descs.x, pout,
                        ),
                        Algo::GradWeight(algo) => dnn::convolution_backward_filter(
                            h, a, descs.x, px, descs.y, pgrad, descs.conv, algo, pws, ws, b,
                            descs.w, pout,
                        ),
                    }
                    .map_err(err)
                }
            })
        }
    };
    on_cudnn_planned(&client, &x.device, Planned::Conv(key), job)?;
    let shape = Shape::new(layout.laid_out_dims(out_dims.map(|d| d as usize)));
    Ok(Tensor::new_contiguous(
        client,
        x.device.clone(),
        shape,
        out,
        x.dtype,
    ))
}

/// One part of the convolution: cuDNN's result, or Burn's kernels' when cuDNN is not
/// routed there or failed (a failure is reported once).
pub(super) fn convolve<F: FloatElement, I: IntElement, BT: BoolElement>(
    part: ConvPass,
    x: Tensor,
    w: Tensor,
    grad: Option<Tensor>,
    options: ConvOptions<2>,
    layout: Layout,
) -> Tensor {
    convolve_onto::<F, I, BT>(part, x, w, grad, None, options, layout)
}

/// Data gradients that cuDNN added onto another gradient as it wrote them.
#[cfg(test)]
static ADDED_IN_PLACE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// [`convolve`], its result added to `onto` where given: by cuDNN as it writes,
/// into `onto`'s buffer, where nothing else holds that buffer; else after, as Burn adds.
fn convolve_onto<F: FloatElement, I: IntElement, BT: BoolElement>(
    part: ConvPass,
    x: Tensor,
    w: Tensor,
    grad: Option<Tensor>,
    onto: Option<Tensor>,
    options: ConvOptions<2>,
    layout: Layout,
) -> Tensor {
    type Cube<F, I, BT> = CubeBackend<CudaRuntime, F, I, BT>;
    static WARNED: AtomicBool = AtomicBool::new(false);
    let routed = routed();
    // cuDNN sums into a dense buffer of the result's dtype and shape; where it will
    // not, `onto` is added as it is rather than copied first.
    let dense = routed
        && onto
            .as_ref()
            .is_some_and(|o| o.dtype == x.dtype && o.meta.shape() == x.meta.shape());
    let onto = if dense {
        onto.map(into_contiguous)
    } else {
        onto
    };
    let into = onto
        .as_ref()
        .filter(|o| dense && o.can_mut())
        .map(|o| o.handle.clone());
    let writes_onto = into.is_some();
    let ours = routed
        .then(|| {
            let result = run(part, &x, &w, grad.as_ref(), into, &options, layout);
            warn_once(result, &WARNED, "a convolution", "kernels")
        })
        .flatten();
    // cuDNN summed into `onto` only where it ran and was given the buffer.
    let summed = writes_onto && ours.is_some();
    #[cfg(test)]
    if summed {
        ADDED_IN_PLACE.fetch_add(1, Ordering::Relaxed);
    }
    let result =
        ours.unwrap_or_else(|| burn_conv2d::<Cube<F, I, BT>>(part, x, w, grad, options, layout));
    match onto {
        Some(onto) if !summed => Cube::<F, I, BT>::float_add(result, onto),
        _ => result,
    }
}

/// `result`'s value, or `None` (Burn runs the work instead) with a warning the first
/// time `warned` sees a failure.
pub(super) fn warn_once<T>(
    result: Result<T, String>,
    warned: &AtomicBool,
    what: &str,
    burns: &str,
) -> Option<T> {
    result
        .inspect_err(|e| {
            if !warned.swap(true, Ordering::Relaxed) {
                crate::say!(
                    "kiln: warning: cuDNN could not run {what} ({e}); Burn's {burns} run it instead"
                );
            }
        })
        .ok()
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> ConvBackend
    for CubeBackend<CudaRuntime, F, I, BT>
{
    /// Burn's matmul autotunes each new shape by compiling about fifty candidate
    /// kernels (60-100 s of a cold first step for a classifier's three products);
    /// cuDNN compiles none.
    fn products_as_convolutions() -> bool {
        routed()
    }

    fn conv2d_nobias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        convolve::<F, I, BT>(ConvPass::Forward, x, weight, None, options, layout)
    }

    fn conv2d_grad_x(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        let grad = Some(output_grad);
        convolve::<F, I, BT>(ConvPass::GradX, x, weight, grad, options, layout)
    }

    fn conv2d_grad_x_onto(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        onto: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        let (grad, onto) = (Some(output_grad), Some(onto));
        convolve_onto::<F, I, BT>(ConvPass::GradX, x, weight, grad, onto, options, layout)
    }

    fn conv2d_grad_weight(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        let grad = Some(output_grad);
        convolve::<F, I, BT>(ConvPass::GradWeight, x, weight, grad, options, layout)
    }
}

/// On a GPU only (`cargo test --release -- --ignored cudnn`, or the test binary with
/// `--ignored` on a GPU machine): cuDNN against Burn's kernels, through autodiff and
/// the fusion stream, for every part, strided shapes with odd sizes, f32 and bf16, in
/// both layouts.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::conv2d;
    use crate::test_util::{rel_diff, weighed_sum};
    use burn::backend::Autodiff;
    use burn::backend::cuda::{Cuda, CudaDevice};
    use burn::tensor::{Distribution, FloatDType, Tensor as T};

    type B = Autodiff<Cuda>;

    /// Channels-last runs take NHWC / KRSC views of the same NCHW leaves and hand an
    /// NCHW view of the output back, so both layouts compare with Burn's NCHW result.
    fn run(
        cudnn: bool,
        dtype: FloatDType,
        layout: Layout,
        stride: usize,
        size: usize,
    ) -> [Vec<f32>; 3] {
        set_convolutions(cudnn);
        let dev = CudaDevice::new(0);
        <B as burn::tensor::backend::Backend>::seed(&dev, 7);
        let normal = Distribution::Normal(0.0, 1.0);
        let x = T::<B, 4>::random([4, 8, size, size], normal, &dev).require_grad();
        let w = T::<B, 4>::random([16, 8, 3, 3], normal, &dev).require_grad();
        let options = ConvOptions::new([stride, stride], [1, 1], [1, 1], 1);
        let into = |t: T<B, 4>| match layout {
            Layout::Nchw => t.cast(dtype),
            Layout::Nhwc => t.cast(dtype).permute([0, 2, 3, 1]),
        };
        let nchw = |t: T<B, 4>| match layout {
            Layout::Nchw => t.cast(FloatDType::F32),
            Layout::Nhwc => t.cast(FloatDType::F32).permute([0, 3, 1, 2]),
        };
        let input = into(x.clone());
        let y = nchw(conv2d(input.clone(), into(w.clone()), options, layout));
        // The input feeds a shortcut too, recorded after the convolution as in a
        // residual block, so that the data gradient adds onto the shortcut's gradient.
        let shortcut = nchw(input);
        let grads = (weighed_sum(y.clone()) + weighed_sum(shortcut)).backward();
        let v = |t: burn::tensor::TensorData| t.convert::<f32>().to_vec::<f32>().unwrap();
        [
            v(y.into_data()),
            v(x.grad(&grads).unwrap().into_data()),
            v(w.grad(&grads).unwrap().into_data()),
        ]
    }

    #[test]
    #[ignore = "needs a CUDA GPU and cuDNN"]
    fn cudnn_matches_burns_kernels_on_the_gpu() {
        super::super::probe(0).expect("cuDNN should load on this machine");
        let cases = [
            (FloatDType::F32, Layout::Nchw, 2e-2),
            (FloatDType::BF16, Layout::Nchw, 1e-1),
            (FloatDType::F32, Layout::Nhwc, 2e-2),
            (FloatDType::BF16, Layout::Nhwc, 1e-1),
        ];
        let added_before = ADDED_IN_PLACE.load(Ordering::Relaxed);
        for (dtype, layout, tol) in cases {
            for (stride, size) in [(1, 9), (2, 7), (2, 8)] {
                let ours = run(true, dtype, layout, stride, size);
                let burn = run(false, dtype, Layout::Nchw, stride, size);
                for (part, (a, b)) in ["output", "input grad", "weight grad"]
                    .iter()
                    .zip(ours.iter().zip(&burn))
                {
                    let rel = rel_diff(a, b);
                    assert!(
                        rel < tol,
                        "{dtype:?} {layout:?} stride {stride} size {size}: {part} differs by {rel} relative"
                    );
                }
            }
        }
        set_convolutions(false);
        let added = ADDED_IN_PLACE.load(Ordering::Relaxed) - added_before;
        assert_eq!(
            added, 12,
            "data gradients added onto the shortcut's by cuDNN"
        );
    }

    /// The classifier's product (`model::precision::dense`: a 1x1 convolution over 1x1
    /// images, on cuDNN here) and its gradients against the same sums on the host.
    #[test]
    #[ignore = "needs a CUDA GPU and cuDNN"]
    fn the_classifier_on_cudnn_matches_the_product_on_the_host() {
        use crate::config::Precision;
        use crate::model::precision::dense;
        use burn::module::Param;
        use burn::nn::LinearConfig;
        use burn::tensor::TensorData;
        super::super::probe(0).expect("cuDNN should load on this machine");
        set_convolutions(true);
        assert!(
            B::products_as_convolutions(),
            "routed to cuDNN, dense takes the convolution"
        );
        let dev = CudaDevice::new(0);
        let (n, f, c) = (6, 40, 10);
        let xs: Vec<f32> = (0..n * f)
            .map(|i| (i * 7 % 13) as f32 / 6.0 - 1.0)
            .collect();
        let ws: Vec<f32> = (0..f * c)
            .map(|i| (i * 5 % 11) as f32 / 10.0 - 0.5)
            .collect();
        let bs: Vec<f32> = (0..c).map(|k| k as f32 / 10.0).collect();
        let gs: Vec<f32> = (0..n * c).map(|i| i as f32 / (n * c) as f32).collect();
        let (mut y, mut dx, mut dw) = (bs.repeat(n), vec![0f32; n * f], vec![0f32; f * c]);
        for i in 0..n {
            for j in 0..f {
                for k in 0..c {
                    y[i * c + k] += xs[i * f + j] * ws[j * c + k];
                    dx[i * f + j] += gs[i * c + k] * ws[j * c + k];
                    dw[j * c + k] += xs[i * f + j] * gs[i * c + k];
                }
            }
        }
        let data = |v: &[f32], shape: Vec<usize>| TensorData::new(v.to_vec(), shape);
        for (precision, tol) in [(Precision::Fp32, 1e-2), (Precision::Bf16, 3e-2)] {
            let mut fc = LinearConfig::new(f, c).init::<B>(&dev);
            fc.weight = Param::from_tensor(T::from_data(data(&ws, vec![f, c]), &dev));
            fc.bias = Some(Param::from_tensor(T::from_data(data(&bs, vec![c]), &dev)));
            let x = T::<B, 2>::from_data(data(&xs, vec![n, f]), &dev).require_grad();
            let out = dense(&fc, x.clone(), precision);
            let weights = T::<B, 2>::from_data(data(&gs, vec![n, c]), &dev);
            let grads = (out.clone() * weights).sum().backward();
            let v = |t: burn::tensor::TensorData| t.convert::<f32>().to_vec::<f32>().unwrap();
            let got = [
                v(out.into_data()),
                v(x.grad(&grads).unwrap().into_data()),
                v(fc.weight.val().grad(&grads).unwrap().into_data()),
            ];
            for (part, (a, b)) in ["output", "input grad", "weight grad"]
                .iter()
                .zip(got.iter().zip([&y, &dx, &dw]))
            {
                let rel = rel_diff(a, b);
                assert!(rel < tol, "{precision:?}: {part} differs by {rel} relative");
            }
        }
        set_convolutions(false);
    }
}
