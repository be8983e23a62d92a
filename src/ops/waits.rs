//! What kiln's own GPU work costs the threads that queue it: round trips to cubecl's
//! device thread, calls queued there, library calls by kind, host waits. Counted on
//! CUDA (`cuda::kiln_stream`); zero elsewhere.

/// What the threads that queue GPU work spent in kiln's own waits so far: the round
/// trips to cubecl's device thread that every cuDNN call and page-locked upload makes
/// (`kiln_stream`), and within them the host waiting for a GPU stream (channels-last
/// batch norm, and every call where the hand-over cannot be set up). Summed over
/// threads; zero without CUDA.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KilnWaits {
    pub round_trips: u64,
    pub round_trip_s: f64,
    /// Calls queued on the device thread without a round trip.
    pub queued: u64,
    /// Of `round_trip_s` and the queued calls, kiln's work on the device thread (cuDNN's calls, the
    /// hand-over, host waits); the rest waited for the thread to reach the call.
    pub on_device_thread_s: f64,
    /// Of `on_device_thread_s`: the library calls themselves, by kind
    /// ([`LibraryCall::ALL`]'s order).
    pub library_call_s: [f64; LibraryCall::ALL.len()],
    /// Of `on_device_thread_s`: the hand-over's launches that order kiln's stream
    /// against cubecl's (`stream_order`; none where kiln's work goes on cubecl's
    /// stream, `cubecl_stream`).
    pub ordering_s: f64,
    pub host_syncs: u64,
    pub host_sync_s: f64,
}

impl KilnWaits {
    /// The waits since `earlier` (a snapshot taken before).
    pub fn since(self, earlier: KilnWaits) -> KilnWaits {
        KilnWaits {
            round_trips: self.round_trips - earlier.round_trips,
            round_trip_s: self.round_trip_s - earlier.round_trip_s,
            queued: self.queued - earlier.queued,
            on_device_thread_s: self.on_device_thread_s - earlier.on_device_thread_s,
            library_call_s: std::array::from_fn(|i| {
                self.library_call_s[i] - earlier.library_call_s[i]
            }),
            ordering_s: self.ordering_s - earlier.ordering_s,
            host_syncs: self.host_syncs - earlier.host_syncs,
            host_sync_s: self.host_sync_s - earlier.host_sync_s,
        }
    }
}

/// The calls kiln makes into a GPU library on its own stream, timed by kind
/// ([`KilnWaits::library_call_s`]).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LibraryCall {
    ConvForward,
    ConvGradX,
    ConvGradWeight,
    NormForward,
    NormBackward,
    Upload,
    /// An NCCL collective (`cuda::nccl`).
    Collective,
}

impl LibraryCall {
    pub const ALL: [LibraryCall; 7] = [
        LibraryCall::ConvForward,
        LibraryCall::ConvGradX,
        LibraryCall::ConvGradWeight,
        LibraryCall::NormForward,
        LibraryCall::NormBackward,
        LibraryCall::Upload,
        LibraryCall::Collective,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LibraryCall::ConvForward => "conv_forward",
            LibraryCall::ConvGradX => "conv_grad_x",
            LibraryCall::ConvGradWeight => "conv_grad_weight",
            LibraryCall::NormForward => "norm_forward",
            LibraryCall::NormBackward => "norm_backward",
            LibraryCall::Upload => "upload",
            LibraryCall::Collective => "collective",
        }
    }
}

/// The round trips and host waits so far ([`KilnWaits`]).
pub fn kiln_waits() -> KilnWaits {
    #[cfg(feature = "cuda")]
    return super::cuda::kiln_waits();
    #[cfg(not(feature = "cuda"))]
    KilnWaits::default()
}
