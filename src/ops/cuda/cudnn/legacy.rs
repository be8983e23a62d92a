//! cuDNN's legacy convolution calls: descriptors and the heuristic choice of an
//! algorithm, for shapes cuDNN's graph API cannot plan.

use std::ffi::c_void;
use std::mem::MaybeUninit;

use burn::tensor::DType;
use cudarc::cudnn::{result as dnn, sys};

use super::{ConvKey, TENSOR_OP, workspace_limit};
use crate::ops::{ConvPass, Layout};

/// The descriptors of one convolution shape: input, filter and output, and the
/// convolution; destroyed on drop.
pub(super) struct Descriptors {
    pub(super) x: sys::cudnnTensorDescriptor_t,
    pub(super) w: sys::cudnnFilterDescriptor_t,
    pub(super) y: sys::cudnnTensorDescriptor_t,
    pub(super) conv: sys::cudnnConvolutionDescriptor_t,
}

impl Descriptors {
    pub(super) fn new(key: &ConvKey) -> Result<Self, String> {
        let (data, dims, options) = (key.data, key.dims, &key.options);
        let err = |what: &str, e: dnn::CudnnError| format!("{what} of {key:?}: {e:?}");
        let format = tensor_format(key.layout);
        let mut d = Descriptors {
            x: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
        };
        // Each is stored as soon as it exists, so Drop frees whatever was created.
        d.x = dnn::create_tensor_descriptor().map_err(|e| err("tensor descriptor", e))?;
        d.y = dnn::create_tensor_descriptor().map_err(|e| err("tensor descriptor", e))?;
        d.w = dnn::create_filter_descriptor().map_err(|e| err("filter descriptor", e))?;
        d.conv =
            dnn::create_convolution_descriptor().map_err(|e| err("convolution descriptor", e))?;
        let i = |v: usize| v as i32;
        // SAFETY: all four descriptors were created above and are alive.
        unsafe {
            dnn::set_tensor4d_descriptor(d.x, format, data, dims[0])
                .map_err(|e| err("input", e))?;
            dnn::set_filter4d_descriptor(d.w, data, format, dims[1])
                .map_err(|e| err("filter", e))?;
            dnn::set_tensor4d_descriptor(d.y, format, data, dims[2])
                .map_err(|e| err("output", e))?;
            // Half and bfloat16 data accumulate in f32, as PyTorch's autocast does.
            dnn::set_convolution2d_descriptor(
                d.conv,
                i(options.padding[0]),
                i(options.padding[1]),
                i(options.stride[0]),
                i(options.stride[1]),
                i(options.dilation[0]),
                i(options.dilation[1]),
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
            .map_err(|e| err("convolution", e))?;
            dnn::set_convolution_group_count(d.conv, i(options.groups))
                .map_err(|e| err("groups", e))?;
        }
        Ok(d)
    }
}

/// cuDNN's name for `layout` (for filters, NHWC means KRSC).
pub(super) fn tensor_format(layout: Layout) -> sys::cudnnTensorFormat_t {
    match layout {
        Layout::Nchw => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
        Layout::Nhwc => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
    }
}

/// cuDNN's data type for `dtype`, if it has one kiln uses.
pub(super) fn data_type(dtype: DType) -> Result<sys::cudnnDataType_t, String> {
    match dtype {
        DType::F32 => Ok(sys::cudnnDataType_t::CUDNN_DATA_FLOAT),
        DType::F16 => Ok(sys::cudnnDataType_t::CUDNN_DATA_HALF),
        DType::BF16 => Ok(sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16),
        other => Err(format!("no cuDNN path for {other:?}")),
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each pointer is either null (never created) or a live descriptor.
        unsafe {
            if !self.x.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.x);
            }
            if !self.y.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.y);
            }
            if !self.w.is_null() {
                let _ = dnn::destroy_filter_descriptor(self.w);
            }
            if !self.conv.is_null() {
                let _ = dnn::destroy_convolution_descriptor(self.conv);
            }
        }
    }
}

/// An algorithm for one part of the convolution and its workspace (the math type it
/// runs with stays set on the convolution descriptor).
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    pub(super) algo: Algo,
    pub(super) workspace: usize,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Algo {
    Forward(sys::cudnnConvolutionFwdAlgo_t),
    GradX(sys::cudnnConvolutionBwdDataAlgo_t),
    GradWeight(sys::cudnnConvolutionBwdFilterAlgo_t),
}

/// cuDNN's heuristic choice (what PyTorch uses without `cudnn.benchmark`): the first
/// proposal that is supported and whose workspace fits; for bf16 and fp16 each proposed
/// algorithm is tried with tensor-op math first (a permission: cuDNN runs it on the
/// tensor cores where it has such kernels).
///
/// The legacy heuristics rank half-precision proposals with `CUDNN_DEFAULT_MATH`
/// first, which for bf16 and fp16 means no tensor cores: an H200 profile (Nsight
/// Compute, ResNet-18 bf16) showed cuDNN converting to f32 for FMA kernels and a
/// direct data-gradient kernel that took 87% of the step, where PyTorch (which asks
/// for tensor-op math on half types) ran cuDNN's `sm90_xmma` bf16 kernels.
pub(super) fn choose(
    handle: sys::cudnnHandle_t,
    key: &ConvKey,
    d: &Descriptors,
) -> Result<Plan, String> {
    let ok = sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
    let err = |e: dnn::CudnnError| format!("choosing an algorithm for {key:?}: {e:?}");
    let mut count = 0;
    if key.data != sys::cudnnDataType_t::CUDNN_DATA_FLOAT {
        // SAFETY: a live descriptor; the heuristics read the math type it carries.
        unsafe { dnn::set_convolution_math_type(d.conv, TENSOR_OP) }.map_err(err)?;
    }
    // SAFETY: descriptors and handle are alive; cuDNN writes at most the requested
    // number of (plain-data) results, `count` of which are read.
    // The three queries differ only in their types and descriptor order.
    macro_rules! proposals {
        ($perf:ty, $query:path, $variant:path, $a:expr, $b:expr, $c:expr) => {{
            let mut r = [MaybeUninit::<$perf>::zeroed().assume_init(); 16];
            $query(handle, $a, $b, d.conv, $c, 16, &mut count, r.as_mut_ptr()).map_err(err)?;
            r[..count as usize]
                .iter()
                .filter(|p| p.status == ok)
                .map(|p| ($variant(p.algo), p.mathType))
                .collect()
        }};
    }
    let proposals: Vec<(Algo, sys::cudnnMathType_t)> = unsafe {
        match key.part {
            ConvPass::Forward => proposals!(
                sys::cudnnConvolutionFwdAlgoPerf_t,
                dnn::get_convolution_forward_algorithm,
                Algo::Forward,
                d.x,
                d.w,
                d.y
            ),
            ConvPass::GradX => proposals!(
                sys::cudnnConvolutionBwdDataAlgoPerf_t,
                dnn::get_convolution_backward_data_algorithm,
                Algo::GradX,
                d.w,
                d.y,
                d.x
            ),
            ConvPass::GradWeight => proposals!(
                sys::cudnnConvolutionBwdFilterAlgoPerf_t,
                dnn::get_convolution_backward_filter_algorithm,
                Algo::GradWeight,
                d.x,
                d.y,
                d.w
            ),
        }
    };
    let proposals = if key.data == sys::cudnnDataType_t::CUDNN_DATA_FLOAT {
        proposals
    } else {
        // Each algorithm on the tensor cores first, in cuDNN's order, then cuDNN's
        // own pairs, should the workspace query refuse one.
        let on_tensor_cores = proposals.iter().map(|&(algo, _)| (algo, TENSOR_OP));
        let mut tried = Vec::new();
        for (algo, math) in on_tensor_cores.chain(proposals.iter().copied()) {
            // cuDNN may list an algorithm under several math types.
            if !tried.contains(&(algo, math)) {
                tried.push((algo, math));
            }
        }
        tried
    };
    for (algo, math) in proposals {
        // SAFETY: as above; the math type is set before the workspace is asked for,
        // since it changes the size.
        let workspace = unsafe {
            dnn::set_convolution_math_type(d.conv, math).map_err(err)?;
            match algo {
                Algo::Forward(a) => {
                    dnn::get_convolution_forward_workspace_size(handle, d.x, d.w, d.conv, d.y, a)
                }
                Algo::GradX(a) => dnn::get_convolution_backward_data_workspace_size(
                    handle, d.w, d.y, d.conv, d.x, a,
                ),
                Algo::GradWeight(a) => dnn::get_convolution_backward_filter_workspace_size(
                    handle, d.x, d.y, d.conv, d.w, a,
                ),
            }
        };
        match workspace {
            // The descriptor keeps this math type for every call (`run`).
            Ok(workspace) if workspace <= workspace_limit() => {
                return Ok(Plan { algo, workspace });
            }
            _ => continue,
        }
    }
    Err(format!("cuDNN proposes no usable algorithm for {key:?}"))
}

/// cuDNN's `alpha` and `beta`: the result replaces the output (1 and 0), or is added
/// to it (`accumulate`: 1 and 1).
pub(super) fn scaling(accumulate: bool) -> (*const c_void, *const c_void) {
    static ONE: f32 = 1.0;
    static ZERO: f32 = 0.0;
    let beta = if accumulate { &ONE } else { &ZERO };
    (
        &ONE as *const f32 as *const c_void,
        beta as *const f32 as *const c_void,
    )
}
