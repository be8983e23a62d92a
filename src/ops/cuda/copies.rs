//! Many device-to-device copies queued by one driver call (`cuMemcpyBatchAsync`, CUDA
//! 12.8 and later) where the driver has it, else one call per copy. Packing ResNet-50's
//! 161 gradients into buckets one call each cost about 0.75 ms per step on cubecl's
//! device thread, the thread that launches every kernel of the step.

use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys as dsys;

/// `CUmemcpyAttributes` in the ABI of CUDA 12.8, the version the driver is asked for.
#[repr(C)]
struct Attributes {
    src_access_order: u32,
    /// `CUmemLocation` hints (type, id), used only for managed memory: left empty.
    src_location: [u32; 2],
    dst_location: [u32; 2],
    flags: u32,
}

/// `CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`: the sources are read in stream order.
const SRC_ACCESS_ORDER_STREAM: u32 = 1;

type BatchCopy = unsafe extern "C" fn(
    dsts: *mut u64,
    srcs: *mut u64,
    sizes: *mut usize,
    count: usize,
    attrs: *mut Attributes,
    attrs_idxs: *mut usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    stream: dsys::CUstream,
) -> u32;

/// The driver's `cuMemcpyBatchAsync` as of CUDA 12.8, if it has one.
fn batch_copy() -> Option<BatchCopy> {
    static FOUND: OnceLock<Option<usize>> = OnceLock::new();
    let address = *FOUND.get_or_init(|| {
        let mut pfn: *mut c_void = std::ptr::null_mut();
        let mut status = dsys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS;
        // SAFETY: a NUL-terminated name and room for one pointer and one status; asking
        // for version 12080 returns the entry point with that version's signature.
        let r = unsafe {
            dsys::cuGetProcAddress_v2(
                c"cuMemcpyBatchAsync".as_ptr(),
                &mut pfn,
                12080,
                0,
                &mut status,
            )
        };
        let found = r == dsys::CUresult::CUDA_SUCCESS
            && status == dsys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS
            && !pfn.is_null();
        found.then_some(pfn as usize)
    });
    // SAFETY: the driver's entry point for the signature of CUDA 12.8 (`BatchCopy`).
    address.map(|a| unsafe { std::mem::transmute::<usize, BatchCopy>(a) })
}

/// Whether batched copies failed once in this process (then never tried again).
static BATCH_FAILED: AtomicBool = AtomicBool::new(false);

/// Queues, on `stream`, a copy of `sizes[i]` bytes from `srcs[i]` to `dsts[i]` for
/// each `i`.
///
/// # Safety
/// Every address is a live device buffer of at least its size, on the device of the
/// current context, as is `stream`; destinations do not overlap each other or any
/// source.
pub(super) unsafe fn copy_many(
    dsts: &[u64],
    srcs: &[u64],
    sizes: &[usize],
    stream: dsys::CUstream,
) -> Result<(), String> {
    assert!(dsts.len() == srcs.len() && srcs.len() == sizes.len());
    let batch = batch_copy().filter(|_| dsts.len() > 1 && !BATCH_FAILED.load(Ordering::Relaxed));
    if let Some(f) = batch {
        let mut attrs = Attributes {
            src_access_order: SRC_ACCESS_ORDER_STREAM,
            src_location: [0; 2],
            dst_location: [0; 2],
            flags: 0,
        };
        let mut first = 0usize;
        let mut failed_at = usize::MAX;
        // SAFETY: the arrays hold `len` entries each and are only read during the call;
        // one attribute applies to every copy from index 0; the caller vouches for the
        // buffers and the stream.
        let r = unsafe {
            f(
                dsts.as_ptr().cast_mut(),
                srcs.as_ptr().cast_mut(),
                sizes.as_ptr().cast_mut(),
                dsts.len(),
                &mut attrs,
                &mut first,
                1,
                &mut failed_at,
                stream,
            )
        };
        if r == 0 {
            return Ok(());
        }
        // Copies are idempotent: those queued before the failure are queued again below.
        if !BATCH_FAILED.swap(true, Ordering::Relaxed) {
            crate::say!(
                "kiln: note: cuMemcpyBatchAsync failed (CUDA error {r} at copy {failed_at}); buckets are packed one copy at a time"
            );
        }
    }
    for ((&dst, &src), &n) in dsts.iter().zip(srcs).zip(sizes) {
        // SAFETY: as the caller vouches.
        unsafe { dsys::cuMemcpyDtoDAsync_v2(dst, src, n, stream) }
            .result()
            .map_err(|e| format!("copying into the bucket: {e:?}"))?;
    }
    Ok(())
}
