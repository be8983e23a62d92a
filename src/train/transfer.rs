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

/// The `part` of `model` (an autodiff module: only there do tensors say whether they
/// are trained) in host memory, in visiting order. Reads every tensor back (a device
/// synchronisation). BatchNorm updates still pending are left out: [`buffers`] folds
/// them in first.
pub fn snapshot<B: Backend, M: Module<B>>(model: &M, part: Part) -> Vec<TensorData> {
    struct Snap {
        part: Part,
        out: Vec<TensorData>,
    }
    impl<B: Backend> ModuleVisitor<B> for Snap {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let t = param.val();
            if wanted(self.part, t.is_require_grad()) {
                self.out.push(t.into_data());
            }
        }
    }
    let mut s = Snap {
        part,
        out: Vec::new(),
    };
    model.visit(&mut s);
    s.out
}

/// BatchNorm running statistics of `model`, pending updates included.
pub fn buffers<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> Vec<TensorData> {
    // `valid` folds every thread's pending update into the shared value.
    let _ = model.valid();
    snapshot(model, Part::Buffers)
}

/// `model` with its `part` replaced by `data` (from [`snapshot`] of a module of the
/// same structure), uploaded to `device`.
pub fn load<B: Backend, M: Module<B>>(
    model: M,
    data: &[TensorData],
    part: Part,
    device: &B::Device,
) -> M {
    struct Load<'a, B: Backend> {
        part: Part,
        data: std::slice::Iter<'a, TensorData>,
        device: &'a B::Device,
    }
    impl<B: Backend> ModuleMapper<B> for Load<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let require_grad = param.val().is_require_grad();
            if !wanted(self.part, require_grad) {
                return param;
            }
            let (id, _, mapper) = param.consume();
            let data = self
                .data
                .next()
                .expect("a snapshot of a module of the same structure");
            let t =
                Tensor::<B, D>::from_data(data.clone(), self.device).set_require_grad(require_grad);
            Param::from_mapped_value(id, t, mapper)
        }
    }
    model.map(&mut Load::<B> {
        part,
        data: data.iter(),
        device,
    })
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

/// Gradients of one replica in host memory, by parameter id.
pub struct HostGrads(HashMap<ParamId, TensorData>);

impl HostGrads {
    /// Reads `grads` (of `model`'s parameters) back to the host.
    pub fn read<B: AutodiffBackend, M: AutodiffModule<B>>(
        mut grads: GradientsParams,
        model: &M,
    ) -> Self {
        struct Read<'a, B: AutodiffBackend> {
            grads: &'a mut GradientsParams,
            out: HashMap<ParamId, TensorData>,
            _b: std::marker::PhantomData<B>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Read<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                    self.out.insert(param.id, g.into_data());
                }
            }
        }
        let mut r = Read::<B> {
            grads: &mut grads,
            out: HashMap::new(),
            _b: std::marker::PhantomData,
        };
        model.visit(&mut r);
        HostGrads(r.out)
    }

    /// A host copy of `grads`, which stay where they are.
    pub fn copy<B: AutodiffBackend, M: AutodiffModule<B>>(
        grads: &GradientsParams,
        model: &M,
    ) -> Self {
        struct Copy<'a, B: AutodiffBackend> {
            grads: &'a GradientsParams,
            out: HashMap<ParamId, TensorData>,
            _b: std::marker::PhantomData<B>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Copy<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
                    self.out.insert(param.id, g.into_data());
                }
            }
        }
        let mut c = Copy::<B> {
            grads,
            out: HashMap::new(),
            _b: std::marker::PhantomData,
        };
        model.visit(&mut c);
        HostGrads(c.out)
    }

    /// Gradient of parameter `id`, uploaded to `device`.
    pub fn upload<B: Backend, const D: usize>(
        &mut self,
        id: ParamId,
        device: &B::Device,
    ) -> Option<Tensor<B, D>> {
        self.0
            .remove(&id)
            .map(|data| Tensor::from_data(data, device))
    }

    /// All gradients uploaded to `device`, as the optimizer of `model` takes them.
    pub fn into_params<B: AutodiffBackend, M: AutodiffModule<B>>(
        mut self,
        model: &M,
        device: &B::Device,
    ) -> GradientsParams {
        struct Up<'a, B: AutodiffBackend> {
            host: &'a mut HostGrads,
            device: &'a B::Device,
            out: GradientsParams,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Up<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if let Some(t) = self
                    .host
                    .upload::<B::InnerBackend, D>(param.id, self.device)
                {
                    self.out.register::<B::InnerBackend, D>(param.id, t);
                }
            }
        }
        let mut up = Up::<B> {
            host: &mut self,
            device,
            out: GradientsParams::new(),
        };
        model.visit(&mut up);
        up.out
    }

    /// The same gradients, for another replica.
    pub fn duplicate(&self) -> Self {
        HostGrads(self.0.clone())
    }
}

/// Element-wise mean of several snapshots of the same tensors (f32 on the host), in
/// the order given, so every run computes the same numbers.
pub fn mean(snapshots: &[Vec<TensorData>]) -> Vec<TensorData> {
    let n = snapshots.len() as f32;
    (0..snapshots[0].len())
        .map(|i| {
            let shape = snapshots[0][i].shape.clone();
            let mut acc: Vec<f32> = snapshots[0][i]
                .to_vec::<f32>()
                .expect("BatchNorm statistics are float tensors");
            for s in &snapshots[1..] {
                let v = s[i].to_vec::<f32>().expect("float tensors");
                acc.iter_mut().zip(v).for_each(|(a, b)| *a += b);
            }
            acc.iter_mut().for_each(|a| *a /= n);
            TensorData::new(acc, shape)
        })
        .collect()
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
        assert!(!before.is_empty());
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
        let a = vec![TensorData::new(vec![1.0f32, 2.0], [2])];
        let b = vec![TensorData::new(vec![3.0f32, 6.0], [2])];
        assert_eq!(mean(&[a, b]), vec![TensorData::new(vec![2.0f32, 4.0], [2])]);
    }
}
