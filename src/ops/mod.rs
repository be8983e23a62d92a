//! Backend extensions: operations kiln's models call through a trait of their own,
//! so a backend can put other kernels behind them: the convolution and BatchNorm's
//! training pass, which on CUDA can run on cuDNN (`train.convolution`,
//! `train.batch_norm`) or, for channels-last BatchNorm, on kiln's own kernels
//! (`channels_last_norm`), and the upload of a batch, which on CUDA can read page-locked
//! memory (`data.pin_memory`).

#[cfg(feature = "cuda")]
pub mod channels_last_norm;
mod conv;
#[cfg(feature = "cuda")]
mod cubecl_stream;
#[cfg(feature = "cuda")]
pub mod cudnn;
#[cfg(feature = "cuda")]
mod fusion;
#[cfg(feature = "cuda")]
mod kiln_stream;
mod norm;
#[cfg(feature = "cuda")]
pub mod pinned;
mod sgd;
#[cfg(feature = "cuda")]
mod stream_order;
mod upload;

pub use conv::{ConvBackend, conv2d};
pub use norm::{NormBackend, batch_norm};
pub use sgd::{SgdBackend, SgdStep};
pub use upload::{UploadBackend, upload_f32};

/// What kiln's models and steps call on a backend: its convolution, its BatchNorm and
/// its upload of a batch.
pub trait ModelBackend: ConvBackend + NormBackend + UploadBackend + SgdBackend {}

impl<B: ConvBackend + NormBackend + UploadBackend + SgdBackend> ModelBackend for B {}

/// The order of a 4-D activation tensor's axes, and of a convolution weight's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Layout {
    /// Burn's own: activations `[N, C, H, W]`, weights `[K, C, R, S]`.
    #[default]
    Nchw,
    /// Channels last (`train.channels_last`): activations `[N, H, W, C]`, weights
    /// `[K, R, S, C]`, the layout tensor cores read without a transposition.
    Nhwc,
}

impl Layout {
    /// The axes of a tensor in this layout that hold N, C, H, W (K, C, R, S), in turn.
    fn nchw_axes(self) -> [usize; 4] {
        match self {
            Layout::Nchw => [0, 1, 2, 3],
            Layout::Nhwc => [0, 3, 1, 2],
        }
    }

    /// The NCHW axes that a tensor in this layout holds, in turn.
    fn laid_out_axes(self) -> [usize; 4] {
        match self {
            Layout::Nchw => [0, 1, 2, 3],
            Layout::Nhwc => [0, 2, 3, 1],
        }
    }

    /// The axis that holds the channels.
    pub fn channel_axis(self) -> usize {
        self.nchw_axes()[1]
    }

    /// Dimensions given in this layout, in NCHW (KCRS) order.
    pub fn nchw_dims(self, d: [usize; 4]) -> [usize; 4] {
        self.nchw_axes().map(|a| d[a])
    }

    /// Dimensions given in NCHW (KCRS) order, in this layout.
    pub fn laid_out_dims(self, d: [usize; 4]) -> [usize; 4] {
        self.laid_out_axes().map(|a| d[a])
    }

    /// A tensor in this layout as an NCHW view (no copy).
    pub fn nchw_view<B: burn::tensor::backend::Backend>(
        self,
        t: burn::tensor::ops::FloatTensor<B>,
    ) -> burn::tensor::ops::FloatTensor<B> {
        match self {
            Layout::Nchw => t,
            Layout::Nhwc => B::float_permute(t, &self.nchw_axes()),
        }
    }

    /// An NCHW tensor as a view in this layout (no copy).
    pub fn laid_out_view<B: burn::tensor::backend::Backend>(
        self,
        t: burn::tensor::ops::FloatTensor<B>,
    ) -> burn::tensor::ops::FloatTensor<B> {
        match self {
            Layout::Nchw => t,
            Layout::Nhwc => B::float_permute(t, &self.laid_out_axes()),
        }
    }

    /// [`Layout::nchw_view`] of a tensor.
    pub fn nchw<B: burn::tensor::backend::Backend>(
        self,
        t: burn::tensor::Tensor<B, 4>,
    ) -> burn::tensor::Tensor<B, 4> {
        float_tensor(self.nchw_view::<B>(t.into_primitive().tensor()))
    }

    /// [`Layout::laid_out_view`] of a tensor: an NCHW activation (or KCRS weight) in
    /// this layout.
    pub fn laid_out<B: burn::tensor::backend::Backend>(
        self,
        t: burn::tensor::Tensor<B, 4>,
    ) -> burn::tensor::Tensor<B, 4> {
        float_tensor(self.laid_out_view::<B>(t.into_primitive().tensor()))
    }
}

fn float_tensor<B: burn::tensor::backend::Backend>(
    t: burn::tensor::ops::FloatTensor<B>,
) -> burn::tensor::Tensor<B, 4> {
    burn::tensor::Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(t))
}

/// The output shape of a convolution of `x` by `weight`, all three in `layout`
/// (NCHW: input NCHW, weight KCRS, output NKPQ).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn conv2d_output_dims(
    x: [usize; 4],
    weight: [usize; 4],
    options: &burn::tensor::ops::ConvOptions<2>,
    layout: Layout,
) -> [usize; 4] {
    let (x, weight) = (layout.nchw_dims(x), layout.nchw_dims(weight));
    let out = |d: usize| {
        burn::tensor::ops::conv::calculate_conv_output_size(
            weight[2 + d],
            options.stride[d],
            options.padding[d],
            options.dilation[d],
            x[2 + d],
        )
    };
    layout.laid_out_dims([x[0], weight[0], out(0), out(1)])
}

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
}

impl LibraryCall {
    pub const ALL: [LibraryCall; 6] = [
        LibraryCall::ConvForward,
        LibraryCall::ConvGradX,
        LibraryCall::ConvGradWeight,
        LibraryCall::NormForward,
        LibraryCall::NormBackward,
        LibraryCall::Upload,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LibraryCall::ConvForward => "conv_forward",
            LibraryCall::ConvGradX => "conv_grad_x",
            LibraryCall::ConvGradWeight => "conv_grad_weight",
            LibraryCall::NormForward => "norm_forward",
            LibraryCall::NormBackward => "norm_backward",
            LibraryCall::Upload => "upload",
        }
    }
}

/// The round trips and host waits so far ([`KilnWaits`]).
pub fn kiln_waits() -> KilnWaits {
    #[cfg(feature = "cuda")]
    return kiln_stream::kiln_waits();
    #[cfg(not(feature = "cuda"))]
    KilnWaits::default()
}

/// The three parts of a convolution a backend can replace.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Part {
    Forward,
    GradX,
    GradWeight,
}

/// What training needs of a backend: autodiff, and kiln's extensions both on it and
/// on the inner backend that evaluation runs on.
pub trait TrainBackend:
    burn::tensor::backend::AutodiffBackend<InnerBackend: ModelBackend> + ModelBackend
{
}

impl<B> TrainBackend for B
where
    B: burn::tensor::backend::AutodiffBackend + ModelBackend,
    B::InnerBackend: ModelBackend,
{
}
