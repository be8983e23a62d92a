//! Dynamic loss scaling for `train.precision = "fp16"`, as PyTorch's `GradScaler`: the
//! loss is multiplied by the scale before the backward pass so that small float16
//! gradients do not flush to zero; the summed gradients are divided by it before the
//! optimizer step. A step whose gradients hold an inf or NaN is skipped and the scale
//! halves; after `GROWTH_INTERVAL` good steps in a row it doubles. The state is part of
//! every checkpoint (`TrainState::loss_scale`).

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::ElementConversion;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use super::grads::{map_each, sum_each};
use crate::config::Precision;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScale {
    pub scale: f64,
    /// Steps since the scale last changed without an overflow.
    pub good_steps: u32,
    /// Steps skipped because their gradients overflowed, over the whole run.
    pub skipped_steps: u64,
}

impl LossScale {
    pub const INITIAL: f64 = 65536.0;
    pub const GROWTH_INTERVAL: u32 = 2000;

    /// The scaler `precision` needs: fp16 only.
    pub fn for_precision(precision: Precision) -> Option<Self> {
        (precision == Precision::Fp16).then(Self::new)
    }

    pub fn new() -> Self {
        LossScale {
            scale: Self::INITIAL,
            good_steps: 0,
            skipped_steps: 0,
        }
    }

    /// Records a step: `stepped` is false when its gradients overflowed.
    pub fn update(&mut self, stepped: bool) {
        if stepped {
            self.good_steps += 1;
            if self.good_steps >= Self::GROWTH_INTERVAL {
                self.scale *= 2.0;
                self.good_steps = 0;
            }
        } else {
            self.scale *= 0.5;
            self.good_steps = 0;
            self.skipped_steps += 1;
        }
    }
}

/// Divides `grads` by `scale` and says whether they are all finite (one device
/// synchronisation). An inf or NaN anywhere makes the sum of all gradients non-finite;
/// so does a sum beyond f32's range, which is an overflow worth skipping too.
pub fn unscale<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    scale: f64,
) -> bool {
    let finite = match sum_each::<B, M>(model, grads, |g| g.sum()) {
        Some(s) => s.into_scalar().elem::<f64>().is_finite(),
        None => true,
    };
    if finite {
        map_each::<B, M>(model, grads, |g| g.div_scalar(scale));
    }
    finite
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, Config, Stem};
    use crate::data::Batch;
    use crate::model::{ModelSpec, ResNet};
    use crate::test_util::{TestBackend, device, floats, max_diff, rng_lock};
    use crate::train::optim::Optim;
    use crate::train::step::train_step;
    use burn::tensor::backend::Backend;
    use burn::tensor::{Distribution, Tensor};

    /// The tiny ResNet after one SGD step on 8 random images with loss scale `scale`,
    /// its parameters before, and whether the step was taken.
    fn one_step(scale: Option<f64>) -> (Vec<f32>, Vec<f32>, bool) {
        let _rng = rng_lock();
        <TestBackend as Backend>::seed(&device(), 5);
        let model: ResNet<TestBackend> =
            ModelSpec::new(Arch::Tiny, Stem::Small, 3, 3, 8).init(&device());
        let images: Tensor<TestBackend, 4> =
            Tensor::random([8, 3, 8, 8], Distribution::Normal(0.0, 1.0), &device());
        let batch = Batch {
            images: images.into_data().to_vec::<f32>().unwrap(),
            labels: (0..8).map(|i| i % 3).collect(),
            shape: [8, 3, 8, 8],
        };
        let cfg = Config::default();
        let before = floats(&model);
        let mut optim = Optim::new(&cfg.optim);
        let (model, _, stepped) =
            train_step(model, &mut optim, batch, 0.1, &cfg.train, &device(), scale);
        (before, floats(&model), stepped)
    }

    #[test]
    fn a_scaled_step_equals_the_unscaled_one() {
        let (before, plain, stepped) = one_step(None);
        assert!(stepped);
        let (_, scaled, stepped) = one_step(Some(LossScale::INITIAL));
        assert!(stepped);
        assert!(max_diff(&before, &plain) > 1e-4, "the step changed nothing");
        let d = max_diff(&plain, &scaled);
        assert!(d < 1e-5, "scaled and unscaled steps differ by {d}");
    }

    #[test]
    fn an_overflowing_step_is_skipped_and_leaves_the_weights() {
        // A scale beyond f32's range makes every gradient infinite.
        let (before, after, stepped) = one_step(Some(1e39));
        assert!(!stepped);
        assert_eq!(before, after);
    }

    #[test]
    fn the_scale_halves_on_overflow_and_doubles_after_a_run_of_good_steps() {
        let mut s = LossScale::new();
        s.update(false);
        s.update(false);
        assert_eq!((s.scale, s.skipped_steps), (LossScale::INITIAL / 4.0, 2));
        for _ in 0..LossScale::GROWTH_INTERVAL - 1 {
            s.update(true);
        }
        assert_eq!(s.scale, LossScale::INITIAL / 4.0);
        s.update(true);
        assert_eq!((s.scale, s.good_steps), (LossScale::INITIAL / 2.0, 0));
        // An overflow restarts the count.
        for _ in 0..10 {
            s.update(true);
        }
        s.update(false);
        assert_eq!(
            (s.scale, s.good_steps, s.skipped_steps),
            (LossScale::INITIAL / 4.0, 0, 3)
        );
    }
}
