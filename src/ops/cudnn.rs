//! cuDNN's convolutions behind Burn's CUDA backend (`train.convolution`).
//!
//! Burn 0.21's implicit-GEMM convolutions were two thirds of a ResNet-18 step on an
//! H200 (BENCHMARKS.md, "Where the time goes"). cuDNN is loaded at run time (cudarc's
//! bindings, cuDNN 9) and probed before training; a call it refuses (a shape or dtype
//! without an algorithm) runs on Burn's kernels.
//!
//! cubecl keeps its CUDA streams private. cuDNN runs on the calling thread's cubecl
//! stream itself where kiln has learnt which it is (`cubecl_stream`, through CUPTI),
//! in order with cubecl's kernels; otherwise on kiln's own stream (`kiln_stream`),
//! ordered against cubecl's on the GPU (`stream_order`). Either way the host queues
//! the call and goes on. Where neither can be set up, the call waits on the host for
//! cubecl's stream before and for its own after, as the first version did (two host
//! synchronisations per convolution, each draining the GPU's queue).
//!
//! A call runs whole on cubecl's device thread: the device addresses of a call's
//! buffers are known only there, and each question asked from the fusion thread that
//! queues the call is a blocking round trip that waits for that thread's queue to
//! drain. Each shape's first call is one such trip (`ComputeClient::exclusive`), so a
//! shape cuDNN refuses reports it; later calls are queued there without waiting
//! (`on_cudnn_planned`). Each shape's execution plan is made once (`graph`, cuDNN's
//! graph API; the legacy calls' descriptors and algorithm where that cannot plan it)
//! and kept with the thread's cuDNN handle.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::mem::{ManuallyDrop, MaybeUninit};
use std::rc::Rc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn::tensor::ops::{ConvOptions, FloatTensor};
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cudarc::cudnn::{result as dnn, sys};
use cudarc::driver::sys as dsys;

use super::conv::burn_conv2d;
use super::kiln_stream::{
    After, Client, Lane, on_device_thread, queue_handle, queue_on_device_thread, with_lane,
};
use super::{ConvBackend, Layout, LibraryCall, Part, conv2d_output_dims};

mod batch_norm;
mod graph;
use batch_norm::{NormDescriptors, NormKey};
pub use batch_norm::{probe_batch_norm, set_batch_norm};
use graph::GraphPlan;

type Tensor = CubeTensor<CudaRuntime>;

/// The most workspace one convolution gets; an algorithm that asks for more is passed
/// over for cuDNN's next proposal.
const MAX_WORKSPACE: usize = 1 << 30;

const TENSOR_OP: sys::cudnnMathType_t = sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH;

static CONVOLUTIONS: AtomicBool = AtomicBool::new(false);

/// Whether the CUDA backend's convolutions run on cuDNN (after [`probe`] succeeded),
/// in every dtype and layout. Set once, before training.
pub fn set_convolutions(on: bool) {
    CONVOLUTIONS.store(on, Ordering::Relaxed);
}

fn routed() -> bool {
    CONVOLUTIONS.load(Ordering::Relaxed)
}

/// Whether cuDNN can be loaded and can plan a convolution on GPU `ordinal`: its
/// version on success, what failed otherwise.
pub fn probe(ordinal: usize) -> Result<String, String> {
    // cudarc panics when the library is missing, so look for it first, by the names
    // it will try.
    // SAFETY: loading cuDNN runs no initialisation code with preconditions.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcudnn.so (cuDNN 9) was not found on the library path".into());
    }
    let version = dnn::get_version();
    if version < 90000 {
        return Err(format!("cuDNN {version} is older than 9.0"));
    }
    // SAFETY: the version checks take no arguments; they load the convolution and
    // operation sub-libraries, whose absence shows here rather than mid-training.
    unsafe {
        sys::cudnnCnnVersionCheck()
            .result()
            .map_err(|e| format!("cuDNN's convolution library: {e:?}"))?;
        sys::cudnnOpsVersionCheck()
            .result()
            .map_err(|e| format!("cuDNN's operations library: {e:?}"))?;
    }
    with_lane(ordinal, |lane| {
        let stream = lane.stream();
        with_cudnn(ordinal, lane, stream, |dnn, _, handle| {
            // A small convolution planned end to end, as training will.
            let key = ConvKey {
                part: Part::Forward,
                data: sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
                dims: [[8, 16, 32, 32], [16, 16, 3, 3], [8, 16, 32, 32]],
                options: ConvOptions::new([1, 1], [1, 1], [1, 1], 1),
                layout: Layout::Nchw,
            };
            dnn.conv(&key, handle).map(|_| ())
        })
    })?;
    Ok(format!(
        "{}.{}.{}",
        version / 10000,
        version / 100 % 100,
        version % 100
    ))
}

/// cuDNN's state per thread and device: its handle on the lane's stream (`kiln_stream`)
/// and what each shape needs. Training calls run on cubecl's device thread, so each
/// device has one; [`probe`] makes its own on the caller's.
struct Dnn {
    /// Made on the first cuDNN call, so work without cuDNN needs no cuDNN; with the
    /// stream it was last set to queue on.
    handle: Option<(sys::cudnnHandle_t, dsys::CUstream)>,
    /// Each convolution shape's plan ([`Conv`]), or why cuDNN cannot run it
    /// (remembered, so such a shape goes straight to Burn's kernels).
    convs: HashMap<ConvKey, Result<Rc<Conv>, String>>,
    /// Each batch-norm input's descriptors.
    norms: HashMap<NormKey, Rc<NormDescriptors>>,
}

thread_local! {
    // Kept until the thread ends, then leaked, handle, descriptors and plans alike: a
    // replica thread ends with its training, and destroying cuDNN's objects after
    // their context may be gone is worse than one set per device and training.
    static DNN: RefCell<ManuallyDrop<HashMap<usize, Dnn>>> =
        RefCell::new(ManuallyDrop::new(HashMap::new()));
}

/// `f` with this thread's cuDNN state for GPU `ordinal`, inside a [`with_lane`] (or
/// [`on_device_thread`]) for that GPU, which makes its context current.
fn with_dnn<T>(ordinal: usize, f: impl FnOnce(&mut Dnn) -> Result<T, String>) -> Result<T, String> {
    DNN.with(|map| {
        let mut map = map.borrow_mut();
        let dnn = map.entry(ordinal).or_insert_with(|| Dnn {
            handle: None,
            convs: HashMap::new(),
            norms: HashMap::new(),
        });
        f(dnn)
    })
}

/// `work` with this thread's cuDNN state for GPU `ordinal`, `lane` (this thread's for
/// that GPU) and the cuDNN handle on `stream`.
fn with_cudnn<T>(
    ordinal: usize,
    lane: &mut Lane,
    stream: dsys::CUstream,
    work: impl FnOnce(&mut Dnn, &mut Lane, sys::cudnnHandle_t) -> Result<T, String>,
) -> Result<T, String> {
    with_dnn(ordinal, |dnn| {
        let handle = dnn.handle(stream)?;
        work(dnn, lane, handle)
    })
}

/// [`with_cudnn`] on the stream the lane queues `client`'s work on ([`Lane::target`]).
fn with_cudnn_for<T>(
    client: &Client,
    ordinal: usize,
    lane: &mut Lane,
    work: impl FnOnce(&mut Dnn, &mut Lane, sys::cudnnHandle_t) -> Result<T, String>,
) -> Result<T, String> {
    let stream = lane.target(client);
    with_cudnn(ordinal, lane, stream, work)
}

/// Runs `work` on cubecl's device thread ([`on_device_thread`]) with that thread's cuDNN
/// state, lane and cuDNN handle for GPU `ordinal` ([`with_cudnn`]).
fn on_cudnn<T: Send + 'static>(
    client: &Client,
    ordinal: usize,
    work: impl FnOnce(&mut Dnn, &mut Lane, sys::cudnnHandle_t) -> Result<T, String> + Send,
) -> Result<T, String> {
    on_device_thread(client, ordinal, |lane| {
        with_cudnn_for(client, ordinal, lane, work)
    })
}

/// A shape cuDNN has run once on the calling thread's device.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Planned {
    Conv(ConvKey),
    NormTrain(NormKey),
    NormGrad(NormKey),
}

thread_local! {
    // Per calling (fusion) thread and device: what `on_cudnn_planned` may queue.
    static PLANNED: RefCell<HashSet<(usize, Planned)>> = RefCell::new(HashSet::new());
}

/// Runs `work` on cubecl's device thread with its cuDNN state for `device`: the first
/// time for each shape (per calling thread) as a round trip ([`on_cudnn`]), so that a
/// shape cuDNN cannot plan or run reports its error and goes to Burn's kernels; after
/// that queued without waiting (`kiln_stream::queue_on_device_thread`), which measured
/// 48-66% of a ResNet step as round trips (BENCHMARKS.md, eleventh session).
fn on_cudnn_planned(
    client: &Client,
    device: &CudaDevice,
    shape: Planned,
    work: impl FnOnce(&mut Dnn, &mut Lane, sys::cudnnHandle_t) -> Result<(), String> + Send + 'static,
) -> Result<(), String> {
    let ordinal = device.index;
    let entry = (ordinal, shape);
    if PLANNED.with(|p| p.borrow().contains(&entry)) {
        let client = client.clone();
        queue_on_device_thread(device, ordinal, move |lane| {
            with_cudnn_for(&client, ordinal, lane, work)
        });
        return Ok(());
    }
    on_cudnn(client, ordinal, work)?;
    queue_handle(device);
    PLANNED.with(|p| p.borrow_mut().insert(entry));
    Ok(())
}

impl Dnn {
    /// The cuDNN handle, set to queue on `stream` (cuDNN must have passed [`probe`]).
    fn handle(&mut self, stream: dsys::CUstream) -> Result<sys::cudnnHandle_t, String> {
        let handle = match self.handle {
            Some((h, on)) if on == stream => return Ok(h),
            Some((h, _)) => h,
            None => dnn::create_handle().map_err(|e| format!("cudnnCreate: {e:?}"))?,
        };
        // SAFETY: this thread's handle and a stream of the lane's device (kiln's, or
        // cubecl's for the calling `StreamId`), in the same context.
        unsafe { dnn::set_stream(handle, stream as sys::cudaStream_t) }
            .map_err(|e| format!("cudnnSetStream: {e:?}"))?;
        self.handle = Some((handle, stream));
        Ok(handle)
    }

    /// The plan of the convolution `key` describes (the graph API's, else the legacy
    /// call's descriptors and algorithm), made on its first call.
    fn conv(&mut self, key: &ConvKey, handle: sys::cudnnHandle_t) -> Result<Rc<Conv>, String> {
        if let Some(known) = self.convs.get(key) {
            return known.clone();
        }
        static NOTED: AtomicBool = AtomicBool::new(false);
        let note = |e: &String| {
            if !NOTED.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "kiln: note: cuDNN's graph API cannot plan a convolution ({e}); such shapes take its legacy calls (slower on the host)"
                );
            }
        };
        let graph = graph_api()
            .then(|| GraphPlan::new(handle, key).inspect_err(note).ok())
            .flatten();
        let made = match graph {
            Some(g) => Ok(Rc::new(Conv::Graph(g))),
            None => Descriptors::new(key).and_then(|descs| {
                let plan = choose(handle, key, &descs)?;
                Ok(Rc::new(Conv::Legacy { descs, plan }))
            }),
        };
        self.convs.insert(key.clone(), made.clone());
        made
    }

    /// The descriptors of batch normalisation over the input `key` describes.
    fn norm(
        &mut self,
        key: NormKey,
        handle: sys::cudnnHandle_t,
    ) -> Result<Rc<NormDescriptors>, String> {
        if let Some(known) = self.norms.get(&key) {
            return Ok(known.clone());
        }
        let made = Rc::new(NormDescriptors::new(key, handle)?);
        self.norms.insert(key, made.clone());
        Ok(made)
    }
}

/// What one convolution's plan depends on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ConvKey {
    part: Part,
    data: sys::cudnnDataType_t,
    /// Input, filter, output, in cuDNN's order whatever the layout (NCHW, KCRS, NKPQ).
    dims: [[i32; 4]; 3],
    options: ConvOptions<2>,
    layout: Layout,
}

/// One convolution shape, ready to run.
enum Conv {
    /// A finalized execution plan of cuDNN's graph API, which a call only executes.
    Graph(GraphPlan),
    /// The legacy call's descriptors and algorithm, where the graph API could not
    /// plan the shape: cuDNN builds a graph inside every such call.
    Legacy { descs: Descriptors, plan: Plan },
}

impl Conv {
    fn workspace(&self) -> usize {
        match self {
            Conv::Graph(g) => g.workspace,
            Conv::Legacy { plan, .. } => plan.workspace,
        }
    }
}

/// Whether cuDNN has its graph API's entry points (looked up once).
fn graph_api() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        has_symbols(&graph::SYMBOLS)
            .inspect_err(|e| eprintln!("kiln: note: {e}; cuDNN's convolutions take its legacy calls (slower on the host)"))
            .is_ok()
    })
}

/// Whether the loaded cuDNN has every one of `names`: cudarc panics at the first call
/// of a symbol a slimmed install lacks.
fn has_symbols(names: &[&str]) -> Result<(), String> {
    for name in names {
        // SAFETY: only looks the symbol up; `probe` has loaded the library.
        let found = unsafe { sys::culib().get::<unsafe extern "C" fn()>(name.as_bytes()) };
        found.map_err(|e| format!("{name} is missing from cuDNN: {e}"))?;
    }
    Ok(())
}

/// The descriptors of one convolution shape: input, filter and output, and the
/// convolution; destroyed on drop.
struct Descriptors {
    x: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
}

impl Descriptors {
    fn new(key: &ConvKey) -> Result<Self, String> {
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
fn tensor_format(layout: Layout) -> sys::cudnnTensorFormat_t {
    match layout {
        Layout::Nchw => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
        Layout::Nhwc => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
    }
}

/// cuDNN's data type for `dtype`, if it has one kiln uses.
fn data_type(dtype: DType) -> Result<sys::cudnnDataType_t, String> {
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
struct Plan {
    algo: Algo,
    workspace: usize,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Algo {
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
fn choose(handle: sys::cudnnHandle_t, key: &ConvKey, d: &Descriptors) -> Result<Plan, String> {
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
            Part::Forward => proposals!(
                sys::cudnnConvolutionFwdAlgoPerf_t,
                dnn::get_convolution_forward_algorithm,
                Algo::Forward,
                d.x,
                d.w,
                d.y
            ),
            Part::GradX => proposals!(
                sys::cudnnConvolutionBwdDataAlgoPerf_t,
                dnn::get_convolution_backward_data_algorithm,
                Algo::GradX,
                d.w,
                d.y,
                d.x
            ),
            Part::GradWeight => proposals!(
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
            Ok(workspace) if workspace <= MAX_WORKSPACE => {
                return Ok(Plan { algo, workspace });
            }
            _ => continue,
        }
    }
    Err(format!("cuDNN proposes no usable algorithm for {key:?}"))
}

/// cuDNN's `alpha` and `beta` for "the result replaces the output" (1 and 0).
fn write_scaling() -> (*const c_void, *const c_void) {
    static ONE: f32 = 1.0;
    static ZERO: f32 = 0.0;
    (
        &ONE as *const f32 as *const c_void,
        &ZERO as *const f32 as *const c_void,
    )
}

/// `t`'s dimensions in NCHW (KCRS) order, as cuDNN's descriptors take them.
fn dims(t: &Tensor, layout: Layout) -> [i32; 4] {
    let s = t.meta.shape();
    layout.nchw_dims([s[0], s[1], s[2], s[3]]).map(|d| d as i32)
}

/// One part of the convolution through cuDNN. `grad` is the output's gradient
/// (the two backward parts).
fn run(
    part: Part,
    x: &Tensor,
    w: &Tensor,
    grad: Option<&Tensor>,
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
        Part::Forward => (into_contiguous(x.clone()), into_contiguous(w.clone())),
        Part::GradX => (x.clone(), into_contiguous(w.clone())),
        Part::GradWeight => (into_contiguous(x.clone()), w.clone()),
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
        Part::Forward => yd,
        Part::GradX => xd,
        Part::GradWeight => wd,
    };
    let key = ConvKey {
        part,
        data,
        dims: [xd, wd, yd],
        options: options.clone(),
        layout,
    };
    let client = x.client.clone();
    let bytes = out_dims.iter().map(|&d| d as usize).product::<usize>() * x.dtype.size();
    let out = client.empty(bytes);
    let job = {
        let (client, key, out) = (client.clone(), key.clone(), out.clone());
        let x = (part != Part::GradX).then(|| x.handle.clone());
        let w = (part != Part::GradWeight).then(|| w.handle.clone());
        let grad = grad.as_ref().map(|g| g.handle.clone());
        move |dnn: &mut Dnn, lane: &mut Lane, h: sys::cudnnHandle_t| {
            let conv = dnn.conv(&key, h)?;
            let ws = conv.workspace();
            let workspace = (ws > 0).then(|| client.empty(ws));
            let buffers = [
                x.as_ref(),
                w.as_ref(),
                Some(&out),
                grad.as_ref(),
                workspace.as_ref(),
            ];
            let kind = match part {
                Part::Forward => LibraryCall::ConvForward,
                Part::GradX => LibraryCall::ConvGradX,
                Part::GradWeight => LibraryCall::ConvGradWeight,
            };
            lane.queue(&client, &buffers, After::Gpu, kind, |_, p| {
                let [px, pw, pout, pgrad, pws] = [p[0], p[1], p[2], p[3], p[4]];
                let (descs, plan) = match &*conv {
                    Conv::Graph(g) => {
                        let forward_roles = match part {
                            Part::Forward => [px, pw, pout],
                            Part::GradX => [pout, pw, pgrad],
                            Part::GradWeight => [px, pout, pgrad],
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
                let (a, b) = write_scaling();
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
fn convolve<F: FloatElement, I: IntElement, BT: BoolElement>(
    part: Part,
    x: Tensor,
    w: Tensor,
    grad: Option<Tensor>,
    options: ConvOptions<2>,
    layout: Layout,
) -> Tensor {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let ours = routed()
        .then(|| {
            let result = run(part, &x, &w, grad.as_ref(), &options, layout);
            warn_once(result, &WARNED, "a convolution", "kernels")
        })
        .flatten();
    ours.unwrap_or_else(|| {
        burn_conv2d::<CubeBackend<CudaRuntime, F, I, BT>>(part, x, w, grad, options, layout)
    })
}

/// `result`'s value, or `None` (Burn runs the work instead) with a warning the first
/// time `warned` sees a failure.
fn warn_once<T>(
    result: Result<T, String>,
    warned: &AtomicBool,
    what: &str,
    burns: &str,
) -> Option<T> {
    result
        .inspect_err(|e| {
            if !warned.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "kiln: warning: cuDNN could not run {what} ({e}); Burn's {burns} run it instead"
                );
            }
        })
        .ok()
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> ConvBackend
    for CubeBackend<CudaRuntime, F, I, BT>
{
    fn conv2d_nobias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        convolve::<F, I, BT>(Part::Forward, x, weight, None, options, layout)
    }

    fn conv2d_grad_x(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        let grad = Some(output_grad);
        convolve::<F, I, BT>(Part::GradX, x, weight, grad, options, layout)
    }

    fn conv2d_grad_weight(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        let grad = Some(output_grad);
        convolve::<F, I, BT>(Part::GradWeight, x, weight, grad, options, layout)
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
    use crate::test_util::rel_diff;
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
        let y = conv2d(into(x.clone()), into(w.clone()), options, layout).cast(FloatDType::F32);
        let y = match layout {
            Layout::Nchw => y,
            Layout::Nhwc => y.permute([0, 3, 1, 2]),
        };
        let n = y.shape().num_elements() as i64;
        let weights = T::<B, 1, burn::tensor::Int>::arange(0..n, &dev)
            .float()
            .reshape(y.shape())
            / n as f32;
        let grads = (y.clone() * weights).sum().backward();
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
        probe(0).expect("cuDNN should load on this machine");
        let cases = [
            (FloatDType::F32, Layout::Nchw, 2e-2),
            (FloatDType::BF16, Layout::Nchw, 1e-1),
            (FloatDType::F32, Layout::Nhwc, 2e-2),
            (FloatDType::BF16, Layout::Nhwc, 1e-1),
        ];
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
    }
}
