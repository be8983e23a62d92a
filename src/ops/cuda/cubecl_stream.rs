//! The CUDA stream cubecl launches a thread's work on, learnt through CUPTI, so that
//! kiln's own GPU work (cuDNN's calls, the page-locked upload) is queued on that very
//! stream: in order with cubecl's kernels by construction, with nothing handed over
//! between two streams.
//!
//! cubecl 0.10 keeps its streams in private fields, and the CUDA driver has no call
//! that lists a context's streams. Its tools interface, CUPTI, does show a subscriber
//! every driver call with its arguments. So, once per cubecl stream and device, kiln
//! subscribes, launches one one-thread cubecl kernel on cubecl's device thread, reads
//! the `hStream` of that `cuLaunchKernel` and unsubscribes: one launch observed,
//! nothing after. cubecl maps a `StreamId` to one stream of a fixed pool, made on first
//! use and never destroyed, so the answer holds for the life of the process.
//!
//! Where this cannot be done (no libcupti on the library path; another tool already
//! subscribed, as Nsight Compute does, since CUPTI takes one subscriber) kiln's work
//! goes on a stream of its own, ordered against cubecl's by `stream_order`'s hand-over
//! kernels, four extra launches per call (about 9-17% slower on an H200).

use std::cell::Cell;
use std::ffi::c_void;
use std::sync::Mutex;

use burn::cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cudarc::cupti::sys as cupti;
use cudarc::driver::sys as dsys;

use super::kiln_stream::Client;

#[cube(launch)]
fn mark(out: &mut Array<u32>) {
    out[0] = 1;
}

thread_local! {
    /// `None` outside [`find`]; inside, armed (`Some(None)`) until the first kernel
    /// launch this thread makes (`Some(Some(stream))`). The callback runs on the thread
    /// that calls the driver, so other threads' launches never touch it.
    static SEEN: Cell<Option<Option<dsys::CUstream>>> = const { Cell::new(None) };
}

/// CUPTI takes one subscriber per process: device threads learn their streams in turn.
static SUBSCRIBING: Mutex<()> = Mutex::new(());

const LAUNCH: u32 =
    cupti::CUpti_driver_api_trace_cbid::CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel as u32;

/// CUPTI's callback for every driver call enabled in [`find`] (only `cuLaunchKernel`).
unsafe extern "C" fn on_driver_call(
    _: *mut c_void,
    domain: cupti::CUpti_CallbackDomain,
    cbid: cupti::CUpti_CallbackId,
    data: *const c_void,
) {
    if domain != cupti::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API
        || cbid != LAUNCH
        || data.is_null()
    {
        return;
    }
    SEEN.with(|seen| {
        if seen.get() != Some(None) {
            return;
        }
        // SAFETY: for the driver domain CUPTI passes a `CUpti_CallbackData`, whose
        // parameters for `cuLaunchKernel` are its `cuLaunchKernel_params`.
        let stream = unsafe {
            let data = &*(data as *const cupti::CUpti_CallbackData);
            if data.callbackSite != cupti::CUpti_ApiCallbackSite::CUPTI_API_ENTER
                || data.functionParams.is_null()
            {
                return;
            }
            (*(data.functionParams as *const cupti::cuLaunchKernel_params)).hStream
        };
        seen.set(Some(Some(stream)));
    });
}

/// The stream cubecl launches on for the current `StreamId` on `client`'s device, or
/// why it cannot be learnt. Must run on cubecl's device thread (`kiln_stream`), where
/// a launch reaches the driver before `launch` returns.
pub(crate) fn find(client: &Client) -> Result<dsys::CUstream, String> {
    // SAFETY: loading libcupti runs no initialisation with preconditions; cudarc panics
    // on its first call when the library is missing, so look first.
    if !unsafe { cupti::is_culib_present() } {
        return Err("libcupti (CUDA's CUPTI) was not found on the library path".into());
    }
    let _one = SUBSCRIBING.lock().unwrap_or_else(|e| e.into_inner());
    let err = |what: &str, r: cupti::CUptiResult| format!("{what}: {r:?}");
    let mut subscriber = std::ptr::null_mut();
    // SAFETY: `on_driver_call` reads only what CUPTI passes it, and the subscriber is
    // given back below on every path.
    let r = unsafe {
        cupti::cuptiSubscribe(&mut subscriber, Some(on_driver_call), std::ptr::null_mut())
    };
    if r != cupti::CUptiResult::CUPTI_SUCCESS {
        return Err(err("cuptiSubscribe", r));
    }
    let domain = cupti::CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API;
    // SAFETY: a subscriber just made.
    let r = unsafe { cupti::cuptiEnableCallback(1, subscriber, domain, LAUNCH) };
    let seen = if r == cupti::CUptiResult::CUPTI_SUCCESS {
        SEEN.with(|s| s.set(Some(None)));
        let flag = client.create_from_slice(&[0u8; 4]);
        // SAFETY: the buffer holds one u32.
        let arg = unsafe { ArrayArg::from_raw_parts(flag, 1) };
        mark::launch::<CudaRuntime>(client, CubeCount::Static(1, 1, 1), CubeDim::new_1d(1), arg);
        Ok(SEEN.with(|s| s.replace(None)).flatten())
    } else {
        Err(err("cuptiEnableCallback", r))
    };
    // SAFETY: the subscriber made above, given back once.
    let r = unsafe { cupti::cuptiUnsubscribe(subscriber) };
    match (seen?, r) {
        (_, r) if r != cupti::CUptiResult::CUPTI_SUCCESS => Err(err("cuptiUnsubscribe", r)),
        (Some(stream), _) if !stream.is_null() => Ok(stream),
        _ => Err("CUPTI showed no kernel launch on cubecl's device thread".into()),
    }
}
