//! [`CollectiveBackend`] on CUDA: NCCL's all-reduce and broadcast on cubecl's buffers,
//! queued on the very stream cubecl runs the device's kernels on (`kiln_stream`, as
//! cuDNN's calls are), so a bucket of gradients is summed in order with the backward
//! pass that made it and the optimizer step that reads it, and the host never waits.
//!
//! kiln's communicators are its own: cubecl-cuda makes NCCL communicators of its own
//! only for `to_device` between GPUs, which kiln never calls. NCCL is loaded at run
//! time; cudarc panics on the first call into a missing library, so every entry point
//! looks for it first. A collective runs where no error can be handed back (inside a
//! fusion operation, on cubecl's device thread): its failure is kept in the
//! communicator ([`DeviceComm::error`]) and the exchange reports it at its next check.

use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::CStr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use burn::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn::cubecl::server::Handle;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cudarc::nccl::{result as nccl, sys};

use super::copies::copy_many;
use super::kiln_stream::{
    After, Client, Lane, make_primary_current, on_device_thread, on_kiln_stream_as, queue_handle,
    queue_on_device_thread,
};
use crate::ops::{CollectiveBackend, Comm, DeviceComm, LibraryCall};

/// Why NCCL cannot be used here, or its version.
pub fn probe() -> Result<String, String> {
    static FOUND: OnceLock<Result<String, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            // SAFETY: loading the library runs no initialisation with preconditions.
            if !unsafe { sys::is_culib_present() } {
                return Err(
                    "libnccl.so was not found on the library path (NCCL's runtime package \
                     installs libnccl.so.2: put a libnccl.so link to it on LD_LIBRARY_PATH, \
                     or set parallel.exchange = \"host\")"
                        .into(),
                );
            }
            let v = nccl::get_nccl_version().map_err(|e| describe(e.0))?;
            Ok(format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100))
        })
        .clone()
}

/// NCCL's own words for `r`.
fn describe(r: sys::ncclResult_t) -> String {
    // SAFETY: NCCL returns a static string for every result code.
    let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(r)) };
    format!("{} ({r:?})", text.to_string_lossy())
}

/// One NCCL communicator: one device's membership of a group.
#[derive(Debug)]
pub struct NcclComm {
    comm: sys::ncclComm_t,
    rank: usize,
    size: usize,
    ordinal: usize,
    aborted: AtomicBool,
    error: Mutex<Option<String>>,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time: kiln issues
// its collectives from one thread per device (cubecl's device thread) and calls only
// `ncclCommAbort` from others, which NCCL allows.
unsafe impl Send for NcclComm {}
// SAFETY: as above; the mutable state is behind atomics and a mutex.
unsafe impl Sync for NcclComm {}

impl NcclComm {
    fn shared(comm: sys::ncclComm_t, rank: usize, size: usize, ordinal: usize) -> Comm {
        Arc::new(NcclComm {
            comm,
            rank,
            size,
            ordinal,
            aborted: AtomicBool::new(false),
            error: Mutex::new(None),
        })
    }

    fn fail(&self, what: &str, message: String) {
        let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
        e.get_or_insert_with(|| {
            format!(
                "NCCL {what} on GPU {} (rank {} of {}): {message}",
                self.ordinal, self.rank, self.size
            )
        });
    }

    /// The raw communicator, or `None` once aborted.
    fn live(&self) -> Option<sys::ncclComm_t> {
        (!self.aborted.load(Ordering::SeqCst)).then_some(self.comm)
    }

    /// A failure NCCL noticed in the background (a peer gone, a network error).
    fn async_error(&self) -> Option<String> {
        let comm = self.live()?;
        let mut r = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator; NCCL writes one result code.
        let status = unsafe { sys::ncclCommGetAsyncError(comm, &mut r) };
        match (status, r) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess)
            | (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => None,
            (sys::ncclResult_t::ncclSuccess, r) => Some(describe(r)),
            (s, _) => Some(describe(s)),
        }
    }
}

impl DeviceComm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: called once per communicator; NCCL allows it from any thread,
            // while collectives are in flight.
            let _ = unsafe { nccl::comm_abort(self.comm) };
            self.fail("collectives", "aborted".into());
        }
    }

    fn error(&self) -> Option<String> {
        if let Some(e) = self.async_error() {
            self.fail("communicator", e);
        }
        self.error.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One communicator per GPU of `ordinals`, made together (`ncclCommInitAll`).
pub fn communicators(ordinals: &[usize]) -> Result<Vec<Comm>, String> {
    probe()?;
    let n = ordinals.len();
    let list: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
    let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); n];
    // SAFETY: room for one communicator per device; NCCL sets the devices itself.
    unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n as i32, list.as_ptr()) }.map_err(|e| {
        format!(
            "NCCL could not make communicators for GPUs {ordinals:?}: {}",
            describe(e.0)
        )
    })?;
    Ok(comms
        .into_iter()
        .zip(ordinals)
        .enumerate()
        .map(|(rank, (c, &o))| NcclComm::shared(c, rank, n, o))
        .collect())
}

/// A fresh group id (`ncclGetUniqueId`), as bytes.
pub fn new_group_id() -> Result<Vec<u8>, String> {
    probe()?;
    let id = nccl::get_uniqueid().map_err(|e| format!("ncclGetUniqueId: {}", describe(e.0)))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// This process's communicator on GPU `ordinal` in the group `id` names.
pub fn join_group(ordinal: usize, id: &[u8], rank: usize, size: usize) -> Result<Comm, String> {
    probe()?;
    let mut unique = sys::ncclUniqueId { internal: [0; 128] };
    if id.len() != unique.internal.len() {
        return Err(format!(
            "an NCCL group id has {} bytes, not {}",
            unique.internal.len(),
            id.len()
        ));
    }
    for (d, s) in unique.internal.iter_mut().zip(id) {
        *d = *s as std::ffi::c_char;
    }
    // NCCL takes the device from the calling thread's current context.
    make_primary_current(ordinal)?;
    let mut comm = std::ptr::null_mut();
    // SAFETY: room for one communicator; the id is the one rank 0 made.
    unsafe { nccl::comm_init_rank(&mut comm, size as i32, unique, rank as i32) }.map_err(|e| {
        format!(
            "NCCL could not join rank {rank} of {size} on GPU {ordinal}: {}",
            describe(e.0)
        )
    })?;
    Ok(NcclComm::shared(comm, rank, size, ordinal))
}

fn nccl_comm(comm: &Comm) -> &NcclComm {
    comm.as_any()
        .downcast_ref::<NcclComm>()
        .expect("CUDA tensors are exchanged through NCCL communicators")
}

fn data_type(dtype: DType) -> Option<sys::ncclDataType_t> {
    match dtype {
        DType::F32 => Some(sys::ncclDataType_t::ncclFloat32),
        DType::BF16 => Some(sys::ncclDataType_t::ncclBfloat16),
        DType::F16 => Some(sys::ncclDataType_t::ncclFloat16),
        _ => None,
    }
}

/// What a collective does with its buffers.
#[derive(Debug, Clone, Copy)]
enum Collective {
    AllReduce,
    Broadcast(usize),
}

/// Runs `what` on `x` into a new buffer of its shape, queued on cubecl's stream for
/// `x`'s device. On failure the output holds nothing useful and `comm.error()` says why.
/// A round trip to the device thread, not queued: these run at the start and for the
/// BatchNorm statistics before a checkpoint or an evaluation, and the exchange's check
/// right after must see the failure of every collective queued before them.
fn collective(
    x: CubeTensor<CudaRuntime>,
    comm: &Comm,
    what: Collective,
) -> CubeTensor<CudaRuntime> {
    let c = nccl_comm(comm);
    let x = into_contiguous(x);
    let count = x.meta.shape().num_elements();
    let dtype = x.dtype;
    let client = x.client.clone();
    let out = client.empty(count * dtype.size());
    let name = match what {
        Collective::AllReduce => "all-reduce",
        Collective::Broadcast(_) => "broadcast",
    };
    let queued = match (data_type(dtype), c.live()) {
        (None, _) => Err(format!("no NCCL type for {dtype:?}")),
        (_, None) => Err("the communicator was aborted".into()),
        (Some(t), Some(_)) => on_kiln_stream_as(
            &client,
            x.device.index,
            &[Some(&x.handle), Some(&out)],
            LibraryCall::Collective,
            move |stream, p| {
                let stream = stream as sys::cudaStream_t;
                let raw = c.comm;
                // SAFETY: `p[0]` and `p[1]` are live device buffers of `count`
                // elements of `t` on this communicator's device, ordered on `stream`.
                let r = unsafe {
                    match what {
                        Collective::AllReduce => nccl::all_reduce(
                            p[0],
                            p[1],
                            count,
                            t,
                            sys::ncclRedOp_t::ncclSum,
                            raw,
                            stream,
                        ),
                        Collective::Broadcast(root) => {
                            nccl::broadcast(p[0], p[1], count, t, root as i32, raw, stream)
                        }
                    }
                };
                r.map(|_| ()).map_err(|e| describe(e.0))
            },
        ),
    };
    if let Err(e) = queued {
        c.fail(name, e);
    }
    CubeTensor::new_contiguous(client, x.device.clone(), Shape::new([count]), out, dtype)
}

/// Sums `xs` over `comm` through one buffer: each input copied (device to device) to
/// its own aligned place in it, one all-reduce in place, and the results returned as
/// views of the buffer with the inputs' shapes. One collective and no tensor operation
/// per gradient: a ResNet step's 60-160 gradients cost a handful of copies queued by
/// one host call, not hundreds of operations. Queued without waiting after the
/// thread's first ([`submit`]).
fn all_reduce_many(xs: Vec<CubeTensor<CudaRuntime>>, comm: &Comm) -> Vec<CubeTensor<CudaRuntime>> {
    let c = nccl_comm(comm);
    let xs: Vec<CubeTensor<CudaRuntime>> = xs.into_iter().map(into_contiguous).collect();
    let Some(first) = xs.first() else {
        return Vec::new();
    };
    let (client, device, dtype) = (first.client.clone(), first.device.clone(), first.dtype);
    let align = client.properties().memory.alignment as usize;
    let sizes: Vec<usize> = xs
        .iter()
        .map(|x| x.meta.shape().num_elements() * dtype.size())
        .collect();
    let mut offsets = Vec::with_capacity(sizes.len());
    let mut total = 0usize;
    for &n in &sizes {
        offsets.push(total);
        total += n.next_multiple_of(align);
    }
    let bucket = client.empty(total);
    let queued = match (
        data_type(dtype),
        c.live(),
        xs.iter().all(|x| x.dtype == dtype),
    ) {
        (_, _, false) => Err("the tensors of one bucket differ in dtype".to_string()),
        (None, _, _) => Err(format!("no NCCL type for {dtype:?}")),
        (_, None, _) => Err("the communicator was aborted".into()),
        (Some(t), Some(_), true) => {
            let job = {
                let (client, comm, bucket) = (client.clone(), comm.clone(), bucket.clone());
                let inputs: Vec<_> = xs.iter().map(|x| x.handle.clone()).collect();
                let (offsets, sizes) = (offsets.clone(), sizes.clone());
                move |lane: &mut Lane| {
                    let buffers: Vec<Option<&Handle>> = std::iter::once(Some(&bucket))
                        .chain(inputs.iter().map(Some))
                        .collect();
                    let raw = nccl_comm(&comm).comm;
                    lane.queue(
                        &client,
                        &buffers,
                        After::Gpu,
                        LibraryCall::Collective,
                        |stream, p| {
                            let dsts: Vec<u64> = offsets
                                .iter()
                                .map(|&off| p[0] as u64 + off as u64)
                                .collect();
                            let srcs: Vec<u64> = p[1..].iter().map(|&s| s as u64).collect();
                            // SAFETY: `p[0]` holds `total` bytes, of which `off..off + n`
                            // is each input's own place; each source holds its `n` bytes;
                            // all on this device, ordered on `stream`.
                            unsafe { copy_many(&dsts, &srcs, &sizes, stream) }?;
                            let count = total / dtype.size();
                            // SAFETY: in place on `p[0]`, `count` elements of `t` (the
                            // padding between places is summed too and never read).
                            unsafe {
                                nccl::all_reduce(
                                    p[0],
                                    p[0],
                                    count,
                                    t,
                                    sys::ncclRedOp_t::ncclSum,
                                    raw,
                                    stream as sys::cudaStream_t,
                                )
                            }
                            .map(|_| ())
                            .map_err(|e| describe(e.0))
                        },
                    )
                }
            };
            submit(&client, &device, comm, "all-reduce", job)
        }
    };
    if let Err(e) = queued {
        c.fail("all-reduce", e);
    }
    xs.iter()
        .zip(offsets.iter().zip(&sizes))
        .map(|(x, (&off, &n))| {
            let view = bucket
                .clone()
                .offset_start(off as u64)
                .offset_end((total - off - n) as u64);
            CubeTensor::new_contiguous(
                client.clone(),
                device.clone(),
                x.meta.shape().clone(),
                view,
                dtype,
            )
        })
        .collect()
}

thread_local! {
    // Per calling (fusion) thread: the GPUs whose collectives it queues without waiting.
    static QUEUEING: RefCell<HashSet<usize>> = RefCell::new(HashSet::new());
}

/// Runs `job` on cubecl's device thread for `device`: the calling thread's first time
/// as a round trip that reports its error, after that queued without waiting
/// (`kiln_stream::queue_on_device_thread`), as cuDNN's calls are. A round trip per
/// bucket made the fusion thread wait for the device thread's whole queue each time:
/// 3 (ResNet-18) to 6 (ResNet-50) waits of about 0.5 ms per step. A queued job's
/// failure is kept in the communicator, where the exchange's next check (every step,
/// and the round trips of the BatchNorm statistics before a checkpoint or an
/// evaluation) finds it.
fn submit(
    client: &Client,
    device: &CudaDevice,
    comm: &Comm,
    what: &'static str,
    job: impl FnOnce(&mut Lane) -> Result<(), String> + Send + 'static,
) -> Result<(), String> {
    let ordinal = device.index;
    if QUEUEING.with(|q| q.borrow().contains(&ordinal)) {
        let comm = comm.clone();
        queue_on_device_thread(device, ordinal, move |lane| {
            if let Err(e) = job(lane) {
                nccl_comm(&comm).fail(what, e);
            }
            Ok(())
        });
        return Ok(());
    }
    on_device_thread(client, ordinal, job)?;
    queue_handle(device);
    QUEUEING.with(|q| q.borrow_mut().insert(ordinal));
    Ok(())
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> CollectiveBackend
    for CubeBackend<CudaRuntime, F, I, BT>
{
    fn device_collectives() -> Option<Result<String, String>> {
        Some(probe().map(|v| format!("NCCL {v}")))
    }

    fn communicators(devices: &[CudaDevice]) -> Result<Vec<Comm>, String> {
        communicators(&devices.iter().map(|d| d.index).collect::<Vec<_>>())
    }

    fn new_group_id() -> Result<Vec<u8>, String> {
        new_group_id()
    }

    fn join_group(
        device: &CudaDevice,
        id: &[u8],
        rank: usize,
        size: usize,
    ) -> Result<Comm, String> {
        join_group(device.index, id, rank, size)
    }

    fn all_reduce_sum(x: FloatTensor<Self>, comm: &Comm) -> FloatTensor<Self> {
        let shape = x.meta.shape().clone();
        reshaped(collective(x, comm, Collective::AllReduce), shape)
    }

    fn broadcast(x: FloatTensor<Self>, comm: &Comm, root: usize) -> FloatTensor<Self> {
        let shape = x.meta.shape().clone();
        reshaped(collective(x, comm, Collective::Broadcast(root)), shape)
    }

    fn all_reduce_many(xs: Vec<FloatTensor<Self>>, comm: &Comm) -> Vec<FloatTensor<Self>> {
        all_reduce_many(xs, comm)
    }
}

/// A contiguous buffer seen with `shape` (same number of elements).
fn reshaped<R: CubeRuntime>(t: CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    CubeTensor::new_contiguous(t.client, t.device, shape, t.handle, t.dtype)
}

/// On a GPU only (`--ignored`): NCCL on kiln's buffers, in a group of one (the path a
/// run on several GPUs takes, on the one GPU a test machine has).
#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::cuda::Cuda;
    use burn::tensor::{Tensor, TensorData, TensorPrimitive};

    #[test]
    #[ignore = "needs a CUDA GPU and NCCL"]
    fn a_group_of_one_all_reduces_and_broadcasts_kilns_buffers() {
        let dev = CudaDevice::new(0);
        let comms = <Cuda as CollectiveBackend>::communicators(std::slice::from_ref(&dev))
            .expect("NCCL makes a communicator for GPU 0");
        assert_eq!((comms[0].rank(), comms[0].size()), (0, 1));
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
        for dtype in [DType::F32, DType::BF16] {
            let x = Tensor::<Cuda, 1>::from_data(TensorData::new(values.clone(), [1000]), &dev)
                .cast(dtype);
            let expected = x
                .clone()
                .cast(DType::F32)
                .into_data()
                .to_vec::<f32>()
                .unwrap();
            let sum = <Cuda as CollectiveBackend>::all_reduce_sum(
                x.clone().into_primitive().tensor(),
                &comms[0],
            );
            let b =
                <Cuda as CollectiveBackend>::broadcast(x.into_primitive().tensor(), &comms[0], 0);
            <Cuda as CollectiveBackend>::flush(&dev);
            for t in [sum, b] {
                let t = Tensor::<Cuda, 1>::from_primitive(TensorPrimitive::Float(t));
                assert_eq!(t.dtype(), dtype);
                let got = t.cast(DType::F32).into_data().to_vec::<f32>().unwrap();
                assert_eq!(got, expected, "{dtype:?}");
            }
            assert_eq!(comms[0].error(), None);
        }
        // Many tensors of several shapes through one bucket: each comes back whole.
        let shapes: [&[usize]; 3] = [&[5], &[3, 7], &[2, 3, 3, 4]];
        let xs: Vec<Tensor<Cuda, 1>> = shapes
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let n: usize = s.iter().product();
                let v: Vec<f32> = (0..n).map(|i| (k * 1000 + i) as f32).collect();
                Tensor::<Cuda, 1>::from_data(TensorData::new(v, [n]), &dev)
            })
            .collect();
        let expected: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| x.clone().into_data().to_vec::<f32>().unwrap())
            .collect();
        let prims = xs
            .into_iter()
            .map(|x| x.into_primitive().tensor())
            .collect();
        let outs = <Cuda as CollectiveBackend>::all_reduce_many(prims, &comms[0]);
        <Cuda as CollectiveBackend>::flush(&dev);
        assert_eq!(outs.len(), 3);
        for (out, e) in outs.into_iter().zip(expected) {
            let t = Tensor::<Cuda, 1>::from_primitive(TensorPrimitive::Float(out));
            assert_eq!(t.into_data().to_vec::<f32>().unwrap(), e);
        }
        assert_eq!(comms[0].error(), None);
        comms[0].abort();
        assert!(comms[0].error().unwrap().contains("aborted"));
    }
}
