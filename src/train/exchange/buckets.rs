//! A model's tensors as the few 1-D buffers an [`Exchange`] moves, and back: the
//! gradients in the order the backward pass makes them (the reverse of the modules'
//! order, as PyTorch's DDP buckets them), grouped into buckets of up to
//! `parallel.bucket_mib`, so a ResNet-50 step exchanges a handful of buffers instead
//! of 161; weights and BatchNorm statistics in the modules' order.

use std::ops::Range;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{DType, FloatDType, Shape, Tensor, TensorMetadata, TensorPrimitive};

use super::{Exchange, ExchangeError};

/// Which float tensors of a module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ParamSet {
    /// What the optimizer updates.
    Trainable,
    /// Everything else: BatchNorm's running statistics.
    Buffers,
    /// Both.
    All,
}

impl ParamSet {
    fn wants(self, require_grad: bool) -> bool {
        match self {
            ParamSet::Trainable => require_grad,
            ParamSet::Buffers => !require_grad,
            ParamSet::All => true,
        }
    }
}

fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// The bucket of each of `sizes` (elements, counted as f32): consecutive tensors stay
/// together while their bytes fit in `bytes`; one larger than a bucket has its own.
pub fn assign(sizes: &[usize], bytes: usize) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut used = 0usize;
    for (i, &n) in sizes.iter().enumerate() {
        let b = n * std::mem::size_of::<f32>();
        match out.last_mut() {
            Some(r) if used + b <= bytes => {
                r.end = i + 1;
                used += b;
            }
            _ => {
                out.push(i..i + 1);
                used = b;
            }
        }
    }
    out
}

/// How one model's gradients travel: each trainable parameter (id and dimensions) in
/// the order the backward pass makes its gradient, grouped into buckets, and the
/// format they travel in.
#[derive(Debug, Clone)]
pub struct BucketPlan {
    params: Vec<(ParamId, Vec<usize>)>,
    buckets: Vec<Range<usize>>,
    /// `Some(bf16)`: rounded for the exchange, widened back after it.
    wire: Option<FloatDType>,
}

impl BucketPlan {
    /// The plan for `model`'s trainable parameters; `bucket_bytes` 0 keeps every
    /// gradient on its own.
    pub fn new<B: Backend, M: burn::module::Module<B>>(
        model: &M,
        bucket_bytes: usize,
        wire: Option<FloatDType>,
    ) -> Self {
        struct Ids(Vec<(ParamId, Vec<usize>)>);
        impl<B: Backend> ModuleVisitor<B> for Ids {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                if p.is_require_grad() {
                    self.0.push((p.id, p.val().dims().to_vec()));
                }
            }
        }
        let mut ids = Ids(Vec::new());
        model.visit(&mut ids);
        let mut params = ids.0;
        params.reverse();
        let sizes: Vec<usize> = params.iter().map(|(_, d)| numel(d)).collect();
        let buckets = assign(&sizes, bucket_bytes);
        crate::detail!(
            "kiln: gradient exchange: {} tensors ({:.1} MiB in fp32) in {} bucket(s) of up to {} MiB{}",
            sizes.len(),
            sizes.iter().sum::<usize>() as f64 * 4.0 / (1 << 20) as f64,
            buckets.len(),
            bucket_bytes >> 20,
            if wire.is_some() { ", sent as bf16" } else { "" }
        );
        BucketPlan {
            buckets,
            params,
            wire,
        }
    }
}

/// The gradient of `id` (of dimensions `dims`), rank-erased, or zeros where this
/// replica has none, so every replica sends tensors of the same sizes.
fn take<B: Backend>(
    grads: &mut GradientsParams,
    id: ParamId,
    dims: &[usize],
    device: &B::Device,
) -> FloatTensor<B> {
    fn one<B: Backend, const D: usize>(
        grads: &mut GradientsParams,
        id: ParamId,
        dims: &[usize],
        device: &B::Device,
    ) -> FloatTensor<B> {
        let dims: [usize; D] = dims.try_into().expect("the parameter's rank");
        grads
            .remove::<B, D>(id)
            .unwrap_or_else(|| Tensor::zeros(dims, device))
            .into_primitive()
            .tensor()
    }
    match dims.len() {
        1 => one::<B, 1>(grads, id, dims, device),
        2 => one::<B, 2>(grads, id, dims, device),
        3 => one::<B, 3>(grads, id, dims, device),
        4 => one::<B, 4>(grads, id, dims, device),
        5 => one::<B, 5>(grads, id, dims, device),
        d => unreachable!("kiln's models have parameters of rank 1 to 5, not {d}"),
    }
}

/// Registers `t` (of `dims`) as the gradient of `id`.
fn put<B: Backend>(grads: &mut GradientsParams, id: ParamId, dims: &[usize], t: FloatTensor<B>) {
    fn one<B: Backend, const D: usize>(
        grads: &mut GradientsParams,
        id: ParamId,
        t: FloatTensor<B>,
    ) {
        grads.register::<B, D>(id, Tensor::from_primitive(TensorPrimitive::Float(t)));
    }
    match dims.len() {
        1 => one::<B, 1>(grads, id, t),
        2 => one::<B, 2>(grads, id, t),
        3 => one::<B, 3>(grads, id, t),
        4 => one::<B, 4>(grads, id, t),
        5 => one::<B, 5>(grads, id, t),
        d => unreachable!("kiln's models have parameters of rank 1 to 5, not {d}"),
    }
}

/// `t` as a 1-D tensor (a view, no copy, for a contiguous `t`).
pub fn flat<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    let n = t.shape().num_elements();
    Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(t, Shape::new([n]))))
}

/// The piece `offset..offset + n` of `buffer`.
fn piece<B: Backend>(buffer: &Tensor<B, 1>, offset: usize, n: usize) -> Tensor<B, 1> {
    if offset == 0 && buffer.dims()[0] == n {
        buffer.clone()
    } else {
        buffer.clone().narrow(0, offset, n)
    }
}

/// One buffer of `pieces`, in order.
fn concat<B: Backend>(mut pieces: Vec<Tensor<B, 1>>) -> Tensor<B, 1> {
    if pieces.len() == 1 {
        pieces.pop().expect("one piece")
    } else {
        Tensor::cat(pieces, 0)
    }
}

/// `grads` (this replica's, of the plan's model) summed over every replica.
pub fn sum_grads<B: AutodiffBackend>(
    exchange: &mut dyn Exchange<B::InnerBackend>,
    mut grads: GradientsParams,
    plan: &BucketPlan,
    device: &B::Device,
    during: &str,
) -> Result<GradientsParams, ExchangeError> {
    type Inner<B> = <B as AutodiffBackend>::InnerBackend;
    let buckets: Vec<Vec<FloatTensor<Inner<B>>>> = plan
        .buckets
        .iter()
        .map(|range| {
            plan.params[range.clone()]
                .iter()
                .map(|(id, dims)| take::<Inner<B>>(&mut grads, *id, dims, device))
                .collect()
        })
        .collect();
    let summed = match plan.wire {
        None => exchange.all_reduce_buckets(buckets, during)?,
        // Rounded for the exchange: each bucket joined, cast, summed, cast back.
        Some(dtype) => {
            let joined = buckets
                .iter()
                .map(|b| {
                    let flat = b.iter().map(|t| flat::<Inner<B>>(t.clone())).collect();
                    concat(flat).cast(dtype)
                })
                .collect();
            let sums = exchange.all_reduce(joined, during)?;
            sums.into_iter()
                .zip(&buckets)
                .map(|(sum, b)| {
                    let sum = if sum.dtype() == DType::F32 {
                        sum
                    } else {
                        sum.cast(FloatDType::F32)
                    };
                    let mut offset = 0;
                    b.iter()
                        .map(|t| {
                            let shape = t.shape();
                            let n = shape.num_elements();
                            let p = piece(&sum, offset, n);
                            offset += n;
                            Inner::<B>::float_reshape(p.into_primitive().tensor(), shape)
                        })
                        .collect()
                })
                .collect()
        }
    };
    let mut out = GradientsParams::new();
    for (range, bucket) in plan.buckets.iter().zip(summed) {
        for ((id, dims), t) in plan.params[range.clone()].iter().zip(bucket) {
            put::<Inner<B>>(&mut out, *id, dims, t);
        }
    }
    Ok(out)
}

/// The `set` of `model`'s tensors as buffers of up to `bucket_bytes`, in the modules'
/// order, on the inner backend.
fn pack<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    set: ParamSet,
    bucket_bytes: usize,
) -> Vec<Tensor<B::InnerBackend, 1>> {
    struct Pack<B: AutodiffBackend> {
        set: ParamSet,
        pieces: Vec<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Pack<B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let t = p.val();
            if self.set.wants(t.is_require_grad()) {
                let n = numel(&t.dims());
                self.pieces.push(t.inner().reshape([n]));
            }
        }
    }
    let mut p = Pack::<B> {
        set,
        pieces: Vec::new(),
    };
    model.visit(&mut p);
    let sizes: Vec<usize> = p.pieces.iter().map(|t| t.dims()[0]).collect();
    let mut pieces = p.pieces.into_iter();
    assign(&sizes, bucket_bytes)
        .into_iter()
        .map(|r| concat((&mut pieces).take(r.len()).collect()))
        .collect()
}

/// `model` with its `set` replaced by `buffers` (from [`pack`] of a module of the same
/// structure).
fn unpack<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: M,
    set: ParamSet,
    buffers: Vec<Tensor<B::InnerBackend, 1>>,
) -> M {
    struct Unpack<B: AutodiffBackend> {
        set: ParamSet,
        buffers: std::vec::IntoIter<Tensor<B::InnerBackend, 1>>,
        current: Option<Tensor<B::InnerBackend, 1>>,
        offset: usize,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for Unpack<B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (require_grad, dims) = {
                let t = param.val();
                (t.is_require_grad(), t.dims())
            };
            if !self.set.wants(require_grad) {
                return param;
            }
            let n = numel(&dims);
            if self
                .current
                .as_ref()
                .is_none_or(|c| self.offset == c.dims()[0])
            {
                self.current = self.buffers.next();
                self.offset = 0;
            }
            let bucket = self
                .current
                .as_ref()
                .expect("buffers of a module of the same structure");
            let t = piece(bucket, self.offset, n).reshape(dims);
            self.offset += n;
            let (id, _, mapper) = param.consume();
            let t = Tensor::from_inner(t).set_require_grad(require_grad);
            Param::from_mapped_value(id, t, mapper)
        }
    }
    let mut u = Unpack::<B> {
        set,
        buffers: buffers.into_iter(),
        current: None,
        offset: 0,
    };
    model.map(&mut u)
}

/// Buckets for weights and statistics: their transfer is rare, so a large bucket.
const MODULE_BUCKET: usize = 64 << 20;

/// `model` with replica 0's weights and BatchNorm statistics, on every replica:
/// replicas start equal whatever each one's initialisation gave.
pub fn share_module<B: AutodiffBackend, M: AutodiffModule<B>>(
    exchange: &mut dyn Exchange<B::InnerBackend>,
    model: M,
    during: &str,
) -> Result<M, ExchangeError> {
    if exchange.size() == 1 {
        return Ok(model);
    }
    // `valid` folds every thread's pending BatchNorm update into the shared value.
    let _ = model.valid();
    let buffers = exchange.broadcast(pack(&model, ParamSet::All, MODULE_BUCKET), during)?;
    Ok(unpack(model, ParamSet::All, buffers))
}

/// `model` with replica 0's trainable weights (`dp`: the main replica stepped alone).
pub fn share_trainable<B: AutodiffBackend, M: AutodiffModule<B>>(
    exchange: &mut dyn Exchange<B::InnerBackend>,
    model: M,
    during: &str,
) -> Result<M, ExchangeError> {
    if exchange.size() == 1 {
        return Ok(model);
    }
    let packed = pack(&model, ParamSet::Trainable, MODULE_BUCKET);
    let buffers = exchange.broadcast(packed, during)?;
    if exchange.rank() == 0 {
        return Ok(model);
    }
    Ok(unpack(model, ParamSet::Trainable, buffers))
}

/// `model` with BatchNorm's running statistics averaged over the replicas. They are
/// an exponential average, which is linear: the mean of the replicas' averages is the
/// average of the mean statistics, so averaging them before each evaluation and
/// checkpoint makes them identical everywhere without exchanging them every step.
pub fn mean_buffers<B: AutodiffBackend, M: AutodiffModule<B>>(
    exchange: &mut dyn Exchange<B::InnerBackend>,
    model: M,
    during: &str,
) -> Result<M, ExchangeError> {
    if exchange.size() == 1 {
        return Ok(model);
    }
    let _ = model.valid();
    let n = exchange.size() as f64;
    let sums = exchange.all_reduce(pack(&model, ParamSet::Buffers, MODULE_BUCKET), during)?;
    let means = sums.into_iter().map(|s| s.div_scalar(n)).collect();
    Ok(unpack(model, ParamSet::Buffers, means))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, Stem};
    use crate::model::ModelSpec;
    use crate::test_util::{TestBackend, device, rng_lock};

    #[test]
    fn buckets_keep_consecutive_tensors_together_while_they_fit() {
        // Sizes in f32 elements: 4 bytes each.
        let sizes = [256, 256, 1024, 10, 10];
        assert_eq!(assign(&sizes, 0), [0..1, 1..2, 2..3, 3..4, 4..5]);
        assert_eq!(assign(&sizes, 2048), [0..2, 2..3, 3..5]);
        assert_eq!(assign(&sizes, 4136), [0..2, 2..4, 4..5]);
        assert_eq!(assign(&sizes, 64 << 20), vec![(0..5)]);
        assert!(assign(&[], 1024).is_empty());
    }

    #[test]
    fn a_plan_lists_gradients_in_backward_order() {
        let _rng = rng_lock();
        let model = ModelSpec::new(Arch::Tiny, Stem::Small, 3, 3, 8).init::<TestBackend>(&device());
        let plan = BucketPlan::new(&model, 0, None);
        let mut visited = Vec::new();
        struct Ids<'a>(&'a mut Vec<ParamId>);
        impl<B: Backend> ModuleVisitor<B> for Ids<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                if p.is_require_grad() {
                    self.0.push(p.id);
                }
            }
        }
        burn::module::Module::visit(&model, &mut Ids(&mut visited));
        visited.reverse();
        let planned: Vec<ParamId> = plan.params.iter().map(|(id, _)| *id).collect();
        assert_eq!(planned, visited);
        assert_eq!(plan.buckets.len(), visited.len());
        assert_eq!(BucketPlan::new(&model, 64 << 20, None).buckets.len(), 1);
    }

    use crate::train::exchange::HostBoard;
    use burn::module::Module;

    fn all<M: Module<TestBackend>>(m: &M) -> Vec<f32> {
        struct Collect(Vec<f32>);
        impl<B: Backend> ModuleVisitor<B> for Collect {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                self.0.extend(p.val().into_data().to_vec::<f32>().unwrap());
            }
        }
        let mut c = Collect(Vec::new());
        m.visit(&mut c);
        c.0
    }

    #[test]
    fn a_module_unpacks_into_another_whatever_the_buckets() {
        let _rng = rng_lock();
        let spec = ModelSpec::new(Arch::Tiny, Stem::Small, 3, 3, 8);
        let a = spec.init::<TestBackend>(&device());
        for bytes in [0, 4096, 64 << 20] {
            let b = spec.init::<TestBackend>(&device());
            assert_ne!(all(&a), all(&b));
            let packed = pack(&a, ParamSet::All, bytes);
            let b = unpack(b, ParamSet::All, packed);
            assert_eq!(all(&a), all(&b), "{bytes} bytes");
        }
    }

    /// `f` on `n` threads, each with its end of one host board.
    fn on_replicas<T: Send>(
        n: usize,
        f: impl Fn(&mut dyn Exchange<<TestBackend as AutodiffBackend>::InnerBackend>) -> T + Sync,
    ) -> Vec<T> {
        let board = HostBoard::new(n);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    let (board, f) = (board.clone(), &f);
                    s.spawn(move || f(&mut board.exchange(rank)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn gradients_summed_over_replicas_keep_their_parameters_and_shapes() {
        let _rng = rng_lock();
        let model = ModelSpec::new(Arch::Tiny, Stem::Small, 3, 3, 8).init::<TestBackend>(&device());
        let x = Tensor::<TestBackend, 4>::random(
            [4, 3, 8, 8],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device(),
        );
        let grads =
            || GradientsParams::from_grads(model.forward(x.clone()).sum().backward(), &model);
        let plan_all = BucketPlan::new(&model, 64 << 20, None);
        let flat = |g: GradientsParams, plan: &BucketPlan| -> Vec<f32> {
            let mut g = g;
            plan.params
                .iter()
                .flat_map(|(id, dims)| {
                    type Inner = <TestBackend as AutodiffBackend>::InnerBackend;
                    let t = take::<Inner>(&mut g, *id, dims, &device());
                    flat::<Inner>(t).into_data().to_vec::<f32>().unwrap()
                })
                .collect()
        };
        let once = flat(grads(), &plan_all);
        assert!(once.iter().any(|v| *v != 0.0));
        for (bytes, wire) in [
            (0, None),
            (4096, None),
            (64 << 20, None),
            (4096, Some(FloatDType::BF16)),
        ] {
            let plan = BucketPlan::new(&model, bytes, wire);
            let sums = on_replicas(3, |ex| {
                let g = sum_grads::<TestBackend>(ex, grads(), &plan, &device(), "step 1").unwrap();
                flat(g, &plan_all)
            });
            for got in &sums {
                assert_eq!(got.len(), once.len());
                for (g, o) in got.iter().zip(&once) {
                    let expected = match wire {
                        // Each replica's gradient rounded to bf16, summed in f32.
                        Some(_) => 3.0 * burn::tensor::bf16::from_f32(*o).to_f32(),
                        None => o + o + o,
                    };
                    assert_eq!(*g, expected, "{bytes} bytes, {wire:?}");
                }
            }
        }
    }

    #[test]
    fn replicas_start_from_replica_0s_module_and_average_their_statistics() {
        let _rng = rng_lock();
        let spec = ModelSpec::new(Arch::Tiny, Stem::Small, 3, 3, 8);
        let models: Vec<_> = (0..2)
            .map(|_| spec.init::<TestBackend>(&device()))
            .collect();
        let first = all(&models[0]);
        let shared = on_replicas(2, |ex| {
            let m = models[ex.rank()].clone();
            all(&share_module::<TestBackend, _>(ex, m, "the start").unwrap())
        });
        assert_eq!(shared, vec![first.clone(), first]);
        // Running statistics moved differently on each replica average out.
        let stats = on_replicas(2, |ex| {
            let rank = ex.rank();
            let m = share_module::<TestBackend, _>(ex, models[rank].clone(), "the start").unwrap();
            let x = Tensor::<TestBackend, 4>::ones([4, 3, 8, 8], &device()) * (rank as f32 + 1.0);
            let _ = m.forward(x);
            let _ = m.valid();
            let read =
                |v: Vec<Tensor<<TestBackend as AutodiffBackend>::InnerBackend, 1>>| -> Vec<f32> {
                    v.into_iter()
                        .flat_map(|t| t.into_data().to_vec::<f32>().unwrap())
                        .collect()
                };
            let own = read(pack(&m, ParamSet::Buffers, 0));
            let mean = mean_buffers::<TestBackend, _>(ex, m, "step 1").unwrap();
            (own, read(pack(&mean, ParamSet::Buffers, 0)))
        });
        let (own0, mean0) = (&stats[0].0, &stats[0].1);
        let (own1, mean1) = (&stats[1].0, &stats[1].1);
        assert_ne!(own0, own1);
        assert_eq!(mean0, mean1);
        for ((a, b), m) in own0.iter().zip(own1).zip(mean0) {
            assert!((m - (a + b) / 2.0).abs() < 1e-6, "{m} vs {a} {b}");
        }
    }
}
