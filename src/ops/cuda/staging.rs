//! Uploads that overlap the step: a batch is copied from host memory into a device
//! buffer of kiln's on a copy stream of its own, and only a device-to-device copy out of
//! that buffer goes on the stream the step runs on.
//!
//! A host-to-device copy queued on the step's stream holds that stream for as long as
//! the bus takes: about 2 ms of a 27 ms ResNet-50 step for its 77 MB batch, during which
//! no kernel runs. Its destination comes from cubecl's pool, which reuses a buffer as
//! soon as the kernels queued before on the step's stream are done with it, so that
//! copy cannot simply move to another stream. The staging buffer can: it is kiln's own,
//! written on the copy stream while the GPU still runs earlier work, and read on the
//! step's stream (after an event says the copy has landed) at device bandwidth, about
//! 50 µs for the same batch. Two buffers per device take turns, so the next batch is
//! copied while the last one is read.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use cudarc::driver::{result as drv, sys as dsys};

use super::kiln_stream::cuda;

/// Staging buffers per device; two let one be filled while the other is read.
const SLOTS: usize = 2;

/// One device buffer and the events that order its two copies.
struct Slot {
    ptr: dsys::CUdeviceptr,
    bytes: usize,
    /// Recorded on the copy stream once a batch has landed in the buffer.
    arrived: dsys::CUevent,
    /// Recorded on the step's stream once the batch has been copied out of it.
    consumed: dsys::CUevent,
}

/// A device's copy stream and staging buffers, on the thread that queues its uploads
/// (cubecl's device thread).
struct Staging {
    copy_stream: dsys::CUstream,
    slots: Vec<Slot>,
    next: usize,
}

thread_local! {
    // Kept until the thread ends, then leaked, as kiln's streams are (`kiln_stream`).
    static STAGING: RefCell<HashMap<usize, Staging>> = RefCell::new(HashMap::new());
}

/// Bytes of staging buffers held per GPU (all threads), now and at most.
static STAGED_BYTES: Mutex<BTreeMap<usize, (u64, u64)>> = Mutex::new(BTreeMap::new());

fn count(ordinal: usize, added: usize, removed: usize) {
    let mut all = STAGED_BYTES.lock().unwrap_or_else(|e| e.into_inner());
    let (now, peak) = all.entry(ordinal).or_default();
    *now = (*now + added as u64).saturating_sub(removed as u64);
    *peak = (*peak).max(*now);
}

/// The most staging memory GPU `ordinal` has held at once, in bytes.
pub fn staging_peak(ordinal: usize) -> u64 {
    let all = STAGED_BYTES.lock().unwrap_or_else(|e| e.into_inner());
    all.get(&ordinal).map_or(0, |&(_, peak)| peak)
}

impl Staging {
    fn new() -> Result<Staging, String> {
        let copy_stream =
            drv::stream::create(drv::stream::StreamKind::NonBlocking).map_err(cuda)?;
        let event = || drv::event::create(dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let slots = (0..SLOTS)
            .map(|_| {
                Ok(Slot {
                    ptr: 0,
                    bytes: 0,
                    arrived: event().map_err(cuda)?,
                    consumed: event().map_err(cuda)?,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Staging {
            copy_stream,
            slots,
            next: 0,
        })
    }
}

impl Slot {
    /// Makes the buffer hold at least `len` bytes. A smaller one is freed once the
    /// step's stream has copied out of it (a host wait, once per larger batch size).
    fn fit(&mut self, ordinal: usize, len: usize) -> Result<(), String> {
        if self.bytes >= len {
            return Ok(());
        }
        if self.ptr != 0 {
            // SAFETY: an event of this slot; unrecorded, it returns at once.
            unsafe { drv::event::synchronize(self.consumed) }.map_err(cuda)?;
            // SAFETY: allocated below and, past the event, no longer read.
            unsafe { drv::free_sync(self.ptr) }.map_err(cuda)?;
            count(ordinal, 0, self.bytes);
            (self.ptr, self.bytes) = (0, 0);
        }
        // Rounded up, so batches that differ a little (an epoch's last) share it.
        let bytes = len.next_multiple_of(1 << 20);
        // SAFETY: returns `bytes` bytes of device memory or an error.
        self.ptr = unsafe { drv::malloc_sync(bytes) }.map_err(cuda)?;
        self.bytes = bytes;
        count(ordinal, bytes, 0);
        Ok(())
    }
}

/// Queues on `stream` (the step's) a copy of `len` bytes into `dst` through one of GPU
/// `ordinal`'s staging buffers, which `fill(copy_stream, buffer)` fills with
/// host-to-device copies queued on the copy stream. Needs the device's context current
/// (`kiln_stream::with_lane`). Nothing on `stream` waits for more than the batch's own
/// copy; the copy stream waits only for the buffer's previous batch to be read.
pub(super) fn upload_through(
    ordinal: usize,
    stream: dsys::CUstream,
    dst: dsys::CUdeviceptr,
    len: usize,
    fill: impl FnOnce(dsys::CUstream, dsys::CUdeviceptr) -> Result<(), String>,
) -> Result<(), String> {
    STAGING.with(|map| {
        let mut map = map.borrow_mut();
        let staging = match map.entry(ordinal) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(Staging::new()?),
        };
        let copy_stream = staging.copy_stream;
        let slot = &mut staging.slots[staging.next];
        staging.next = (staging.next + 1) % SLOTS;
        slot.fit(ordinal, len)?;
        // SAFETY: streams, events and the buffer are this device's and alive; the
        // buffer holds `len` bytes and `dst` does too (the caller's).
        unsafe {
            drv::stream::wait_event(
                copy_stream,
                slot.consumed,
                dsys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(cuda)?;
            fill(copy_stream, slot.ptr)?;
            drv::event::record(slot.arrived, copy_stream).map_err(cuda)?;
            drv::stream::wait_event(
                stream,
                slot.arrived,
                dsys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(cuda)?;
            drv::memcpy_dtod_async(dst, slot.ptr, len, stream).map_err(cuda)?;
            drv::event::record(slot.consumed, stream).map_err(cuda)?;
        }
        Ok(())
    })
}
