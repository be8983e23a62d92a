//! [`UploadBackend`] on CUDA: with `data.pin_memory`, a batch is copied into a
//! page-locked host buffer and uploaded from there by kiln, on its own stream.
//!
//! cubecl 0.10's uploads (`ComputeClient::create`) copy every batch into a fresh heap
//! buffer on the calling thread, then its device thread copies that to the GPU from
//! pageable memory, launching nothing meanwhile: on an H200 a ResNet-50 batch (77 MB at
//! 224 px) spent 25 ms in the first copy and about 13 ms in the second, a third of the
//! step (BENCHMARKS.md). Here the batch is copied once into page-locked memory (on
//! several threads) and the copy engine reads it from there while the device thread
//! goes on, into a staging buffer on a stream of its own while the GPU runs the step
//! before (`staging`). Only the copy out of the staging buffer is queued as cuDNN's calls
//! are, on cubecl's stream where kiln knows it, else on kiln's, ordered against cubecl's
//! (`kiln_stream::on_kiln_stream`).
//!
//! The buffers are kept in a pool and reused (pinning a new buffer locks each of its
//! pages, slower than the copy). The driver hands a buffer back to the pool once the
//! copy out of it has run.

use std::ffi::c_void;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::cubecl::cuda::CudaRuntime;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::Runtime;
use cudarc::driver::{result as drv, sys as dsys};

use super::kiln_stream::{cuda, make_primary_current, on_kiln_stream};
use super::staging::upload_through;
use crate::ops::UploadBackend;
use crate::ops::upload::pageable_upload;

static PINNED: AtomicBool = AtomicBool::new(false);

/// Whether uploads of batches are staged in page-locked memory. Set once, before
/// training.
pub fn set_pinned(on: bool) {
    PINNED.store(on, Ordering::Relaxed);
}

/// One page-locked buffer of `size` bytes (`cuMemHostAlloc`, portable to every
/// context).
struct Buffer {
    ptr: *mut u8,
    size: usize,
}

// SAFETY: a plain host allocation, owned by whoever holds the `Buffer`.
unsafe impl Send for Buffer {}

/// Buffers not in use. A run uploads batches of one or two sizes, with a few in
/// flight at once, so the pool stays small.
static FREE: Mutex<Vec<Buffer>> = Mutex::new(Vec::new());

/// The pool keeps at most this many free buffers; more are given back to the driver.
const MAX_FREE: usize = 8;

/// The smallest free buffer of at least `size` bytes, or a new one. Needs the device's
/// context current on this thread for a new one.
fn take(size: usize) -> Result<Buffer, String> {
    let mut free = FREE.lock().unwrap_or_else(|e| e.into_inner());
    while free.len() > MAX_FREE {
        let b = free.swap_remove(0);
        // SAFETY: allocated by `take` with `cuMemHostAlloc`, and no longer in use.
        let _ = unsafe { drv::free_host(b.ptr as *mut c_void) };
    }
    let fit = free
        .iter()
        .enumerate()
        .filter(|(_, b)| b.size >= size)
        .min_by_key(|(_, b)| b.size)
        .map(|(i, _)| i);
    if let Some(i) = fit {
        return Ok(free.swap_remove(i));
    }
    drop(free);
    // Rounded up, so batches that differ a little (an epoch's last) share buffers.
    let size = size.next_multiple_of(1 << 20);
    // SAFETY: returns `size` bytes or an error.
    let ptr = unsafe { drv::malloc_host(size, dsys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(cuda)?;
    Ok(Buffer {
        ptr: ptr as *mut u8,
        size,
    })
}

fn give_back(buffer: Buffer) {
    FREE.lock().unwrap_or_else(|e| e.into_inner()).push(buffer);
}

/// A buffer on its way to a copy: back in the pool when dropped unless handed to the
/// copy's callback, so an upload that fails before its copy is queued (cubecl's device
/// thread or a buffer address unavailable) loses no page-locked memory.
struct Lent(Option<Buffer>);

impl Lent {
    fn ptr(&self) -> *const c_void {
        self.0
            .as_ref()
            .map_or(std::ptr::null(), |b| b.ptr as *const c_void)
    }

    /// The buffer, for the callback that returns it once the copy has run.
    fn hand_over(mut self) -> Buffer {
        self.0.take().expect("a lent buffer is handed over once")
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            give_back(b);
        }
    }
}

/// Run by the driver once the copy out of the buffer has run; no CUDA calls allowed.
unsafe extern "C" fn copied(buffer: *mut c_void) {
    // SAFETY: the box `upload` leaked for this callback, taken back once.
    give_back(*unsafe { Box::from_raw(buffer as *mut Buffer) });
}

/// Makes the device's primary context current on this thread, for `cuMemHostAlloc`;
/// once per thread and device.
fn make_current(ordinal: usize) -> Result<(), String> {
    thread_local! {
        static CURRENT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    }
    if CURRENT.get() != Some(ordinal) {
        make_primary_current(ordinal)?;
        CURRENT.set(Some(ordinal));
    }
    Ok(())
}

/// `values` on the device, through a pooled page-locked buffer.
fn upload(
    values: &[f32],
    device: &<CudaRuntime as Runtime>::Device,
) -> Result<CubeTensor<CudaRuntime>, String> {
    use rayon::prelude::*;
    let len = std::mem::size_of_val(values);
    make_current(device.index)?;
    let buffer = take(len)?;
    // SAFETY: the buffer holds at least `len` bytes and is this thread's alone.
    let dst = unsafe { std::slice::from_raw_parts_mut(buffer.ptr, len) };
    // SAFETY: f32 values viewed as their bytes.
    let src = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, len) };
    // In pieces on several threads: one thread's copy of a 77 MB batch is a good part
    // of a ResNet-50 step.
    const PIECE: usize = 4 << 20;
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(d, s)| d.copy_from_slice(s));
    let client = CudaRuntime::client(device);
    let out = client.empty(len);
    let buffer = Lent(Some(buffer));
    let ordinal = device.index;
    on_kiln_stream(&client, ordinal, &[Some(&out)], move |stream, p| {
        let from = buffer.ptr();
        upload_through(ordinal, stream, p[0] as u64, len, |copy_stream, staged| {
            // SAFETY: `staged` holds at least `len` bytes, and so does the buffer. On
            // failure nothing was queued and `buffer` goes back to the pool.
            unsafe { dsys::cuMemcpyHtoDAsync_v2(staged, from, len, copy_stream) }
                .result()
                .map_err(cuda)?;
            let boxed = Box::into_raw(Box::new(buffer.hand_over())) as *mut c_void;
            // SAFETY: `copied` takes the box back exactly once, after the copy.
            if let Err(e) = unsafe { drv::stream::launch_host_function(copy_stream, copied, boxed) }
            {
                // SAFETY: kiln's copy stream; once it is idle the copy is done, and
                // the callback was never queued.
                let _ = unsafe { drv::stream::synchronize(copy_stream) };
                give_back(*unsafe { Box::from_raw(boxed as *mut Buffer) });
                return Err(cuda(e));
            }
            Ok(())
        })
    })?;
    Ok(CubeTensor::new_contiguous(
        client,
        device.clone(),
        Shape::new([values.len()]),
        out,
        DType::F32,
    ))
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> UploadBackend
    for CubeBackend<CudaRuntime, F, I, BT>
{
    fn upload_f32(values: Vec<f32>, device: &Self::Device) -> FloatTensor<Self> {
        if PINNED.load(Ordering::Relaxed) {
            match upload(&values, device) {
                Ok(t) => return t,
                Err(e) => warn_unpinned(&e),
            }
        }
        pageable_upload::<Self>(values, device)
    }
}

fn warn_unpinned(why: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        crate::say!(
            "kiln: warning: a batch could not be uploaded from page-locked memory (data.pin_memory): {why}; it goes through cubecl's pageable upload instead"
        );
    }
}

/// On a GPU only (`--ignored`): a batch staged in page-locked memory arrives whole,
/// through autodiff and fusion, as Burn's own upload does.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::upload_f32;
    use burn::backend::Autodiff;
    use burn::backend::cuda::{Cuda, CudaDevice};

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn pinned_upload_arrives_whole_on_the_gpu() {
        let device = CudaDevice::new(0);
        // Larger than one pinned pool page of small uploads, and not a round size.
        let values: Vec<f32> = (0..3_000_017)
            .map(|i| (i % 9973) as f32 * 0.5 - 7.0)
            .collect();
        for pinned in [true, false] {
            set_pinned(pinned);
            let t = upload_f32::<Autodiff<Cuda>>(values.clone(), &device);
            let back = t.into_data().to_vec::<f32>().unwrap();
            assert!(
                back == values,
                "pinned {pinned}: values differ after the upload"
            );
        }
        set_pinned(false);
    }
}
