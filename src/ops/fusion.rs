//! [`ConvBackend`] on Burn's fusion backend: each part of the convolution enters the
//! fusion stream as one custom operation that runs the inner backend's version when
//! the stream executes, as Burn's own non-fusable operations do.

use std::marker::PhantomData;

use burn::tensor::Shape;
use burn::tensor::ops::{ConvOptions, FloatTensor};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

use super::{ConvBackend, Part, conv2d_output_dims};

#[derive(Debug)]
struct ConvOp<B> {
    desc: CustomOpIr,
    part: Part,
    options: ConvOptions<2>,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + ConvBackend> Operation<B::FusionRuntime> for ConvOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let options = self.options.clone();
        let (inputs, out) = (&self.desc.inputs, &self.desc.outputs[0]);
        let mut get = |i: usize| handles.get_float_tensor::<B>(&inputs[i]);
        let result = match self.part {
            Part::Forward => B::conv2d_nobias(get(0), get(1), options),
            Part::GradX => B::conv2d_grad_x(get(0), get(1), get(2), options),
            Part::GradWeight => B::conv2d_grad_weight(get(0), get(1), get(2), options),
        };
        handles.register_float_tensor::<B>(&out.id, result);
    }
}

fn register<B: FusionBackend + ConvBackend>(
    part: Part,
    name: &'static str,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    out_shape: Shape,
    options: ConvOptions<2>,
) -> FusionTensor<B::FusionRuntime> {
    let client = inputs[0].client.clone();
    let streams = OperationStreams::with_inputs(&inputs);
    let out = TensorIr::uninit(client.create_empty_handle(), out_shape, inputs[0].dtype);
    let irs: Vec<TensorIr> = inputs.into_iter().map(|t| t.into_ir()).collect();
    let desc = CustomOpIr::new(name, &irs, &[out]);
    let op = ConvOp::<B> {
        desc: desc.clone(),
        part,
        options,
        _backend: PhantomData,
    };
    client
        .register(streams, OperationIr::Custom(desc), op)
        .output()
}

impl<B: FusionBackend + ConvBackend> ConvBackend for Fusion<B> {
    fn conv2d_nobias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let dims = |s: &Shape| [s[0], s[1], s[2], s[3]];
        let shape = Shape::new(conv2d_output_dims(
            dims(&x.shape),
            dims(&weight.shape),
            &options,
        ));
        register::<B>(
            Part::Forward,
            "kiln_conv2d",
            vec![x, weight],
            shape,
            options,
        )
    }

    fn conv2d_grad_x(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let shape = x.shape.clone();
        register::<B>(
            Part::GradX,
            "kiln_conv2d_grad_x",
            vec![x, weight, output_grad],
            shape,
            options,
        )
    }

    fn conv2d_grad_weight(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let shape = weight.shape.clone();
        let inputs = vec![x, weight, output_grad];
        register::<B>(
            Part::GradWeight,
            "kiln_conv2d_grad_weight",
            inputs,
            shape,
            options,
        )
    }
}
