//! [`SgdBackend`] on CUDA: one kernel steps up to 32 parameters of one vector width (a
//! cubecl `Sequence` of tensors, one cube row per parameter), a handful of launches per
//! model instead of about nine tensor operations per parameter.
//!
//! The kernel steps a parameter, its gradient and its velocity element by element
//! through their buffers, so it needs only that the three fill their buffers without
//! gaps in one same order of their axes, not that the order be the standard one. In
//! channels-last the convolutions' weight gradients arrive as KCRS views of KRSC
//! buffers; the step then lays the parameter and its velocity out the same way (once),
//! so that the next forward pass's KRSC view of the weight is contiguous and neither
//! it nor the gradient is copied again on any later step.

use std::collections::BTreeMap;

use burn::cubecl::cuda::CudaRuntime;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::permute;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::norm_kernels::widest_vector;
use crate::ops::sgd::{SgdBackend, SgdStep, Stepped, step_reference};

/// Parameters stepped by one launch at most: each brings five buffers (three read,
/// two written) to the kernel's arguments, and each its branch to the kernel's code.
const GROUP: usize = 32;

/// One SGD step of up to [`GROUP`] parameters of one vector width: cube row `y`
/// steps parameter `y` (a branch per parameter, unrolled: a sequence is indexed at
/// compile time), its cubes striding over its elements. Weight decay, momentum,
/// update, in Burn's `Sgd`'s order. `velocities` is empty on the first step with
/// momentum; both velocity sequences are empty without momentum.
///
/// Parameters and velocities are written in place where nothing else holds them
/// ([`in_place_or_new`]): they are taken as `&mut` although the kernel only reads them,
/// so that cubecl does not declare them read-only (`const __restrict__`), which a
/// write to the same buffer through the outputs would break.
#[cube(launch)]
fn sgd_group_kernel<N: Size>(
    params: &mut Sequence<Tensor<Vector<f32, N>>>,
    grads: &Sequence<Tensor<Vector<f32, N>>>,
    velocities: &mut Sequence<Tensor<Vector<f32, N>>>,
    new_params: &mut Sequence<Tensor<Vector<f32, N>>>,
    new_velocities: &mut Sequence<Tensor<Vector<f32, N>>>,
    lens: &Sequence<usize>,
    lr: f32,
    momentum: f32,
    dampening: f32,
    weight_decay: f32,
    #[comptime] decay: bool,
    #[comptime] with_momentum: bool,
    #[comptime] first: bool,
    #[comptime] nesterov: bool,
) {
    let count = comptime![params.len()];
    let stride = CUBE_COUNT_X as usize * CUBE_DIM_X as usize;
    #[unroll]
    for t in 0..count {
        if CUBE_POS_Y as usize == t {
            let len = lens[t];
            let mut i = ABSOLUTE_POS_X as usize;
            while i < len {
                let p = params.index(t)[i];
                let mut g = grads.index(t)[i];
                if comptime!(decay) {
                    g = p * Vector::new(weight_decay) + g;
                }
                if comptime!(with_momentum) {
                    let mut v = g;
                    if comptime!(!first) {
                        v = g * Vector::new(f32::new(1.0) - dampening)
                            + velocities.index(t)[i] * Vector::new(momentum);
                    }
                    new_velocities.index_mut(t)[i] = v;
                    if comptime!(nesterov) {
                        g = v * Vector::new(momentum) + g;
                    } else {
                        g = v;
                    }
                }
                new_params.index_mut(t)[i] = p - g * Vector::new(lr);
                i += stride;
            }
        }
    }
}

/// Threads per cube of [`sgd_group_kernel`].
const THREADS: u32 = 256;

/// Strides of a tensor of `shape` whose buffer holds its axes in `order`, outermost
/// first.
fn strides_in_order(shape: &[usize], order: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut step = 1;
    for &axis in order.iter().rev() {
        strides[axis] = step;
        step *= shape[axis];
    }
    strides
}

/// The order of the axes (outermost first) in which a tensor of `shape` and `strides`
/// fills its buffer without gaps: a contiguous tensor or a permuted view of one.
/// `None` for any other view. Axes of size one may sit anywhere.
fn dense_order(shape: &[usize], strides: &[usize]) -> Option<Vec<usize>> {
    let mut order: Vec<usize> = (0..shape.len()).collect();
    order.sort_by_key(|&a| std::cmp::Reverse(strides[a]));
    laid_out_in(shape, strides, &order).then_some(order)
}

/// Whether a tensor of `shape` and `strides` holds its axes in `order`, densely.
fn laid_out_in(shape: &[usize], strides: &[usize], order: &[usize]) -> bool {
    let dense = strides_in_order(shape, order);
    (0..shape.len()).all(|a| shape[a] == 1 || strides[a] == dense[a])
}

/// The order all three buffers of one parameter's step take: the gradient's where the
/// parameter still has the standard one (so a parameter follows its gradient's
/// layout once, and then keeps it), else the parameter's own where it has one, else
/// the standard order.
fn step_order(shape: &[usize], param_strides: &[usize], grad_strides: &[usize]) -> Vec<usize> {
    let standard: Vec<usize> = (0..shape.len()).collect();
    if laid_out_in(shape, param_strides, &standard) {
        return dense_order(shape, grad_strides).unwrap_or(standard);
    }
    dense_order(shape, param_strides).unwrap_or(standard)
}

/// `t` laid out densely with its axes in `order`: `t` itself where it already is,
/// else a copy.
fn in_order<R: CubeRuntime>(t: CubeTensor<R>, order: &[usize]) -> CubeTensor<R> {
    if laid_out_in(t.meta.shape(), t.meta.strides(), order) {
        return t;
    }
    let mut inverse = vec![0; order.len()];
    for (i, &a) in order.iter().enumerate() {
        inverse[a] = i;
    }
    permute(into_contiguous(permute(t, order)), &inverse)
}

/// An f32 tensor of `t`'s shape and strides (which are dense) on its device.
fn empty_like<R: CubeRuntime>(t: &CubeTensor<R>) -> CubeTensor<R> {
    let bytes = t.meta.shape().num_elements() * DType::F32.size();
    CubeTensor::new(
        t.client.clone(),
        t.client.empty(bytes),
        (*t.meta).clone(),
        t.device.clone(),
        DType::F32,
    )
}

/// `t`'s buffer as the flat vector sequence the kernel walks (its layout is dense and
/// shared by every tensor of the parameter's step, so the kernel needs no strides).
fn flat_arg<R: CubeRuntime>(t: &CubeTensor<R>) -> TensorArg<R> {
    let n = t.meta.shape().num_elements();
    CubeTensor::new_contiguous(
        t.client.clone(),
        t.device.clone(),
        Shape::new([n]),
        t.handle.clone(),
        t.dtype,
    )
    .into_tensor_arg()
}

/// Where `t`'s new value goes (`t` laid out as its step's other buffers, as
/// `step_grouped` makes them): `t`'s own buffer when nothing else holds it, else a
/// new one of the same layout. Each thread of the kernel reads an element before it
/// writes that element, so it may write where it reads; in place, a step holds each
/// parameter and velocity once instead of twice (with the gradient, three buffers per
/// parameter as in PyTorch, not five). A tensor held elsewhere too (a checkpoint
/// being written, a test's copy) keeps its values.
fn in_place_or_new<R: CubeRuntime>(t: &CubeTensor<R>) -> CubeTensor<R> {
    if t.can_mut() {
        t.clone()
    } else {
        empty_like(t)
    }
}

/// Steps every parameter, up to [`GROUP`] in one launch among those of one vector
/// width and with or without a velocity: a handful of launches per model instead
/// of one per parameter (161 for ResNet-50).
fn step_grouped<R: CubeRuntime>(
    params: Vec<CubeTensor<R>>,
    grads: Vec<CubeTensor<R>>,
    velocities: Vec<Option<CubeTensor<R>>>,
    step: SgdStep,
) -> (Vec<CubeTensor<R>>, Vec<Option<CubeTensor<R>>>) {
    let n = params.len();
    let with_momentum = step.momentum > 0.0;
    let parts: Vec<_> = params
        .into_iter()
        .zip(grads)
        .zip(velocities)
        .map(|((p, g), v)| {
            let vector = widest_vector(
                p.client.io_optimized_vector_sizes(DType::F32.size()),
                p.meta.shape().num_elements(),
            );
            let order = step_order(p.meta.shape(), p.meta.strides(), g.meta.strides());
            (
                in_order(p, &order),
                in_order(g, &order),
                v.map(|v| in_order(v, &order)),
                vector,
            )
        })
        .collect();
    // Ordered, so that the launches come in the same order every step.
    let mut groups: BTreeMap<(usize, bool), Vec<usize>> = BTreeMap::new();
    for (i, (_, _, v, vector)) in parts.iter().enumerate() {
        groups.entry((*vector, v.is_some())).or_default().push(i);
    }
    let mut new_params: Vec<Option<CubeTensor<R>>> = vec![None; n];
    let mut new_velocities: Vec<Option<CubeTensor<R>>> = vec![None; n];
    for ((vector, has_velocity), members) in groups {
        for chunk in members.chunks(GROUP) {
            let client = parts[chunk[0]].0.client.clone();
            let (mut p_in, mut g_in, mut v_in) =
                (SequenceArg::new(), SequenceArg::new(), SequenceArg::new());
            let (mut p_out, mut v_out, mut lens) =
                (SequenceArg::new(), SequenceArg::new(), SequenceArg::new());
            let mut longest = 0;
            for &i in chunk {
                let (p, g, v, _) = &parts[i];
                let len = p.meta.shape().num_elements() / vector;
                longest = longest.max(len);
                lens.push(len);
                let new_p = in_place_or_new(p);
                p_in.push(flat_arg(p));
                g_in.push(flat_arg(g));
                p_out.push(flat_arg(&new_p));
                new_params[i] = Some(new_p);
                // Without momentum the kernel reads and writes no velocity.
                if with_momentum {
                    let new_v = match v {
                        Some(v) => {
                            let new_v = in_place_or_new(v);
                            v_in.push(flat_arg(v));
                            new_v
                        }
                        None => empty_like(p),
                    };
                    v_out.push(flat_arg(&new_v));
                    new_velocities[i] = Some(new_v);
                }
            }
            // Enough cubes for the longest parameter up to a bound; past it the
            // cubes stride.
            let cubes = longest.div_ceil(THREADS as usize).clamp(1, 256) as u32;
            sgd_group_kernel::launch::<R>(
                &client,
                CubeCount::Static(cubes, chunk.len() as u32, 1),
                CubeDim::new_1d(THREADS),
                vector,
                p_in,
                g_in,
                v_in,
                p_out,
                v_out,
                lens,
                step.lr as f32,
                step.momentum as f32,
                step.dampening as f32,
                step.weight_decay as f32,
                step.weight_decay > 0.0,
                with_momentum,
                !has_velocity,
                step.nesterov,
            );
        }
    }
    let params = new_params
        .into_iter()
        .map(|p| p.expect("every parameter is in one group"))
        .collect();
    (params, new_velocities)
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> SgdBackend
    for CubeBackend<CudaRuntime, F, I, BT>
{
    fn sgd_step(
        params: Vec<FloatTensor<Self>>,
        grads: Vec<FloatTensor<Self>>,
        velocities: Vec<Option<FloatTensor<Self>>>,
        step: SgdStep,
    ) -> Stepped<Self> {
        let fits = params
            .iter()
            .zip(&grads)
            .zip(&velocities)
            .all(|((p, g), v)| {
                let same = |t: &CubeTensor<CudaRuntime>| {
                    t.dtype == DType::F32 && t.meta.shape() == p.meta.shape()
                };
                same(p) && same(g) && v.as_ref().is_none_or(same)
            });
        if !fits {
            return step_reference::<Self>(params, grads, velocities, step);
        }
        step_grouped(params, grads, velocities, step)
    }
}

/// The layout rules, on shapes and strides alone.
#[cfg(test)]
mod layout_tests {
    use super::*;

    // A KCRS weight [8, 4, 3, 3] and its KRSC buffer seen as KCRS.
    const SHAPE: [usize; 4] = [8, 4, 3, 3];
    const STANDARD: [usize; 4] = [36, 9, 3, 1];
    const KRSC: [usize; 4] = [36, 1, 12, 4];

    #[test]
    fn dense_views_are_told_from_others() {
        assert_eq!(dense_order(&SHAPE, &STANDARD), Some(vec![0, 1, 2, 3]));
        assert_eq!(dense_order(&SHAPE, &KRSC), Some(vec![0, 2, 3, 1]));
        assert_eq!(strides_in_order(&SHAPE, &[0, 2, 3, 1]), KRSC);
        // A slice (gaps between rows) and a broadcast (overlap) are not dense.
        assert_eq!(dense_order(&SHAPE, &[72, 9, 3, 1]), None);
        assert_eq!(dense_order(&SHAPE, &[0, 9, 3, 1]), None);
        // An axis of size one may carry any stride.
        assert_eq!(
            dense_order(&[4, 1, 3], &[3, 99, 1]).map(|o| o.len()),
            Some(3)
        );
    }

    #[test]
    fn a_parameter_follows_its_gradient_once_and_then_keeps_its_layout() {
        // Standard parameter, permuted gradient: both take the gradient's order.
        assert_eq!(step_order(&SHAPE, &STANDARD, &KRSC), vec![0, 2, 3, 1]);
        // Permuted parameter: a standard gradient is laid out as the parameter.
        assert_eq!(step_order(&SHAPE, &KRSC, &STANDARD), vec![0, 2, 3, 1]);
        assert_eq!(step_order(&SHAPE, &KRSC, &KRSC), vec![0, 2, 3, 1]);
        // A gradient with gaps leaves the standard order.
        assert_eq!(
            step_order(&SHAPE, &STANDARD, &[72, 9, 3, 1]),
            vec![0, 1, 2, 3]
        );
        assert_eq!(step_order(&SHAPE, &STANDARD, &STANDARD), vec![0, 1, 2, 3]);
    }
}

/// On a GPU only (`--ignored`): the CUDA kernels against Burn's operations.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::sgd::{SgdStep, step_reference};
    use burn::tensor::backend::Backend;
    use burn::tensor::ops::FloatTensor;
    use burn::tensor::{Tensor, TensorPrimitive};

    fn tensor<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
        Tensor::from_primitive(TensorPrimitive::Float(t))
    }
    use crate::test_util::rel_diff;
    use burn::backend::cuda::{Cuda, CudaDevice};
    use burn::tensor::Distribution;

    /// One flat tensor of standard normal values per shape.
    fn normal(shapes: &[Vec<usize>], dev: &CudaDevice) -> Vec<FloatTensor<Cuda>> {
        shapes
            .iter()
            .map(|s| {
                let n = s.iter().product::<usize>();
                Tensor::<Cuda, 1>::random([n], Distribution::Normal(0.0, 1.0), dev)
                    .into_primitive()
                    .tensor()
            })
            .collect()
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn sgd_kernels_match_burns_operations_on_the_gpu() {
        let dev = CudaDevice::new(0);
        // Shapes of no vector width, of vectors, a convolution weight's, and more of
        // one width than one launch steps.
        let mut shapes = vec![vec![5], vec![64], vec![32, 16, 3, 3], vec![7, 3]];
        shapes.extend((0..40).map(|i| vec![8 * (i + 1)]));
        let inputs = |seed: u64| {
            <Cuda as Backend>::seed(&dev, seed);
            (
                normal(&shapes, &dev),
                normal(&shapes, &dev),
                normal(&shapes, &dev),
            )
        };
        let values = |t: FloatTensor<Cuda>| tensor::<Cuda>(t).into_data().to_vec::<f32>().unwrap();
        for (momentum, nesterov, weight_decay, first) in [
            (0.9, false, 5e-4, true),
            (0.9, false, 5e-4, false),
            (0.9, true, 5e-4, false),
            (0.0, false, 5e-4, true),
            (0.9, false, 0.0, false),
        ] {
            let step = SgdStep {
                lr: 0.1,
                momentum,
                dampening: 0.0,
                nesterov,
                weight_decay,
            };
            let run = |kernels: bool| {
                let (p, g, v) = inputs(9);
                let v = v.into_iter().map(|v| (!first).then_some(v)).collect();
                if kernels {
                    <Cuda as SgdBackend>::sgd_step(p, g, v, step)
                } else {
                    step_reference::<Cuda>(p, g, v, step)
                }
            };
            let ((p1, v1), (p2, v2)) = (run(true), run(false));
            for (a, b) in p1.into_iter().zip(p2) {
                let rel = rel_diff(&values(a), &values(b));
                assert!(
                    rel < 1e-6,
                    "{step:?} first {first}: parameters differ by {rel}"
                );
            }
            for (a, b) in v1.into_iter().zip(v2) {
                assert_eq!(a.is_some(), b.is_some(), "{step:?}: velocities");
                if let (Some(a), Some(b)) = (a, b) {
                    let rel = rel_diff(&values(a), &values(b));
                    assert!(
                        rel < 1e-6,
                        "{step:?} first {first}: velocities differ by {rel}"
                    );
                }
            }
        }
    }

    /// Gradients that are permuted views of dense buffers (channels-last weight
    /// gradients) step their parameters as Burn's operations do, and the parameters
    /// and velocities come back in the gradients' layout, so that the next step copies
    /// nothing.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn sgd_kernels_take_permuted_gradients_on_the_gpu() {
        // The backend under fusion, whose tensors show their strides.
        type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
        let dev = CudaDevice::new(0);
        let shapes = [vec![16, 8, 3, 3], vec![12, 5, 1, 1], vec![6, 3, 7, 7]];
        let make = |seed: u64| {
            <Cube as Backend>::seed(&dev, seed);
            shapes
                .iter()
                .map(|s| {
                    let dims = [s[0], s[1], s[2], s[3]];
                    Tensor::<Cube, 4>::random(dims, Distribution::Normal(0.0, 1.0), &dev)
                        .into_primitive()
                        .tensor()
                })
                .collect::<Vec<_>>()
        };
        let krsc = |t: FloatTensor<Cube>| {
            let buffer = into_contiguous(permute(t, &[0, 2, 3, 1]));
            permute(buffer, &[0, 3, 1, 2])
        };
        let values = |t: FloatTensor<Cube>| {
            Tensor::<Cube, 4>::from_primitive(TensorPrimitive::Float(t))
                .into_data()
                .to_vec::<f32>()
                .unwrap()
        };
        let step = SgdStep {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 5e-4,
        };
        let (p, g1, g2) = (make(1), make(2), make(3));
        // The kernels on [K, C, R, S] views of [K, R, S, C] buffers; Burn's operations
        // on standard tensors.
        let grads = |ts: &[FloatTensor<Cube>], permuted: bool| {
            let ts = ts.iter().cloned();
            if permuted {
                ts.map(krsc).collect()
            } else {
                ts.collect::<Vec<_>>()
            }
        };
        // Two steps (the first makes the velocities).
        let run = |kernels: bool| {
            let go = |p, g, v| {
                if kernels {
                    <Cube as SgdBackend>::sgd_step(p, g, v, step)
                } else {
                    step_reference::<Cube>(p, g, v, step)
                }
            };
            let (p, v) = go(p.clone(), grads(&g1, kernels), vec![None; shapes.len()]);
            go(p, grads(&g2, kernels), v)
        };
        let (p_ref, v_ref) = run(false);
        let (p_ker, v_ker) = run(true);
        let check = |what: &str, i: usize, a: FloatTensor<Cube>, b: FloatTensor<Cube>| {
            let (shape, strides) = (a.meta.shape(), a.meta.strides());
            assert!(
                laid_out_in(shape, strides, &[0, 2, 3, 1]),
                "{what} {i} is not laid out as its gradient: {strides:?}"
            );
            let rel = rel_diff(&values(a), &values(b));
            assert!(rel < 1e-6, "{what} {i} differs by {rel}");
        };
        for (i, (a, b)) in p_ker.into_iter().zip(p_ref).enumerate() {
            check("parameter", i, a, b);
        }
        for (i, (a, b)) in v_ker.into_iter().zip(v_ref).enumerate() {
            check("velocity", i, a.unwrap(), b.unwrap());
        }
    }

    /// Parameters and velocities held elsewhere too keep their values (the step writes
    /// new buffers for them), and the step's results are the same either way.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn sgd_kernels_leave_tensors_held_elsewhere_untouched() {
        let dev = CudaDevice::new(0);
        let values = |t: FloatTensor<Cuda>| tensor::<Cuda>(t).into_data().to_vec::<f32>().unwrap();
        let make = |seed: u64| {
            <Cuda as Backend>::seed(&dev, seed);
            normal(&[vec![64], vec![32, 16, 3, 3], vec![5]], &dev)
        };
        let step = SgdStep {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: true,
            weight_decay: 5e-4,
        };
        let run = |hold: bool| {
            let (p, g, v) = (make(1), make(2), make(3));
            let held = hold.then(|| (p.clone(), v.clone()));
            let v = v.into_iter().map(Some).collect();
            let (p, v) = <Cuda as SgdBackend>::sgd_step(p, g, v, step);
            let p: Vec<_> = p.into_iter().map(values).collect();
            let v: Vec<_> = v.into_iter().map(|v| values(v.unwrap())).collect();
            let held = held.map(|(hp, hv)| {
                let hp: Vec<_> = hp.into_iter().map(values).collect();
                let hv: Vec<_> = hv.into_iter().map(values).collect();
                (hp, hv)
            });
            (p, v, held)
        };
        let (p_alone, v_alone, _) = run(false);
        let (p_held, v_held, held) = run(true);
        assert_eq!(p_alone, p_held, "parameters");
        assert_eq!(v_alone, v_held, "velocities");
        let (hp, hv) = held.unwrap();
        let (p0, v0): (Vec<_>, Vec<_>) = (
            make(1).into_iter().map(values).collect(),
            make(3).into_iter().map(values).collect(),
        );
        assert_eq!(hp, p0, "a parameter held elsewhere changed");
        assert_eq!(hv, v0, "a velocity held elsewhere changed");
        assert_ne!(p_held, p0, "the step changed nothing");
    }
}
