//! Whole-model operations on one step's gradients, shared by clipping and loss scaling:
//! a sum over every parameter's gradient, and an element-wise map of every gradient.
//! Gradients are handed to the closures flattened to one dimension (a free reshape),
//! so one closure serves parameters of any rank.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

struct SumEach<'a, B: Backend, F> {
    grads: &'a GradientsParams,
    each: F,
    sum: Option<Tensor<B, 1>>,
}

impl<B, F> ModuleVisitor<B> for SumEach<'_, B::InnerBackend, F>
where
    B: AutodiffBackend,
    F: Fn(Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1>,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let n: usize = g.dims().iter().product();
            let s = (self.each)(g.reshape([n]));
            self.sum = Some(match self.sum.take() {
                Some(acc) => acc + s,
                None => s,
            });
        }
    }
}

struct MapEach<'a, F> {
    grads: &'a mut GradientsParams,
    f: F,
}

impl<B, F> ModuleVisitor<B> for MapEach<'_, F>
where
    B: AutodiffBackend,
    F: Fn(Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1>,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let dims = g.dims();
            let n: usize = dims.iter().product();
            let mapped = (self.f)(g.reshape([n])).reshape(dims);
            self.grads.register::<B::InnerBackend, D>(param.id, mapped);
        }
    }
}

/// The sum over every parameter of `each(its gradient)`, where `each` reduces a
/// gradient to one element; `None` when no parameter has a gradient.
pub fn sum_each<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
    each: impl Fn(Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1>,
) -> Option<Tensor<B::InnerBackend, 1>> {
    let mut visitor = SumEach {
        grads,
        each,
        sum: None,
    };
    model.visit(&mut visitor);
    visitor.sum
}

/// Replaces every gradient `g` by `f(g)`, an element-wise function.
pub fn map_each<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    f: impl Fn(Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1>,
) {
    model.visit(&mut MapEach { grads, f });
}
