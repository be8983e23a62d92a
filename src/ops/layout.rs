//! The order of a 4-D activation tensor's axes (and of a convolution weight's), and
//! views between the orders.

/// The order of a 4-D activation tensor's axes, and of a convolution weight's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Layout {
    /// Burn's own: activations `[N, C, H, W]`, weights `[K, C, R, S]`.
    #[default]
    Nchw,
    /// Channels last (`kernels.channels_last`): activations `[N, H, W, C]`, weights
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
