//! SGD with momentum and weight decay as one backend operation per step
//! ([`SgdBackend::sgd_step`]) instead of Burn's `Sgd`, which queues about nine tensor
//! operations per parameter. The arithmetic is Burn's `Sgd`'s, and so is the record:
//! Burn's optimizer-adaptor record of `Sgd` states, so checkpoints written before and
//! after this module load into either.

use std::collections::HashMap;
use std::marker::PhantomData;

use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::momentum::MomentumState;
use burn::optim::record::AdaptorRecord;
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer, Sgd, SgdState};
use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::ops::{SgdBackend, SgdStep};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;
type SgdRecord<B> = AdaptorRecord<Sgd<Inner<B>>, B>;

/// A parameter's velocity, of any rank.
#[derive(Clone)]
struct Velocity<B: Backend> {
    tensor: FloatTensor<B>,
    rank: usize,
}

/// The optimizer: its constants and every parameter's velocity.
#[derive(Clone)]
pub struct FusedSgd<M, B: AutodiffBackend> {
    /// `lr` is set per step.
    step: SgdStep,
    velocities: HashMap<ParamId, Velocity<Inner<B>>>,
    /// Loaded from a record and not yet turned into velocities: that needs each
    /// parameter's rank, which the first step learns.
    loaded: HashMap<ParamId, SgdRecord<B>>,
    _module: PhantomData<M>,
}

impl<M, B: AutodiffBackend> FusedSgd<M, B> {
    pub fn new(momentum: f64, nesterov: bool, weight_decay: f64) -> Self {
        FusedSgd {
            step: SgdStep {
                lr: 0.0,
                momentum,
                // As PyTorch's SGD (kiln's `optim.momentum` says so).
                dampening: 0.0,
                nesterov,
                weight_decay,
            },
            velocities: HashMap::new(),
            loaded: HashMap::new(),
            _module: PhantomData,
        }
    }
}

/// Gradients by parameter, from one device or from several.
enum Grads {
    Single(GradientsParams),
    Multi(MultiGradientsParams),
}

impl Grads {
    fn remove<B: Backend, const D: usize>(
        &mut self,
        id: ParamId,
        device: &B::Device,
    ) -> Option<Tensor<B, D>> {
        match self {
            Grads::Single(g) => g.remove(id),
            Grads::Multi(g) => g.remove(id).map(|(t, _)| t),
        }
        .map(|t| t.to_device(device))
    }
}

/// The parameters that have a gradient, each with it and its velocity.
struct Collect<'a, B: AutodiffBackend> {
    grads: &'a mut Grads,
    velocities: &'a mut HashMap<ParamId, Velocity<Inner<B>>>,
    loaded: &'a mut HashMap<ParamId, SgdRecord<B>>,
    ids: Vec<(ParamId, usize)>,
    params: Vec<FloatTensor<Inner<B>>>,
    grad_list: Vec<FloatTensor<Inner<B>>>,
    velocity_list: Vec<Option<FloatTensor<Inner<B>>>>,
    /// Placeholders by rank and whether they require a gradient.
    empties: HashMap<(usize, bool), FloatTensor<B>>,
}

fn primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn tensor<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Takes each parameter with a gradient out of the module, leaving an empty tensor in
/// its place until [`Replace`] puts the stepped one there: a parameter the module still
/// held could not be stepped in place (`SgdBackend::sgd_step`), and the step would hold
/// two copies of it.
impl<B: AutodiffBackend> ModuleMapper<B> for Collect<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, value, mapper) = param.consume();
        let device = value.device();
        let Some(grad) = self.grads.remove::<Inner<B>, D>(id, &device) else {
            return Param::from_mapped_value(id, value, mapper);
        };
        if let Some(record) = self.loaded.remove(&id) {
            let state: SgdState<Inner<B>, D> = record.into_state();
            if let Some(momentum) = state.momentum {
                self.velocities
                    .insert(id, velocity_of::<Inner<B>, D>(momentum, &device));
            }
        }
        let velocity = self.velocities.remove(&id).map(|v| v.tensor);
        let trainable = value.is_require_grad();
        self.ids.push((id, D));
        self.params.push(primitive(value.inner()));
        self.grad_list.push(primitive(grad));
        self.velocity_list.push(velocity);
        // One empty tensor per rank and kind, shared: a tensor operation per parameter
        // would cost the host time the step is bound by on small models.
        let empty = self
            .empties
            .entry((D, trainable))
            .or_insert_with(|| {
                let empty = Tensor::<B, D>::empty([0; D], &device);
                primitive(if trainable {
                    empty.require_grad()
                } else {
                    empty
                })
            })
            .clone();
        Param::from_mapped_value(id, tensor(empty), mapper)
    }
}

/// The velocity a loaded momentum state holds (its field is private to Burn; its
/// record's item is not).
fn velocity_of<B: Backend, const D: usize>(
    state: MomentumState<B, D>,
    device: &B::Device,
) -> Velocity<B> {
    let item = state.into_item::<FullPrecisionSettings>();
    let v = <Tensor<B, D> as Record<B>>::from_item::<FullPrecisionSettings>(item.velocity, device);
    Velocity {
        tensor: primitive(v),
        rank: D,
    }
}

/// Puts the stepped parameters back, as trainable autodiff leaves.
struct Replace<B: AutodiffBackend> {
    stepped: HashMap<ParamId, FloatTensor<Inner<B>>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Replace<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, value, mapper) = param.consume();
        let value = match self.stepped.remove(&id) {
            Some(new) => {
                let trainable = value.is_require_grad();
                let new = Tensor::<B, D>::from_inner(tensor(new));
                if trainable { new.require_grad() } else { new }
            }
            None => value,
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> FusedSgd<M, B>
where
    Inner<B>: SgdBackend,
{
    fn step_with(&mut self, lr: f64, module: M, mut grads: Grads) -> M {
        let mut collect = Collect::<B> {
            grads: &mut grads,
            velocities: &mut self.velocities,
            loaded: &mut self.loaded,
            ids: Vec::new(),
            params: Vec::new(),
            grad_list: Vec::new(),
            velocity_list: Vec::new(),
            empties: HashMap::new(),
        };
        let module = module.map(&mut collect);
        let Collect {
            ids,
            params,
            grad_list,
            velocity_list,
            ..
        } = collect;
        let step = SgdStep { lr, ..self.step };
        let (params, velocities) = Inner::<B>::sgd_step(params, grad_list, velocity_list, step);
        let mut stepped = HashMap::with_capacity(ids.len());
        for (((id, rank), param), velocity) in ids.into_iter().zip(params).zip(velocities) {
            stepped.insert(id, param);
            if let Some(tensor) = velocity {
                self.velocities.insert(id, Velocity { tensor, rank });
            }
        }
        module.map(&mut Replace::<B> { stepped })
    }
}

/// `velocity` as the record Burn's `Sgd` keeps for a parameter of rank `D`.
fn record_of<B: AutodiffBackend, const D: usize>(velocity: &FloatTensor<Inner<B>>) -> SgdRecord<B> {
    let momentum = MomentumState::new(tensor::<Inner<B>, D>(velocity.clone()));
    AdaptorRecord::from_state::<D>(SgdState::new(Some(momentum)))
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> Optimizer<M, B> for FusedSgd<M, B>
where
    Inner<B>: SgdBackend,
{
    /// Burn's own adaptor's, so that the two load each other's checkpoints.
    type Record = <OptimizerAdaptor<Sgd<Inner<B>>, M, B> as Optimizer<M, B>>::Record;

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        self.step_with(lr, module, Grads::Single(grads))
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        self.step_with(lr, module, Grads::Multi(grads))
    }

    fn to_record(&self) -> Self::Record {
        let mut record: Self::Record = self.loaded.iter().map(|(id, r)| (*id, r.clone())).collect();
        for (id, v) in &self.velocities {
            let r = match v.rank {
                1 => record_of::<B, 1>(&v.tensor),
                2 => record_of::<B, 2>(&v.tensor),
                3 => record_of::<B, 3>(&v.tensor),
                4 => record_of::<B, 4>(&v.tensor),
                5 => record_of::<B, 5>(&v.tensor),
                6 => record_of::<B, 6>(&v.tensor),
                rank => unreachable!("no parameter of kiln's models has rank {rank}"),
            };
            record.insert(*id, r);
        }
        record
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        self.velocities.clear();
        self.loaded = record.into_iter().collect();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, Stem};
    use crate::data::Batch;
    use crate::model::{ModelSpec, ResNet};
    use crate::test_util::{TestBackend, device, floats, rng_lock, tiny_batches};
    use crate::train::step::forward_backward;
    use burn::optim::SgdConfig;
    use burn::optim::decay::WeightDecayConfig;
    use burn::optim::momentum::MomentumConfig;
    use burn::record::{BinBytesRecorder, Recorder};

    type B = TestBackend;
    type Model = ResNet<B>;
    type BurnSgd = OptimizerAdaptor<Sgd<Inner<B>>, Model, B>;

    fn model() -> Model {
        <B as Backend>::seed(&device(), 3);
        ModelSpec::new(Arch::Tiny, Stem::Small, 3, 3, 8).init(&device())
    }

    fn burn_sgd(momentum: f64, nesterov: bool, weight_decay: f64) -> BurnSgd {
        let mut c = SgdConfig::new();
        if momentum > 0.0 {
            c = c.with_momentum(Some(MomentumConfig {
                momentum,
                dampening: 0.0,
                nesterov,
            }));
        }
        if weight_decay > 0.0 {
            c = c.with_weight_decay(Some(WeightDecayConfig::new(weight_decay as f32)));
        }
        c.init()
    }

    fn step<O: Optimizer<Model, B>>(o: &mut O, m: Model, b: &Batch, lr: f64) -> Model {
        let (grads, _) = forward_backward(&m, b.clone(), &device(), 1.0, 0.0);
        o.step(lr, m, grads)
    }

    /// Burn's `Sgd` arithmetic, step for step, in every combination kiln configures.
    #[test]
    fn the_same_steps_as_burns_sgd() {
        let _rng = rng_lock();
        let batches = tiny_batches();
        for (momentum, nesterov, weight_decay) in [
            (0.9, false, 5e-4),
            (0.9, true, 5e-4),
            (0.0, false, 5e-4),
            (0.9, false, 0.0),
        ] {
            let (mut ours, mut burn) = (model(), model());
            let mut fused = FusedSgd::<Model, B>::new(momentum, nesterov, weight_decay);
            let mut reference = burn_sgd(momentum, nesterov, weight_decay);
            for (i, b) in batches.iter().enumerate() {
                let lr = 0.1 / (i + 1) as f64;
                ours = step(&mut fused, ours, b, lr);
                burn = step(&mut reference, burn, b, lr);
            }
            assert_eq!(
                floats::<B, _>(&ours),
                floats::<B, _>(&burn),
                "momentum {momentum}, nesterov {nesterov}, weight decay {weight_decay}"
            );
        }
    }

    /// A checkpoint's optimizer state goes both ways between Burn's `Sgd` and this one,
    /// and training goes on as if it had not been interrupted.
    #[test]
    fn records_load_into_burns_sgd_and_back() {
        let _rng = rng_lock();
        let batches = tiny_batches();
        let rec = BinBytesRecorder::<FullPrecisionSettings>::new();
        let save = |r| Recorder::<B>::record(&rec, r, ()).unwrap();
        let (mut ours, mut burn) = (model(), model());
        let mut fused = FusedSgd::<Model, B>::new(0.9, false, 5e-4);
        let mut reference = burn_sgd(0.9, false, 5e-4);
        ours = step(&mut fused, ours, &batches[0], 0.1);
        burn = step(&mut reference, burn, &batches[0], 0.1);
        // Swap states: each continues from the other's record.
        let from_fused = save(fused.to_record());
        let from_burn = save(reference.to_record());
        let mut fused = FusedSgd::<Model, B>::new(0.9, false, 5e-4)
            .load_record(rec.load(from_burn, &device()).unwrap());
        let mut reference = burn_sgd(0.9, false, 5e-4)
            .load_record(rec.load(from_fused.clone(), &device()).unwrap());
        ours = step(&mut fused, ours, &batches[1], 0.1);
        burn = step(&mut reference, burn, &batches[1], 0.1);
        assert_eq!(floats::<B, _>(&ours), floats::<B, _>(&burn));
        // A record loaded and saved again before any step is the same record.
        let reloaded = FusedSgd::<Model, B>::new(0.9, false, 5e-4)
            .load_record(rec.load(from_fused.clone(), &device()).unwrap());
        assert_eq!(save(reloaded.to_record()).len(), from_fused.len());
    }
}
