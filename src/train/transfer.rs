//! Moving weights, gradients and BatchNorm statistics between devices through host
//! memory. Burn 0.21's `to_device` between two CUDA devices is an NCCL send/receive
//! pair (cubecl-cuda 0.10); with two replica threads transferring at once the pairs
//! cross, and the step ends in `CUDA_ERROR_ILLEGAL_ADDRESS` or waits forever (both
//! seen on two H200s). The data-parallel learner therefore never hands a tensor from
//! one device to another: it reads it to the host and uploads it, and every replica
//! owns its own BatchNorm running statistics.

use std::collections::HashMap;

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

/// Which float tensors of a module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// What the optimizer updates.
    Trainable,
    /// Everything else: BatchNorm's running statistics.
    Buffers,
}

fn wanted(part: Part, require_grad: bool) -> bool {
    match part {
        Part::Trainable => require_grad,
        Part::Buffers => !require_grad,
    }
}

/// Tensors concatenated into one vector, in host memory: one read-back or upload per
/// transfer instead of one per tensor (each is a device synchronisation).
#[derive(Debug, Clone, PartialEq)]
pub struct Flat(TensorData);

impl Flat {
    fn of<B: Backend>(pieces: Vec<Tensor<B, 1>>) -> Self {
        if pieces.is_empty() {
            return Flat(TensorData::new(Vec::<f32>::new(), [0]));
        }
        Flat(Tensor::cat(pieces, 0).into_data())
    }

    fn len(&self) -> usize {
        self.0.shape.iter().product()
    }

    fn upload<B: Backend>(&self, device: &B::Device) -> Tensor<B, 1> {
        Tensor::from_data(self.0.clone(), device)
    }
}

/// Elements of a tensor of these dimensions.
fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// The piece `offset..offset + numel(dims)` of `all`, shaped as `dims`.
fn piece<B: Backend, const D: usize>(
    all: &Tensor<B, 1>,
    offset: usize,
    dims: [usize; D],
) -> Tensor<B, D> {
    all.clone().narrow(0, offset, numel(&dims)).reshape(dims)
}

/// The `part` of `model` (an autodiff module: only there do tensors say whether they
/// are trained) in host memory, in visiting order. BatchNorm updates still pending
/// are left out: [`buffers`] folds them in first.
pub fn snapshot<B: Backend, M: Module<B>>(model: &M, part: Part) -> Flat {
    struct Snap<B: Backend> {
        part: Part,
        pieces: Vec<Tensor<B, 1>>,
    }
    impl<B: Backend> ModuleVisitor<B> for Snap<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let t = param.val();
            if wanted(self.part, t.is_require_grad()) {
                let n = numel(&t.dims());
                self.pieces.push(t.detach().reshape([n]));
            }
        }
    }
    let mut s = Snap {
        part,
        pieces: Vec::new(),
    };
    model.visit(&mut s);
    Flat::of(s.pieces)
}

/// BatchNorm running statistics of `model`, pending updates included.
pub fn buffers<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> Flat {
    // `valid` folds every thread's pending update into the shared value.
    let _ = model.valid();
    snapshot(model, Part::Buffers)
}

/// `model` with its `part` replaced by `flat` (from [`snapshot`] of a module of the
/// same structure), uploaded to `device` in one piece.
pub fn load<B: Backend, M: Module<B>>(model: M, flat: &Flat, part: Part, device: &B::Device) -> M {
    if flat.len() == 0 {
        return model;
    }
    struct Load<B: Backend> {
        part: Part,
        all: Tensor<B, 1>,
        offset: usize,
    }
    impl<B: Backend> ModuleMapper<B> for Load<B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (require_grad, dims) = {
                let t = param.val();
                (t.is_require_grad(), t.dims())
            };
            if !wanted(self.part, require_grad) {
                return param;
            }
            let (id, _, mapper) = param.consume();
            let t = piece(&self.all, self.offset, dims).set_require_grad(require_grad);
            self.offset += numel(&dims);
            Param::from_mapped_value(id, t, mapper)
        }
    }
    let mut l = Load::<B> {
        part,
        all: flat.upload(device),
        offset: 0,
    };
    let model = model.map(&mut l);
    assert_eq!(
        l.offset,
        flat.len(),
        "a snapshot of a module of the same structure"
    );
    model
}

/// An independent copy of `model` on `device`: same parameter ids, its own BatchNorm
/// running statistics (not shared with `model`, unlike `Clone`).
pub fn replica<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M, device: &B::Device) -> M {
    let stats = buffers(model);
    let trainable = snapshot(model, Part::Trainable);
    // `from_inner` makes new running-statistics cells; the uploads put it on `device`.
    let fresh = M::from_inner(model.valid());
    let fresh = load(fresh, &trainable, Part::Trainable, device);
    load(fresh, &stats, Part::Buffers, device)
}

/// Gradients of one replica in host memory, concatenated in visiting order.
#[derive(Clone)]
pub struct HostGrads {
    flat: Flat,
    index: HashMap<ParamId, usize>,
}

impl HostGrads {
    /// Reads `grads` (of `model`'s parameters) back to the host.
    pub fn read<B: AutodiffBackend, M: AutodiffModule<B>>(
        mut grads: GradientsParams,
        model: &M,
    ) -> Self {
        collect::<B, M>(model, Source::Take(&mut grads))
    }

    /// A host copy of `grads`, which stay where they are.
    pub fn copy<B: AutodiffBackend, M: AutodiffModule<B>>(
        grads: &GradientsParams,
        model: &M,
    ) -> Self {
        collect::<B, M>(model, Source::Copy(grads))
    }

    /// Uploads all gradients to `device` in one piece.
    pub fn upload<B: Backend>(&self, device: &B::Device) -> DeviceGrads<B> {
        DeviceGrads {
            all: self.flat.upload(device),
            index: self.index.clone(),
        }
    }

    /// All gradients uploaded to `device`, as the optimizer of `model` takes them.
    pub fn into_params<B: AutodiffBackend, M: AutodiffModule<B>>(
        self,
        model: &M,
        device: &B::Device,
    ) -> GradientsParams {
        struct Up<'a, B: AutodiffBackend> {
            grads: &'a DeviceGrads<B::InnerBackend>,
            out: GradientsParams,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Up<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if let Some(t) = self.grads.take(param.id, param.val().dims()) {
                    self.out.register::<B::InnerBackend, D>(param.id, t);
                }
            }
        }
        let grads = self.upload::<B::InnerBackend>(device);
        let mut up = Up::<B> {
            grads: &grads,
            out: GradientsParams::new(),
        };
        model.visit(&mut up);
        up.out
    }
}

/// Where [`collect`] finds the gradients.
enum Source<'a> {
    Take(&'a mut GradientsParams),
    Copy(&'a GradientsParams),
}

/// The gradients of `model`'s parameters, flattened, concatenated in visiting order and
/// read back once.
fn collect<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M, source: Source) -> HostGrads {
    struct Col<'a, B: AutodiffBackend> {
        source: Source<'a>,
        pieces: Vec<Tensor<B::InnerBackend, 1>>,
        index: HashMap<ParamId, usize>,
        offset: usize,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Col<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let g = match &mut self.source {
                Source::Take(g) => g.remove::<B::InnerBackend, D>(param.id),
                Source::Copy(g) => g.get::<B::InnerBackend, D>(param.id),
            };
            if let Some(g) = g {
                let n = numel(&g.dims());
                self.index.insert(param.id, self.offset);
                self.offset += n;
                self.pieces.push(g.reshape([n]));
            }
        }
    }
    let mut c = Col::<B> {
        source,
        pieces: Vec::new(),
        index: HashMap::new(),
        offset: 0,
    };
    model.visit(&mut c);
    HostGrads {
        flat: Flat::of(c.pieces),
        index: c.index,
    }
}

/// Gradients uploaded in one piece; each parameter's is a slice of it.
pub struct DeviceGrads<B: Backend> {
    all: Tensor<B, 1>,
    index: HashMap<ParamId, usize>,
}

impl<B: Backend> DeviceGrads<B> {
    pub fn take<const D: usize>(&self, id: ParamId, dims: [usize; D]) -> Option<Tensor<B, D>> {
        self.index
            .get(&id)
            .map(|&offset| piece(&self.all, offset, dims))
    }
}

/// Element-wise mean of several snapshots of the same tensors (f32 on the host), in
/// the order given, so every run computes the same numbers.
pub fn mean(snapshots: &[Flat]) -> Flat {
    let n = snapshots.len() as f32;
    let shape = snapshots[0].0.shape.clone();
    let mut acc: Vec<f32> = snapshots[0]
        .0
        .to_vec::<f32>()
        .expect("BatchNorm statistics are float tensors");
    for s in &snapshots[1..] {
        let v = s.0.to_vec::<f32>().expect("float tensors");
        acc.iter_mut().zip(v).for_each(|(a, b)| *a += b);
    }
    acc.iter_mut().for_each(|a| *a /= n);
    Flat(TensorData::new(acc, shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, Stem};
    use crate::model::ModelSpec;
    use crate::test_util::{TestBackend, device, rng_lock};

    #[test]
    fn a_replica_is_equal_but_does_not_share_running_statistics() {
        let _rng = rng_lock();
        let model = ModelSpec::new(Arch::Tiny, Stem::Small, 3, 3, 8).init::<TestBackend>(&device());
        let copy = replica(&model, &device());
        assert_eq!(
            snapshot(&model, Part::Trainable),
            snapshot(&copy, Part::Trainable)
        );
        let before = buffers(&model);
        assert!(before.len() > 0);
        // Training-mode forward passes on the copy move only its own statistics.
        let x = Tensor::<TestBackend, 4>::ones([4, 3, 8, 8], &device());
        let _ = copy.forward(x);
        assert_eq!(buffers(&model), before);
        assert_ne!(buffers(&copy), before);
        // Same parameter ids: the main optimizer's state applies to either.
        let ids = |m: &crate::model::ResNet<TestBackend>| {
            let mut v = Vec::new();
            struct Ids<'a>(&'a mut Vec<ParamId>);
            impl<B: Backend> ModuleVisitor<B> for Ids<'_> {
                fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                    if p.is_require_grad() {
                        self.0.push(p.id);
                    }
                }
            }
            m.visit(&mut Ids(&mut v));
            v
        };
        assert_eq!(ids(&model), ids(&copy));
    }

    #[test]
    fn mean_of_snapshots_is_element_wise() {
        let a = Flat(TensorData::new(vec![1.0f32, 2.0], [2]));
        let b = Flat(TensorData::new(vec![3.0f32, 6.0], [2]));
        assert_eq!(mean(&[a, b]), Flat(TensorData::new(vec![2.0f32, 4.0], [2])));
    }

    #[test]
    fn gradients_survive_the_trip_through_the_host() {
        let _rng = rng_lock();
        let model = ModelSpec::new(Arch::Tiny, Stem::Small, 3, 3, 8).init::<TestBackend>(&device());
        let x = Tensor::<TestBackend, 4>::random(
            [4, 3, 8, 8],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device(),
        );
        let grads = GradientsParams::from_grads(model.forward(x).sum().backward(), &model);
        let host = HostGrads::copy(&grads, &model);
        let back = host.clone().into_params(&model, &device());
        let read = HostGrads::read(grads, &model);
        assert!(!host.index.is_empty());
        assert_eq!(host.flat, read.flat);
        let again = HostGrads::copy(&back, &model);
        assert_eq!(again.flat, host.flat);
        assert_eq!(again.index, host.index);
    }
}
