//! kiln's GPU work queued in order with cubecl's: cuDNN's calls (`ops::cudnn`) and the
//! page-locked upload (`ops::pinned`).
//!
//! The work goes on cubecl's own stream where kiln has learnt which it is
//! (`cubecl_stream`, through CUPTI), which orders it by construction. Otherwise it goes
//! on a stream of kiln's per thread and device, ordered against the thread's cubecl
//! stream on the GPU (`stream_order`), or, where that cannot be set up either, by the
//! host waiting for both. A call runs whole on cubecl's device thread
//! (`ComputeClient::exclusive`): the device addresses of its buffers are known only
//! there, and each question asked from the fusion thread that queues the call is a
//! blocking round trip that waits for that thread's queue to drain.

use std::cell::RefCell;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use burn::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn::cubecl::future::block_on;
use burn::cubecl::server::Handle;
use cubecl::device::{Device, DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl::device_handle::DeviceHandle;
use cudarc::driver::{result as drv, sys as dsys};

use super::cubecl_stream;
use super::stream_order::Handover;
use crate::ops::{KilnWaits, LibraryCall};

pub(crate) type Client = burn::cubecl::client::ComputeClient<CudaRuntime>;

/// Where kiln's work goes on one device for one thread. Training calls run on cubecl's
/// device thread, so each device has one; `cudnn::probe` makes its own on the caller's.
pub(crate) struct Lane {
    /// kiln's own stream, for work cubecl's stream cannot take (see [`Lane::target`]).
    stream: dsys::CUstream,
    context: dsys::CUcontext,
    /// cubecl's stream for each `StreamId` that queued work here, learnt on its first
    /// call (`cubecl_stream`).
    cubecl: HashMap<u64, dsys::CUstream>,
    /// Made on the first call; `Err` where it could not be (its kernels did not compile
    /// or load), which sends this thread's calls through host synchronisations.
    handover: Option<Result<Handover, ()>>,
}

thread_local! {
    // Kept until the thread ends, then leaked: a replica thread ends with its training,
    // and destroying a stream after its context may be gone is worse than one stream
    // per device and training.
    static LANES: RefCell<HashMap<usize, Lane>> = RefCell::new(HashMap::new());
}

/// `f` with this thread's lane for GPU `ordinal` (made on first use), the device's
/// primary context current.
pub(crate) fn with_lane<T>(
    ordinal: usize,
    f: impl FnOnce(&mut Lane) -> Result<T, String>,
) -> Result<T, String> {
    LANES.with(|map| {
        let mut map = map.borrow_mut();
        let lane = match map.entry(ordinal) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(Lane::new(ordinal)?),
        };
        // SAFETY: the context was retained by `Lane::new` and is never released.
        unsafe { drv::ctx::set_current(lane.context) }.map_err(cuda)?;
        f(lane)
    })
}

pub(crate) fn cuda(e: drv::DriverError) -> String {
    format!("CUDA: {:?}", e.0)
}

/// GPU `ordinal`'s primary context, the one cubecl works in, made current on this
/// thread. Retained again on every call (which only raises its reference count) and
/// never released.
pub(crate) fn make_primary_current(ordinal: usize) -> Result<dsys::CUcontext, String> {
    drv::init().map_err(cuda)?;
    let device = drv::device::get(ordinal as i32).map_err(cuda)?;
    // SAFETY: retaining the primary context only raises its reference count; a context
    // just retained can be made current.
    unsafe {
        let context = drv::primary_ctx::retain(device).map_err(cuda)?;
        drv::ctx::set_current(context).map_err(cuda)?;
        Ok(context)
    }
}

/// Runs `work` on cubecl's device thread for `client`, with that thread's lane for GPU
/// `ordinal`, and waits for it: one round trip from the calling (fusion) thread. On the
/// device thread cubecl's own calls (buffer addresses, allocations, launches) run at
/// once instead of each waiting for the thread's queue.
pub(crate) fn on_device_thread<T: Send + 'static>(
    client: &Client,
    ordinal: usize,
    work: impl FnOnce(&mut Lane) -> Result<T, String> + Send,
) -> Result<T, String> {
    let start = Instant::now();
    let result = client
        .exclusive(|| {
            let started = Instant::now();
            let done = with_lane(ordinal, work);
            ON_DEVICE_THREAD.add(started);
            done
        })
        .map_err(|e| format!("cubecl's device thread: {e:?}"));
    ROUND_TRIPS.add(start);
    result?
}

/// Queues `work` on cubecl's device thread for `device` (GPU `ordinal`), with that
/// thread's lane, behind everything the calling thread queued there before, and returns
/// at once: unlike [`on_device_thread`] the calling (fusion) thread does not wait for
/// the device thread to work through its queue, so the two threads' work overlaps.
///
/// The vehicle is a [`DeviceService`] of kiln's own on the same runner thread as
/// cubecl's server (both `Downstream`): its tasks share the server's queue, in order,
/// and run outside the server's borrow, so cubecl's calls inside run at once, as in
/// [`on_device_thread`]. `work` can no longer report an error to its caller: a failure
/// of work already accepted once (see the callers) means the step's results are
/// garbage, so the process says why and aborts, and the supervisor restarts it from its
/// checkpoint.
pub(crate) fn queue_on_device_thread(
    device: &CudaDevice,
    ordinal: usize,
    work: impl FnOnce(&mut Lane) -> Result<(), String> + Send + 'static,
) {
    queue_handle(device).submit(move |_: &mut Queued| {
        let started = Instant::now();
        // cubecl catches a task's panic and only logs it, which would leave the
        // outputs unwritten and training going on.
        let done = catch_unwind(AssertUnwindSafe(|| with_lane(ordinal, work)))
            .unwrap_or_else(|_| Err("it panicked".into()));
        ON_DEVICE_THREAD.add(started);
        QUEUED.add(started);
        if let Err(e) = done {
            crate::say!(
                "kiln: error: queued GPU work failed on GPU {ordinal} ({e}); this step's results are not valid, stopping"
            );
            std::process::abort();
        }
    });
}

/// The calling thread's handle to [`Queued`] on `device`'s device thread. Making the
/// first one registers the service there: a round trip, under a lock of cubecl's that
/// every thread making a device handle takes, so callers make it while they wait
/// anyway (see `cudnn::on_cudnn_planned`).
pub(crate) fn queue_handle(device: &CudaDevice) -> DeviceHandle<Queued> {
    QUEUES.with(|queues| {
        queues
            .borrow_mut()
            .entry(device.index)
            .or_insert_with(|| DeviceHandle::<Queued>::new(device.to_id()))
            .clone()
    })
}

/// kiln's service on cubecl's device thread: no state, only the queue.
pub(crate) struct Queued;

impl DeviceService for Queued {
    fn init(_: DeviceId) -> Self {
        Queued
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        Arc::new(())
    }
}

thread_local! {
    // One handle per calling thread and device: making one is a round trip under a
    // global lock.
    static QUEUES: RefCell<HashMap<usize, DeviceHandle<Queued>>> = RefCell::new(HashMap::new());
}

/// How many spans of one kind there were and how long they took, in nanoseconds.
struct TimeCounter {
    count: AtomicU64,
    nanos: AtomicU64,
}

impl TimeCounter {
    const fn new() -> Self {
        TimeCounter {
            count: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
        }
    }

    fn add(&self, start: Instant) {
        let nanos = start.elapsed().as_nanos() as u64;
        self.count.fetch_add(1, Ordering::Relaxed);
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    fn read(&self) -> (u64, f64) {
        let nanos = self.nanos.load(Ordering::Relaxed);
        (self.count.load(Ordering::Relaxed), nanos as f64 * 1e-9)
    }
}

/// [`on_device_thread`] whole, as the calling thread waits for it.
static ROUND_TRIPS: TimeCounter = TimeCounter::new();
/// Of the round trips, the part spent in kiln's work once the device thread reached it.
static ON_DEVICE_THREAD: TimeCounter = TimeCounter::new();
/// The host waiting for a stream inside [`Lane::queue`].
static HOST_SYNCS: TimeCounter = TimeCounter::new();
/// Work queued by [`queue_on_device_thread`], as the device thread ran it.
static QUEUED: TimeCounter = TimeCounter::new();
/// Of the work on the device thread, the library calls themselves inside
/// [`Lane::queue`], by kind.
static LIBRARY_CALLS: [TimeCounter; LibraryCall::ALL.len()] =
    [const { TimeCounter::new() }; LibraryCall::ALL.len()];
/// Of the work on the device thread, the hand-over's launches (`stream_order`) before
/// and after each call, counted twice per call.
static ORDERING: TimeCounter = TimeCounter::new();

/// Every thread's round trips and host waits so far (`ops::kiln_waits`).
pub(crate) fn kiln_waits() -> KilnWaits {
    let (round_trips, round_trip_s) = ROUND_TRIPS.read();
    let (_, on_device_thread_s) = ON_DEVICE_THREAD.read();
    let (host_syncs, host_sync_s) = HOST_SYNCS.read();
    let (queued, _) = QUEUED.read();
    let library_call_s = LIBRARY_CALLS.each_ref().map(|c| c.read().1);
    let (_, ordering_s) = ORDERING.read();
    KilnWaits {
        library_call_s,
        ordering_s,
        queued,
        round_trips,
        round_trip_s,
        on_device_thread_s,
        host_syncs,
        host_sync_s,
    }
}

/// Queues `call` for GPU `ordinal` with the device addresses of `buffers`, in order
/// with `client`'s cubecl stream ([`Lane::queue`]): kiln's work that is not cuDNN's,
/// the pinned upload (`ops::pinned`).
pub(crate) fn on_kiln_stream(
    client: &Client,
    ordinal: usize,
    buffers: &[Option<&Handle>],
    call: impl FnOnce(dsys::CUstream, &[*mut c_void]) -> Result<(), String> + Send,
) -> Result<(), String> {
    on_kiln_stream_as(client, ordinal, buffers, LibraryCall::Upload, call)
}

/// [`on_kiln_stream`] for a call of another `kind` (how the bench counts it).
pub(crate) fn on_kiln_stream_as(
    client: &Client,
    ordinal: usize,
    buffers: &[Option<&Handle>],
    kind: LibraryCall,
    call: impl FnOnce(dsys::CUstream, &[*mut c_void]) -> Result<(), String> + Send,
) -> Result<(), String> {
    on_device_thread(client, ordinal, |lane| {
        lane.queue(client, buffers, After::Gpu, kind, call)
    })
}

/// How cubecl's stream waits for the work [`Lane::queue`] puts on kiln's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    /// On the GPU, behind a spinning kernel (`stream_order`).
    Gpu,
    /// The host waits for kiln's stream: for kernels that need every SM at once.
    Host,
}

impl Lane {
    fn new(ordinal: usize) -> Result<Self, String> {
        let context = make_primary_current(ordinal)?;
        let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking).map_err(cuda)?;
        Ok(Lane {
            stream,
            context,
            cubecl: HashMap::new(),
            handover: None,
        })
    }

    /// kiln's own stream on this lane's device.
    pub(crate) fn stream(&self) -> dsys::CUstream {
        self.stream
    }

    /// The stream this lane's next call goes on for the current `StreamId` on
    /// `client`: cubecl's own where it can be learnt (once per `StreamId`; when it
    /// cannot, never again in this process, with one note), else kiln's.
    pub(crate) fn target(&mut self, client: &Client) -> dsys::CUstream {
        self.cubecl_stream(client).unwrap_or(self.stream)
    }

    fn cubecl_stream(&mut self, client: &Client) -> Option<dsys::CUstream> {
        static UNKNOWN: AtomicBool = AtomicBool::new(false);
        let id = cubecl::stream_id::StreamId::current().value;
        if let Some(s) = self.cubecl.get(&id) {
            return Some(*s);
        }
        if UNKNOWN.load(Ordering::Relaxed) {
            return None;
        }
        match cubecl_stream::find(client) {
            Ok(s) => {
                self.cubecl.insert(id, s);
                Some(s)
            }
            Err(e) => {
                if !UNKNOWN.swap(true, Ordering::Relaxed) {
                    crate::say!(
                        "kiln: note: cubecl's CUDA stream could not be learnt ({e}); cuDNN's calls and page-locked uploads go on a stream of kiln's, handed over with extra kernels (slower)"
                    );
                }
                None
            }
        }
    }

    /// This thread's hand-over flags, or `None` where they cannot be used.
    fn handover(&mut self, client: &Client) -> Option<&mut Handover> {
        let h = self
            .handover
            .get_or_insert_with(|| Handover::new(client).map_err(|e| warn_host_sync(&e)));
        h.as_mut().ok()
    }

    /// Queues `call` with the device addresses of `buffers` (null for `None`) after
    /// the cubecl work queued so far on `client`'s stream and before any queued after:
    /// on that stream itself where [`Lane::target`] knows it, else on this lane's
    /// stream, ordered on the GPU (`stream_order`; the host waits instead with
    /// [`After::Host`] and where that cannot be set up). Runs on cubecl's device thread
    /// ([`on_device_thread`]), which both rely on. The buffers stay allocated while
    /// their resources are held.
    pub(crate) fn queue(
        &mut self,
        client: &Client,
        buffers: &[Option<&Handle>],
        after: After,
        kind: LibraryCall,
        call: impl FnOnce(dsys::CUstream, &[*mut c_void]) -> Result<(), String>,
    ) -> Result<(), String> {
        let stream = self.stream;
        // Resolved first: cubecl queues its waits for buffers written on another of its
        // streams as it resolves them, and the token below then comes after those too.
        let resources = buffers
            .iter()
            .map(|b| {
                b.map(|h| client.get_resource(h.clone()).map_err(|e| format!("{e:?}")))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let pointers: Vec<*mut c_void> = resources
            .iter()
            .map(|r| {
                r.as_ref()
                    .map_or(std::ptr::null_mut(), |r| r.resource().ptr as *mut c_void)
            })
            .collect();
        if let Some(cubecl) = self.cubecl_stream(client) {
            let called = Instant::now();
            let result = call(cubecl, &pointers);
            LIBRARY_CALLS[kind as usize].add(called);
            return result;
        }
        let ordering = Instant::now();
        let token = self.handover(client).and_then(|h| {
            h.wait_for_cubecl(client, stream)
                .inspect_err(|e| warn_host_sync(e))
                .ok()
        });
        ORDERING.add(ordering);
        if token.is_none() {
            // The inputs are complete once this thread's cubecl stream is.
            let start = Instant::now();
            let synced = block_on(client.sync()).map_err(|e| format!("{e:?}"));
            HOST_SYNCS.add(start);
            synced?;
        }
        let called = Instant::now();
        let result = call(stream, &pointers);
        LIBRARY_CALLS[kind as usize].add(called);
        let ordering = Instant::now();
        // Even when the call reported an error: work it queued may still use the
        // buffers, which cubecl may hand out again once this returns.
        let ordered = match (token, self.handover(client)) {
            (Some(t), Some(h)) if after == After::Gpu => h
                .cubecl_waits_for(client, stream, t)
                .inspect_err(|e| warn_host_sync(e))
                .is_ok(),
            _ => false,
        };
        ORDERING.add(ordering);
        let waited = if ordered {
            Ok(())
        } else {
            let start = Instant::now();
            // SAFETY: this lane's stream, created by `Lane::new` and never destroyed.
            let synced = unsafe { drv::stream::synchronize(stream) };
            HOST_SYNCS.add(start);
            synced.map_err(|e| format!("CUDA {e:?}"))
        };
        result.and(waited)
    }
}

fn warn_host_sync(e: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        crate::say!(
            "kiln: warning: kiln's CUDA stream cannot be ordered on the GPU ({e}); every cuDNN call and page-locked upload waits on the host instead (slower)"
        );
    }
}
