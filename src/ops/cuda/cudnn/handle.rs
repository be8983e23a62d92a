//! cuDNN's state per thread and device (its handle, each shape's plan), and running a
//! call on cubecl's device thread with it: a round trip for each shape's first call, so
//! a shape cuDNN refuses reports it; queued without waiting after that.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::rc::Rc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::cubecl::cuda::CudaDevice;
use cudarc::cudnn::{result as dnn, sys};
use cudarc::driver::{result as drv, sys as dsys};

use super::super::kiln_stream::{
    Client, Lane, on_device_thread, queue_handle, queue_on_device_thread,
};
use super::legacy::{Descriptors, choose};
use super::{Conv, ConvKey, GraphPlan, NormDescriptors, NormKey, conv::graph_api};

/// cuDNN's state per thread and device: its handle on the lane's stream (`kiln_stream`)
/// and what each shape needs. Training calls run on cubecl's device thread, so each
/// device has one; [`probe`] makes its own on the caller's.
pub(super) struct Dnn {
    /// Made on the first cuDNN call, so work without cuDNN needs no cuDNN; with the
    /// stream it was last set to queue on.
    pub(super) handle: Option<(sys::cudnnHandle_t, dsys::CUstream)>,
    /// Each convolution shape's plan ([`Conv`]), or why cuDNN cannot run it
    /// (remembered, so such a shape goes straight to Burn's kernels).
    pub(super) convs: HashMap<ConvKey, Result<Rc<Conv>, String>>,
    /// Each batch-norm input's descriptors.
    pub(super) norms: HashMap<NormKey, Rc<NormDescriptors>>,
    /// One workspace per stream, as large as the largest call on it has asked for.
    /// Calls on one stream run one after the other, so they can share it. It is
    /// kiln's own allocation, outside cubecl's pool: that pool keeps every size it
    /// ever handed out, so the sizes the workspace grew through on the first step
    /// stayed reserved for the run.
    workspaces: HashMap<dsys::CUstream, Workspace>,
    /// The GPU, for the workspace's count ([`workspace_peak`]).
    ordinal: usize,
}

/// A device buffer for cuDNN's scratch space, freed when a larger one replaces it.
struct Workspace {
    ptr: dsys::CUdeviceptr,
    bytes: usize,
}

/// Bytes of cuDNN workspace held per GPU (all threads), now (to add up the streams')
/// and at most.
static WORKSPACE_BYTES: Mutex<BTreeMap<usize, (u64, u64)>> = Mutex::new(BTreeMap::new());

fn count_workspace(ordinal: usize, added: usize, removed: usize) {
    let mut all = WORKSPACE_BYTES.lock().unwrap_or_else(|e| e.into_inner());
    let (now, peak) = all.entry(ordinal).or_default();
    *now = (*now + added as u64).saturating_sub(removed as u64);
    *peak = (*peak).max(*now);
}

/// The most cuDNN workspace GPU `ordinal` has held at once, in bytes.
pub fn workspace_peak(ordinal: usize) -> u64 {
    let all = WORKSPACE_BYTES.lock().unwrap_or_else(|e| e.into_inner());
    all.get(&ordinal).map_or(0, |&(_, peak)| peak)
}

thread_local! {
    // Kept until the thread ends, then leaked, handle, workspace, descriptors and plans: a
    // replica thread ends with its training, and destroying cuDNN's objects after
    // their context may be gone is worse than one set per device and training.
    static DNN: RefCell<ManuallyDrop<HashMap<usize, Dnn>>> =
        RefCell::new(ManuallyDrop::new(HashMap::new()));
}

/// `f` with this thread's cuDNN state for GPU `ordinal`, inside a [`with_lane`] (or
/// [`on_device_thread`]) for that GPU, which makes its context current.
pub(super) fn with_dnn<T>(
    ordinal: usize,
    f: impl FnOnce(&mut Dnn) -> Result<T, String>,
) -> Result<T, String> {
    DNN.with(|map| {
        let mut map = map.borrow_mut();
        let dnn = map.entry(ordinal).or_insert_with(|| Dnn {
            handle: None,
            convs: HashMap::new(),
            norms: HashMap::new(),
            workspaces: HashMap::new(),
            ordinal,
        });
        f(dnn)
    })
}

/// `work` with this thread's cuDNN state for GPU `ordinal`, `lane` (this thread's for
/// that GPU) and the cuDNN handle on `stream`.
pub(super) fn with_cudnn<T>(
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
pub(super) fn with_cudnn_for<T>(
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
pub(super) fn on_cudnn<T: Send + 'static>(
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
pub(super) enum Planned {
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
/// 48-66% of a ResNet step as round trips (BENCHMARKS.md, "Throughput").
pub(super) fn on_cudnn_planned(
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
    pub(super) fn handle(&mut self, stream: dsys::CUstream) -> Result<sys::cudnnHandle_t, String> {
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

    /// The address of a workspace of at least `bytes` for a call queued on the
    /// handle's stream, or null for none. A larger request replaces the stream's
    /// buffer once the calls queued with it are done: a host wait, on the first
    /// step's few growths only.
    pub(super) fn workspace(&mut self, bytes: usize) -> Result<*mut c_void, String> {
        let Some((_, stream)) = self.handle else {
            return Ok(std::ptr::null_mut());
        };
        if bytes == 0 {
            return Ok(std::ptr::null_mut());
        }
        if let Some(ws) = self.workspaces.get(&stream).filter(|ws| ws.bytes >= bytes) {
            return Ok(ws.ptr as *mut c_void);
        }
        let cuda = |e: drv::DriverError| format!("cuDNN workspace of {bytes} bytes: CUDA {e:?}");
        if let Some(old) = self.workspaces.remove(&stream) {
            // SAFETY: the handle's stream, in this thread's current context; the old
            // buffer is freed once no queued call can still use it.
            unsafe {
                drv::stream::synchronize(stream).map_err(cuda)?;
                drv::free_sync(old.ptr).map_err(cuda)?;
            }
            count_workspace(self.ordinal, 0, old.bytes);
        }
        // SAFETY: the lane's context is current (`with_dnn`'s contract).
        let ptr = unsafe { drv::malloc_sync(bytes) }.map_err(cuda)?;
        self.workspaces.insert(stream, Workspace { ptr, bytes });
        count_workspace(self.ordinal, bytes, 0);
        Ok(ptr as *mut c_void)
    }

    /// The plan of the convolution `key` describes (the graph API's, else the legacy
    /// call's descriptors and algorithm), made on its first call.
    pub(super) fn conv(
        &mut self,
        key: &ConvKey,
        handle: sys::cudnnHandle_t,
    ) -> Result<Rc<Conv>, String> {
        if let Some(known) = self.convs.get(key) {
            return known.clone();
        }
        static NOTED: AtomicBool = AtomicBool::new(false);
        let note = |e: &String| {
            if !NOTED.swap(true, Ordering::Relaxed) {
                crate::say!(
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
        if let Ok(conv) = &made {
            crate::detail!(
                "cuDNN {:?} {:?} {:?} {:?}: workspace {:.1} MiB",
                key.part,
                key.data,
                key.dims,
                key.layout,
                conv.workspace() as f64 / (1 << 20) as f64
            );
        }
        self.convs.insert(key.clone(), made.clone());
        made
    }

    /// The descriptors of batch normalisation over the input `key` describes.
    pub(super) fn norm(
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
