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

/// How many bytes of consecutive tensors share one read-back or upload
/// (`train.transfer_bucket_mib`). Each transfer is a device synchronisation, so few
/// are cheaper, but on two H200s one 45 MB piece per transfer measured slower than one
/// transfer per tensor (BENCHMARKS.md); 0 keeps every tensor on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Buckets {
    pub bytes: usize,
}

impl Buckets {
    pub fn mib(mib: u64) -> Self {
        Buckets {
            bytes: (mib as usize).saturating_mul(1 << 20),
        }
    }

    /// The bucket of each tensor of `sizes` (elements, f32): consecutive tensors stay
    /// together while their bytes fit, and a tensor larger than a bucket has its own.
    fn assign(&self, sizes: &[usize]) -> Vec<usize> {
        let mut out = Vec::with_capacity(sizes.len());
        let (mut bucket, mut used) = (0, 0usize);
        for (i, &n) in sizes.iter().enumerate() {
            let bytes = n * std::mem::size_of::<f32>();
            if i > 0 && used + bytes > self.bytes {
                bucket += 1;
                used = 0;
            }
            used += bytes;
            out.push(bucket);
        }
        out
    }
}

/// Tensors in host memory, in visiting order, concatenated per bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct Flat(Vec<TensorData>);

impl Flat {
    /// Also returns the bucket of each piece.
    fn of<B: Backend>(pieces: Vec<Tensor<B, 1>>, buckets: Buckets) -> (Self, Vec<usize>) {
        let sizes: Vec<usize> = pieces.iter().map(|t| t.dims()[0]).collect();
        let assigned = buckets.assign(&sizes);
        let mut groups: Vec<Vec<Tensor<B, 1>>> = Vec::new();
        for (t, &b) in pieces.into_iter().zip(&assigned) {
            if groups.len() <= b {
                groups.push(Vec::new());
            }
            groups[b].push(t);
        }
        let flat = Flat(
            groups
                .into_iter()
                .map(|mut g| match g.len() {
                    1 => g.pop().expect("one tensor").into_data(),
                    _ => Tensor::cat(g, 0).into_data(),
                })
                .collect(),
        );
        (flat, assigned)
    }

    fn len(&self) -> usize {
        self.0.iter().map(|d| numel(&d.shape)).sum()
    }

    /// Every bucket's numbers, for a collective to change in place.
    pub fn slices_mut(&mut self) -> Vec<&mut [f32]> {
        self.0
            .iter_mut()
            .map(|d| {
                d.as_mut_slice::<f32>()
                    .expect("float tensors read back as f32")
            })
            .collect()
    }

    fn upload<B: Backend>(&self, device: &B::Device) -> Vec<Tensor<B, 1>> {
        self.0
            .iter()
            .map(|d| Tensor::from_data(d.clone(), device))
            .collect()
    }
}

/// Elements of a tensor of these dimensions.
fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// The piece `offset..offset + numel(dims)` of `bucket`, shaped as `dims`.
fn piece<B: Backend, const D: usize>(
    bucket: &Tensor<B, 1>,
    offset: usize,
    dims: [usize; D],
) -> Tensor<B, D> {
    let n = numel(&dims);
    if offset == 0 && bucket.dims()[0] == n {
        return bucket.clone().reshape(dims);
    }
    bucket.clone().narrow(0, offset, n).reshape(dims)
}

/// Walks uploaded buckets in visiting order, handing out one tensor after the other.
struct Cursor<B: Backend> {
    buckets: Vec<Tensor<B, 1>>,
    bucket: usize,
    offset: usize,
}

impl<B: Backend> Cursor<B> {
    fn next<const D: usize>(&mut self, dims: [usize; D]) -> Tensor<B, D> {
        let n = numel(&dims);
        if self.offset == self.buckets[self.bucket].dims()[0] {
            self.bucket += 1;
            self.offset = 0;
        }
        let b = &self.buckets[self.bucket];
        assert!(
            self.offset + n <= b.dims()[0],
            "a snapshot of a module of the same structure"
        );
        let t = piece(b, self.offset, dims);
        self.offset += n;
        t
    }

    fn finished(&self) -> bool {
        self.buckets.is_empty()
            || self.bucket + 1 == self.buckets.len()
                && self.offset == self.buckets[self.bucket].dims()[0]
    }
}

/// The `part` of `model` (an autodiff module: only there do tensors say whether they
/// are trained) in host memory, in visiting order. BatchNorm updates still pending
/// are left out: [`buffers`] folds them in first.
pub fn snapshot<B: Backend, M: Module<B>>(model: &M, part: Part, buckets: Buckets) -> Flat {
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
    Flat::of(s.pieces, buckets).0
}

/// BatchNorm running statistics of `model`, pending updates included.
pub fn buffers<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M, buckets: Buckets) -> Flat {
    // `valid` folds every thread's pending update into the shared value.
    let _ = model.valid();
    snapshot(model, Part::Buffers, buckets)
}

/// `model` with its `part` replaced by `flat` (from [`snapshot`] of a module of the
/// same structure), uploaded to `device` one bucket at a time.
pub fn load<B: Backend, M: Module<B>>(model: M, flat: &Flat, part: Part, device: &B::Device) -> M {
    if flat.len() == 0 {
        return model;
    }
    struct Load<B: Backend> {
        part: Part,
        cursor: Cursor<B>,
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
            let t = self.cursor.next(dims).set_require_grad(require_grad);
            Param::from_mapped_value(id, t, mapper)
        }
    }
    let mut l = Load::<B> {
        part,
        cursor: Cursor {
            buckets: flat.upload(device),
            bucket: 0,
            offset: 0,
        },
    };
    let model = model.map(&mut l);
    assert!(
        l.cursor.finished(),
        "a snapshot of a module of the same structure"
    );
    model
}

/// An independent copy of `model` on `device`: same parameter ids, its own BatchNorm
/// running statistics (not shared with `model`, unlike `Clone`).
pub fn replica<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    device: &B::Device,
    buckets: Buckets,
) -> M {
    let stats = buffers(model, buckets);
    let trainable = snapshot(model, Part::Trainable, buckets);
    // `from_inner` makes new running-statistics cells; the uploads put it on `device`.
    let fresh = M::from_inner(model.valid());
    let fresh = load(fresh, &trainable, Part::Trainable, device);
    load(fresh, &stats, Part::Buffers, device)
}

/// Gradients of one replica in host memory, in visiting order, concatenated per bucket.
#[derive(Clone)]
pub struct HostGrads {
    flat: Flat,
    /// Each parameter's bucket and offset in it.
    index: HashMap<ParamId, (usize, usize)>,
}

impl HostGrads {
    /// Reads `grads` (of `model`'s parameters) back to the host.
    pub fn read<B: AutodiffBackend, M: AutodiffModule<B>>(
        mut grads: GradientsParams,
        model: &M,
        buckets: Buckets,
    ) -> Self {
        collect::<B, M>(model, &mut grads, buckets)
    }

    /// Every bucket's numbers, for a collective to change in place.
    pub fn slices_mut(&mut self) -> Vec<&mut [f32]> {
        self.flat.slices_mut()
    }

    /// Uploads all gradients to `device`, one bucket at a time.
    pub fn upload<B: Backend>(&self, device: &B::Device) -> DeviceGrads<B> {
        DeviceGrads {
            buckets: self.flat.upload(device),
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

impl Flat {
    /// The element-wise sum of several snapshots of the same tensors, in the order given
    /// (float addition is not associative: the same order gives the same numbers every
    /// run). `None` when their buckets differ. It is on the critical path of every `ddp`
    /// step, so a few threads share it.
    fn sum(parts: &[&Flat]) -> Option<Flat> {
        let first = parts.first()?;
        let slices: Vec<Vec<&[f32]>> = parts
            .iter()
            .map(|p| {
                p.0.iter()
                    .map(|d| d.as_slice::<f32>().ok())
                    .collect::<Option<Vec<_>>>()
            })
            .collect::<Option<_>>()?;
        let lens: Vec<usize> = slices[0].iter().map(|s| s.len()).collect();
        if slices
            .iter()
            .any(|p| p.len() != lens.len() || p.iter().zip(&lens).any(|(s, n)| s.len() != *n))
        {
            return None;
        }
        let mut out: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n]).collect();
        // Pieces of at most CHUNK elements: (destination, bucket, offset).
        const CHUNK: usize = 1 << 18;
        let mut pieces: Vec<(&mut [f32], usize, usize)> = Vec::new();
        for (b, o) in out.iter_mut().enumerate() {
            for (k, c) in o.chunks_mut(CHUNK).enumerate() {
                pieces.push((c, b, k * CHUNK));
            }
        }
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 8)
            .min(pieces.len().max(1));
        let mut groups: Vec<Vec<(&mut [f32], usize, usize)>> =
            (0..threads).map(|_| Vec::new()).collect();
        for (i, p) in pieces.into_iter().enumerate() {
            groups[i % threads].push(p);
        }
        let slices = &slices;
        std::thread::scope(|s| {
            for group in groups {
                s.spawn(move || {
                    for (dst, b, off) in group {
                        let range = off..off + dst.len();
                        dst.copy_from_slice(&slices[0][b][range.clone()]);
                        for part in &slices[1..] {
                            dst.iter_mut()
                                .zip(&part[b][range.clone()])
                                .for_each(|(d, x)| *d += x);
                        }
                    }
                });
            }
        });
        Some(Flat(
            out.into_iter()
                .zip(&first.0)
                .map(|(v, d)| TensorData::new(v, d.shape.clone()))
                .collect(),
        ))
    }
}

impl HostGrads {
    /// The element-wise sum of several replicas' gradients, in the order given. `None`
    /// when they are not gradients of the same parameters in the same buckets.
    pub fn sum(parts: &[HostGrads]) -> Option<HostGrads> {
        let (first, rest) = parts.split_first()?;
        if rest.iter().any(|p| p.index != first.index) {
            return None;
        }
        let flats: Vec<&Flat> = parts.iter().map(|p| &p.flat).collect();
        Some(HostGrads {
            flat: Flat::sum(&flats)?,
            index: first.index.clone(),
        })
    }
}

/// The gradients of `model`'s parameters, flattened, concatenated per bucket in visiting
/// order and read back one bucket at a time.
fn collect<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    source: &mut GradientsParams,
    buckets: Buckets,
) -> HostGrads {
    struct Col<'a, B: AutodiffBackend> {
        source: &'a mut GradientsParams,
        pieces: Vec<Tensor<B::InnerBackend, 1>>,
        ids: Vec<ParamId>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Col<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.source.remove::<B::InnerBackend, D>(param.id) {
                let n = numel(&g.dims());
                self.ids.push(param.id);
                self.pieces.push(g.reshape([n]));
            }
        }
    }
    let mut c = Col::<B> {
        source,
        pieces: Vec::new(),
        ids: Vec::new(),
    };
    model.visit(&mut c);
    let sizes: Vec<usize> = c.pieces.iter().map(|t| t.dims()[0]).collect();
    let (flat, assigned) = Flat::of(c.pieces, buckets);
    let mut index = HashMap::new();
    let mut at = (usize::MAX, 0);
    for ((id, n), b) in c.ids.iter().zip(&sizes).zip(assigned) {
        if at.0 != b {
            at = (b, 0);
        }
        index.insert(*id, at);
        at.1 += n;
    }
    HostGrads { flat, index }
}

/// Gradients uploaded bucket by bucket; each parameter's is a slice of its bucket.
pub struct DeviceGrads<B: Backend> {
    buckets: Vec<Tensor<B, 1>>,
    index: HashMap<ParamId, (usize, usize)>,
}

impl<B: Backend> DeviceGrads<B> {
    pub fn take<const D: usize>(&self, id: ParamId, dims: [usize; D]) -> Option<Tensor<B, D>> {
        self.index
            .get(&id)
            .map(|&(bucket, offset)| piece(&self.buckets[bucket], offset, dims))
    }
}

/// Element-wise mean of several snapshots of the same tensors (f32 on the host), in
/// the order given, so every run computes the same numbers.
pub fn mean(snapshots: &[Flat]) -> Flat {
    let n = snapshots.len() as f32;
    let all: Vec<&Flat> = snapshots.iter().collect();
    let mut sum = Flat::sum(&all).expect("snapshots of the same float tensors");
    for b in &mut sum.0 {
        let mut v = b.to_vec::<f32>().expect("float tensors");
        v.iter_mut().for_each(|a| *a /= n);
        *b = TensorData::new(v, b.shape.clone());
    }
    sum
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
        let copy = replica(&model, &device(), Buckets::default());
        assert_eq!(
            snapshot(&model, Part::Trainable, Buckets::default()),
            snapshot(&copy, Part::Trainable, Buckets::default())
        );
        let before = buffers(&model, Buckets::default());
        assert!(before.len() > 0);
        // Training-mode forward passes on the copy move only its own statistics.
        let x = Tensor::<TestBackend, 4>::ones([4, 3, 8, 8], &device());
        let _ = copy.forward(x);
        assert_eq!(buffers(&model, Buckets::default()), before);
        assert_ne!(buffers(&copy, Buckets::default()), before);
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
    fn a_snapshot_loads_into_another_model_whatever_the_buckets() {
        let _rng = rng_lock();
        let spec = ModelSpec::new(Arch::Tiny, Stem::Small, 3, 3, 8);
        let a = spec.init::<TestBackend>(&device());
        for buckets in [
            Buckets::default(),
            Buckets { bytes: 4096 },
            Buckets::mib(64),
        ] {
            let b = spec.init::<TestBackend>(&device());
            let whole = |m: &crate::model::ResNet<TestBackend>| {
                snapshot(m, Part::Trainable, Buckets::mib(64))
            };
            assert_ne!(whole(&a), whole(&b));
            let b = load(
                b,
                &snapshot(&a, Part::Trainable, buckets),
                Part::Trainable,
                &device(),
            );
            assert_eq!(whole(&a), whole(&b), "{buckets:?}");
        }
    }

    #[test]
    fn the_host_sum_of_large_buckets_adds_in_replica_order() {
        // Larger than the pieces the threads take, and not a multiple of them.
        let n = 600_001;
        let part = |k: f32| HostGrads {
            flat: Flat(vec![
                TensorData::new(
                    (0..n).map(|i| k * i as f32 + 0.1).collect::<Vec<f32>>(),
                    [n],
                ),
                TensorData::new(vec![k; 3], [3]),
            ]),
            index: HashMap::new(),
        };
        let parts = [part(1.0), part(0.5), part(-0.25)];
        let sum = HostGrads::sum(&parts).unwrap();
        let big = sum.flat.0[0].to_vec::<f32>().unwrap();
        for i in [0, 1, 262_143, 262_144, 524_288, n - 1] {
            let x = i as f32;
            let expected = (1.0 * x + 0.1) + (0.5 * x + 0.1) + (-0.25 * x + 0.1);
            assert_eq!(big[i], expected, "element {i}");
        }
        assert_eq!(sum.flat.0[1].to_vec::<f32>().unwrap(), vec![1.25f32; 3]);
        let short = HostGrads {
            flat: Flat(vec![TensorData::new(vec![0.0f32; n], [n])]),
            index: HashMap::new(),
        };
        assert!(HostGrads::sum(&[part(1.0), short]).is_none());
    }

    #[test]
    fn mean_of_snapshots_is_element_wise() {
        let flat = |v: [&[f32]; 2]| {
            Flat(
                v.iter()
                    .map(|b| TensorData::new(b.to_vec(), [b.len()]))
                    .collect(),
            )
        };
        let a = flat([&[1.0, 2.0], &[5.0]]);
        let b = flat([&[3.0, 6.0], &[7.0]]);
        assert_eq!(mean(&[a, b]), flat([&[2.0, 4.0], &[6.0]]));
    }

    #[test]
    fn buckets_keep_consecutive_tensors_together_while_they_fit() {
        // Sizes in f32 elements: 4 bytes each.
        let sizes = [256, 256, 1024, 10, 10];
        assert_eq!(Buckets::default().assign(&sizes), [0, 1, 2, 3, 4]);
        assert_eq!(Buckets { bytes: 2048 }.assign(&sizes), [0, 0, 1, 2, 2]);
        assert_eq!(Buckets { bytes: 4136 }.assign(&sizes), [0, 0, 1, 1, 2]);
        assert_eq!(Buckets::mib(64).assign(&sizes), [0; 5]);
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
        let grads =
            || GradientsParams::from_grads(model.forward(x.clone()).sum().backward(), &model);
        let whole = HostGrads::read(grads(), &model, Buckets::mib(64));
        assert_eq!(whole.flat.0.len(), 1);
        for buckets in [
            Buckets::default(),
            Buckets { bytes: 4096 },
            Buckets::mib(64),
        ] {
            let host = HostGrads::read(grads(), &model, buckets);
            let back = host.clone().into_params(&model, &device());
            assert!(!host.index.is_empty());
            let again = HostGrads::read(back, &model, Buckets::mib(64));
            assert_eq!(again.flat, whole.flat, "{buckets:?}");
            assert_eq!(again.index.len(), host.index.len());
            // The sum over replicas, made on the host.
            let twice = HostGrads::sum(&[host.clone(), host.clone()]).unwrap();
            let twice = HostGrads::read(
                twice.into_params(&model, &device()),
                &model,
                Buckets::mib(64),
            );
            let doubled: Vec<f32> = whole.flat.0[0]
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v * 2.0)
                .collect();
            assert_eq!(twice.flat.0[0].to_vec::<f32>().unwrap(), doubled);
            if buckets != Buckets::mib(64) {
                assert!(HostGrads::sum(&[host, whole.clone()]).is_none());
            }
        }
        let per_tensor = HostGrads::read(grads(), &model, Buckets::default());
        assert_eq!(per_tensor.flat.0.len(), per_tensor.index.len());
    }
}
