//! kiln's backend extensions on Burn's fusion backend: the convolution, BatchNorm's
//! training pass, the SGD step and the collectives each enter the fusion stream as one
//! custom operation that runs the inner backend's version when the stream executes, as
//! Burn's own non-fusable operations do. [`UploadBackend`] registers the inner
//! backend's upload as the stream's input, as `from_data` does.

use std::marker::PhantomData;

use burn::tensor::ops::{ConvOptions, FloatTensor};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor, NoOp, get_client};
use burn_ir::{
    CustomOpIr, HandleContainer, InitOperationIr, OperationIr, OperationOutput, TensorIr,
};

use crate::ops::sgd::{SgdBackend, SgdStep, Stepped};
use crate::ops::{
    ActivationBackend, CollectiveBackend, Comm, ConvBackend, ConvPass, Layout, NormBackend,
    UploadBackend, conv2d_output_dims,
};

#[derive(Debug)]
struct ConvOp<B> {
    desc: CustomOpIr,
    part: ConvPass,
    options: ConvOptions<2>,
    layout: Layout,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + ConvBackend> Operation<B::FusionRuntime> for ConvOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let (options, layout) = (self.options.clone(), self.layout);
        let (inputs, out) = (&self.desc.inputs, &self.desc.outputs[0]);
        let mut get = |i: usize| handles.get_float_tensor::<B>(&inputs[i]);
        let result = match self.part {
            ConvPass::Forward => B::conv2d_nobias(get(0), get(1), options, layout),
            // A fourth input is the gradient the data gradient adds onto.
            ConvPass::GradX if inputs.len() == 4 => {
                B::conv2d_grad_x_onto(get(0), get(1), get(2), get(3), options, layout)
            }
            ConvPass::GradX => B::conv2d_grad_x(get(0), get(1), get(2), options, layout),
            ConvPass::GradWeight => B::conv2d_grad_weight(get(0), get(1), get(2), options, layout),
        };
        handles.register_float_tensor::<B>(&out.id, result);
    }
}

/// Queues `op`, built from its description, on the inputs' streams; returns the
/// outputs, of the given shapes and dtypes.
fn register<B: FusionBackend, O: Operation<B::FusionRuntime> + 'static>(
    name: &'static str,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<(Shape, DType)>,
    op: impl FnOnce(CustomOpIr) -> O,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let client = inputs[0].client.clone();
    let streams = OperationStreams::with_inputs(&inputs);
    let outs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let irs: Vec<TensorIr> = inputs.into_iter().map(|t| t.into_ir()).collect();
    let desc = CustomOpIr::new(name, &irs, &outs);
    client.register(streams, OperationIr::Custom(desc.clone()), op(desc))
}

fn register_conv<B: FusionBackend + ConvBackend>(
    part: ConvPass,
    name: &'static str,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    out_shape: Shape,
    options: ConvOptions<2>,
    layout: Layout,
) -> FusionTensor<B::FusionRuntime> {
    let dtype = inputs[0].dtype;
    register::<B, _>(name, inputs, vec![(out_shape, dtype)], |desc| ConvOp::<B> {
        desc,
        part,
        options,
        layout,
        _backend: PhantomData,
    })
    .output()
}

impl<B: FusionBackend + ConvBackend> ConvBackend for Fusion<B> {
    fn products_as_convolutions() -> bool {
        B::products_as_convolutions()
    }

    fn conv2d_nobias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        let dims = |s: &Shape| [s[0], s[1], s[2], s[3]];
        let shape = Shape::new(conv2d_output_dims(
            dims(&x.shape),
            dims(&weight.shape),
            &options,
            layout,
        ));
        register_conv::<B>(
            ConvPass::Forward,
            "kiln_conv2d",
            vec![x, weight],
            shape,
            options,
            layout,
        )
    }

    fn conv2d_grad_x(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        let shape = x.shape.clone();
        register_conv::<B>(
            ConvPass::GradX,
            "kiln_conv2d_grad_x",
            vec![x, weight, output_grad],
            shape,
            options,
            layout,
        )
    }

    fn conv2d_grad_x_onto(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        onto: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        let shape = x.shape.clone();
        register_conv::<B>(
            ConvPass::GradX,
            "kiln_conv2d_grad_x_onto",
            vec![x, weight, output_grad, onto],
            shape,
            options,
            layout,
        )
    }

    fn conv2d_grad_weight(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        layout: Layout,
    ) -> FloatTensor<Self> {
        let shape = weight.shape.clone();
        let inputs = vec![x, weight, output_grad];
        register_conv::<B>(
            ConvPass::GradWeight,
            "kiln_conv2d_grad_weight",
            inputs,
            shape,
            options,
            layout,
        )
    }
}

#[derive(Debug)]
enum NormPart {
    Train,
    /// With the running statistics' update, and its momentum.
    TrainRunning(f64),
    Grad,
    /// A residual block's end, with the running statistics' momentum.
    AddReluTrain(f64),
    AddReluGrad,
}

#[derive(Debug)]
struct NormOp<B> {
    desc: CustomOpIr,
    part: NormPart,
    epsilon: f64,
    layout: Layout,
    relu: bool,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + NormBackend> Operation<B::FusionRuntime> for NormOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let inputs = &self.desc.inputs;
        let mut get = |i: usize| handles.get_float_tensor::<B>(&inputs[i]);
        let (epsilon, layout, relu) = (self.epsilon, self.layout, self.relu);
        let results = match self.part {
            NormPart::Train => {
                B::batch_norm_train(get(0), get(1), get(2), epsilon, layout, relu).into()
            }
            NormPart::TrainRunning(momentum) => {
                let (x, gamma, beta, running) = (get(0), get(1), get(2), [get(3), get(4)]);
                let how = (epsilon, layout, relu);
                B::batch_norm_train_running(x, gamma, beta, how.0, how.1, how.2, running, momentum)
                    .into()
            }
            NormPart::Grad => {
                let (x, params) = (get(0), [get(1), get(2)]);
                let stats = [get(3), get(4)];
                B::batch_norm_grad(x, params, stats, get(5), epsilon, layout, relu).into()
            }
            NormPart::AddReluTrain(momentum) => {
                let (x, residual, gamma, beta) = (get(0), get(1), get(2), get(3));
                let running = [get(4), get(5)];
                B::batch_norm_add_relu_train(
                    x, residual, gamma, beta, epsilon, layout, running, momentum,
                )
                .into()
            }
            NormPart::AddReluGrad => {
                let (x, out, params, stats) = (get(0), get(1), [get(2), get(3)], [get(4), get(5)]);
                B::batch_norm_add_relu_grad(x, out, params, stats, get(6), epsilon, layout).into()
            }
        };
        let results: Vec<FloatTensor<B>> = results;
        for (out, result) in self.desc.outputs.iter().zip(results) {
            handles.register_float_tensor::<B>(&out.id, result);
        }
    }
}

fn register_norm<B: FusionBackend + NormBackend, const K: usize>(
    part: NormPart,
    name: &'static str,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<(Shape, DType)>,
    (epsilon, layout, relu): (f64, Layout, bool),
) -> [FusionTensor<B::FusionRuntime>; K] {
    register::<B, _>(name, inputs, outputs, |desc| NormOp::<B> {
        desc,
        part,
        epsilon,
        layout,
        relu,
        _backend: PhantomData,
    })
    .outputs()
}

/// Burn's ReLU, which fusion joins to the element-wise work around it; what kiln
/// changes is only which tensor autodiff keeps (`ops::activation`).
impl<B: FusionBackend> ActivationBackend for Fusion<B> {}

impl<B: FusionBackend + NormBackend> NormBackend for Fusion<B> {
    fn fuses_norm_epilogue(layout: Layout) -> bool {
        B::fuses_norm_epilogue(layout)
    }

    fn batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        relu: bool,
    ) -> [FloatTensor<Self>; 3] {
        let y = (x.shape.clone(), x.dtype);
        let stat = (gamma.shape.clone(), gamma.dtype);
        let outputs = vec![y, stat.clone(), stat];
        let inputs = vec![x, gamma, beta];
        let how = (epsilon, layout, relu);
        register_norm::<B, 3>(NormPart::Train, "kiln_batch_norm", inputs, outputs, how)
    }

    fn batch_norm_train_running(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        relu: bool,
        [running_mean, running_var]: [FloatTensor<Self>; 2],
        momentum: f64,
    ) -> [FloatTensor<Self>; 5] {
        let y = (x.shape.clone(), x.dtype);
        let stat = (gamma.shape.clone(), gamma.dtype);
        let outputs = vec![y, stat.clone(), stat.clone(), stat.clone(), stat];
        let inputs = vec![x, gamma, beta, running_mean, running_var];
        let part = NormPart::TrainRunning(momentum);
        let how = (epsilon, layout, relu);
        register_norm::<B, 5>(part, "kiln_batch_norm_running", inputs, outputs, how)
    }

    fn batch_norm_add_relu_train(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        [running_mean, running_var]: [FloatTensor<Self>; 2],
        momentum: f64,
    ) -> [FloatTensor<Self>; 5] {
        let y = (x.shape.clone(), x.dtype);
        let stat = (gamma.shape.clone(), gamma.dtype);
        let outputs = vec![y, stat.clone(), stat.clone(), stat.clone(), stat];
        let inputs = vec![x, residual, gamma, beta, running_mean, running_var];
        let part = NormPart::AddReluTrain(momentum);
        let how = (epsilon, layout, true);
        register_norm::<B, 5>(part, "kiln_batch_norm_add_relu", inputs, outputs, how)
    }

    fn batch_norm_add_relu_grad(
        x: FloatTensor<Self>,
        out: FloatTensor<Self>,
        [gamma, beta]: [FloatTensor<Self>; 2],
        [mean, inv_std]: [FloatTensor<Self>; 2],
        dout: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
    ) -> [FloatTensor<Self>; 4] {
        let dx = (x.shape.clone(), x.dtype);
        let param = (gamma.shape.clone(), gamma.dtype);
        let outputs = vec![dx.clone(), param.clone(), param, dx];
        let inputs = vec![x, out, gamma, beta, mean, inv_std, dout];
        let how = (epsilon, layout, true);
        let name = "kiln_batch_norm_add_relu_grad";
        register_norm::<B, 4>(NormPart::AddReluGrad, name, inputs, outputs, how)
    }

    fn batch_norm_grad(
        x: FloatTensor<Self>,
        [gamma, beta]: [FloatTensor<Self>; 2],
        [mean, inv_std]: [FloatTensor<Self>; 2],
        dy: FloatTensor<Self>,
        epsilon: f64,
        layout: Layout,
        relu: bool,
    ) -> [FloatTensor<Self>; 3] {
        let dx = (x.shape.clone(), x.dtype);
        let param = (gamma.shape.clone(), gamma.dtype);
        let outputs = vec![dx, param.clone(), param];
        let inputs = vec![x, gamma, beta, mean, inv_std, dy];
        let how = (epsilon, layout, relu);
        register_norm::<B, 3>(NormPart::Grad, "kiln_batch_norm_grad", inputs, outputs, how)
    }
}

#[derive(Debug)]
struct SgdOp<B> {
    desc: CustomOpIr,
    /// Which parameters come with a velocity (the inputs hold the parameters, then
    /// their gradients, then the velocities there are).
    has_velocity: Vec<bool>,
    step: SgdStep,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + SgdBackend> Operation<B::FusionRuntime> for SgdOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let n = self.has_velocity.len();
        let mut inputs = self.desc.inputs.iter();
        let mut take = |k: usize| {
            (&mut inputs)
                .take(k)
                .map(|t| handles.get_float_tensor::<B>(t))
                .collect::<Vec<_>>()
        };
        let (params, grads) = (take(n), take(n));
        let mut present = take(n).into_iter();
        let velocities = self
            .has_velocity
            .iter()
            .map(|has| if *has { present.next() } else { None })
            .collect();
        let (params, velocities) = B::sgd_step(params, grads, velocities, self.step);
        let outputs = params.into_iter().chain(velocities.into_iter().flatten());
        for (out, result) in self.desc.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(&out.id, result);
        }
    }
}

/// The whole step as one operation of the fusion stream: one custom operation instead
/// of about nine per parameter.
impl<B: FusionBackend + SgdBackend> SgdBackend for Fusion<B> {
    fn sgd_step(
        params: Vec<FloatTensor<Self>>,
        grads: Vec<FloatTensor<Self>>,
        velocities: Vec<Option<FloatTensor<Self>>>,
        step: SgdStep,
    ) -> Stepped<Self> {
        let n = params.len();
        if n == 0 {
            return (Vec::new(), Vec::new());
        }
        let has_velocity: Vec<bool> = velocities.iter().map(Option::is_some).collect();
        let shapes: Vec<(Shape, DType)> =
            params.iter().map(|p| (p.shape.clone(), p.dtype)).collect();
        let with_momentum = step.momentum > 0.0;
        let mut outputs = shapes.clone();
        if with_momentum {
            outputs.extend(shapes);
        }
        let inputs = params
            .into_iter()
            .chain(grads)
            .chain(velocities.into_iter().flatten())
            .collect();
        let mut out = register::<B, _>("kiln_sgd_step", inputs, outputs, |desc| SgdOp::<B> {
            desc,
            has_velocity,
            step,
            _backend: PhantomData,
        })
        .into_iter();
        let new_params: Vec<_> = (&mut out).take(n).collect();
        let new_velocities = if with_momentum {
            out.map(Some).collect()
        } else {
            vec![None; n]
        };
        (new_params, new_velocities)
    }
}

impl<B: FusionBackend + UploadBackend> UploadBackend for Fusion<B> {
    fn upload_f32(values: Vec<f32>, device: &Self::Device) -> FloatTensor<Self> {
        let client = get_client::<B>(device);
        let tensor = B::upload_f32(values, device);
        let (shape, dtype) = (tensor.shape(), tensor.dtype());
        let handle = B::float_tensor_handle(tensor);
        let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
        client
            .register(
                OperationStreams::default(),
                OperationIr::Init(desc),
                NoOp::<B>::new(),
            )
            .output()
    }
}

/// Which collective a [`CollectiveOp`] runs.
#[derive(Debug, Clone, Copy)]
enum Collective {
    AllReduce,
    /// Every input through one buffer and one collective.
    AllReduceMany,
    Broadcast(usize),
}

#[derive(Debug)]
struct CollectiveOp<B> {
    desc: CustomOpIr,
    comm: Comm,
    kind: Collective,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + CollectiveBackend> Operation<B::FusionRuntime> for CollectiveOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let mut inputs: Vec<_> = self
            .desc
            .inputs
            .iter()
            .map(|t| handles.get_float_tensor::<B>(t))
            .collect();
        let outs = match self.kind {
            Collective::AllReduce => vec![B::all_reduce_sum(inputs.remove(0), &self.comm)],
            Collective::Broadcast(root) => vec![B::broadcast(inputs.remove(0), &self.comm, root)],
            Collective::AllReduceMany => B::all_reduce_many(inputs, &self.comm),
        };
        for (out, t) in self.desc.outputs.iter().zip(outs) {
            handles.register_float_tensor::<B>(&out.id, t);
        }
    }
}

fn register_collective<B: FusionBackend + CollectiveBackend>(
    name: &'static str,
    xs: Vec<FloatTensor<Fusion<B>>>,
    comm: &Comm,
    kind: Collective,
) -> Vec<FloatTensor<Fusion<B>>> {
    let outs = xs.iter().map(|x| (x.shape.clone(), x.dtype)).collect();
    let comm = comm.clone();
    register::<B, _>(name, xs, outs, |desc| CollectiveOp::<B> {
        desc,
        comm,
        kind,
        _backend: PhantomData,
    })
}

/// Collectives as operations of the fusion stream, so they run in order with the
/// backward pass that made their buffers; [`CollectiveBackend::flush`] hands them to
/// the device at once instead of when the stream next executes.
impl<B: FusionBackend + CollectiveBackend> CollectiveBackend for Fusion<B> {
    fn device_collectives() -> Option<Result<String, String>> {
        B::device_collectives()
    }

    fn communicators(devices: &[Self::Device]) -> Result<Vec<Comm>, String> {
        B::communicators(devices)
    }

    fn new_group_id() -> Result<Vec<u8>, String> {
        B::new_group_id()
    }

    fn join_group(
        device: &Self::Device,
        id: &[u8],
        rank: usize,
        size: usize,
    ) -> Result<Comm, String> {
        B::join_group(device, id, rank, size)
    }

    fn all_reduce_sum(x: FloatTensor<Self>, comm: &Comm) -> FloatTensor<Self> {
        let mut out =
            register_collective::<B>("kiln_all_reduce", vec![x], comm, Collective::AllReduce);
        out.remove(0)
    }

    fn all_reduce_many(xs: Vec<FloatTensor<Self>>, comm: &Comm) -> Vec<FloatTensor<Self>> {
        register_collective::<B>("kiln_all_reduce_many", xs, comm, Collective::AllReduceMany)
    }

    fn broadcast(x: FloatTensor<Self>, comm: &Comm, root: usize) -> FloatTensor<Self> {
        let kind = Collective::Broadcast(root);
        let mut out = register_collective::<B>("kiln_broadcast", vec![x], comm, kind);
        out.remove(0)
    }

    fn flush(device: &Self::Device) {
        // Executes what this thread queued (the collectives among it); does not wait
        // for the device.
        get_client::<B>(device).sync(|| ());
    }
}
