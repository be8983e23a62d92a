//! `kiln warmup`: one training step and one pass over the test split with a config's
//! model, batch and devices, so the kernel and autotune caches hold every kernel a run
//! of that config needs before the run starts (on a login node's GPU, say, or while
//! other work waits).

use std::time::Instant;

use burn::module::AutodiffModule;

use super::backend::BackendJob;
use super::build::build;
use super::error::TrainError;
use super::evaluator::evaluate;
use super::loss_scale::LossScale;
use super::strategy::{self, StepInput};
use super::watchdog::Watchdog;
use crate::config::Config;
use crate::data::Dataset;
use crate::model::ResNet;
use crate::ops::TrainBackend;

pub struct WarmupJob {
    pub config: Config,
    pub dataset: Dataset,
    pub device_names: Vec<String>,
}

/// Seconds each part took (compilation and autotuning, when the cache lacked them).
#[derive(Debug, Clone, Copy)]
pub struct WarmupReport {
    pub train_step_s: f64,
    pub eval_s: f64,
}

impl BackendJob for WarmupJob {
    type Output = Result<WarmupReport, TrainError>;

    fn run<B: TrainBackend>(self, devices: Vec<B::Device>) -> Self::Output {
        let cfg = &self.config;
        let device = devices[0].clone();
        let built = build::<B>(cfg, &self.dataset, &device);
        let batch = built
            .train
            .epoch(0, 0)
            .next()
            .ok_or(TrainError::BatchTooLarge {
                batch: cfg.train.batch_size,
                images: built.train.num_images(),
            })??;
        let mut strategy = strategy::choose::<B, ResNet<B>>(
            devices.clone(),
            self.device_names.clone(),
            None,
            &cfg.train,
            &cfg.parallel,
        )?;
        let mut optim = built.optim;
        let t = Instant::now();
        let model = strategy.start(built.model, &optim)?;
        let input = StepInput {
            step: 1,
            lr: cfg.optim.lr,
            scale: LossScale::for_precision(cfg.train.precision).map(|l| l.scale),
            fault: None,
            stop_asked: false,
        };
        let out = strategy.step(model, &mut optim, batch, &input, &Watchdog::idle())?;
        let model = strategy.sync_buffers(out.model, 1)?;
        for d in &devices {
            let _ = B::sync(d);
        }
        let train_step_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        evaluate::<B::InnerBackend>(&model.valid(), &built.test, &device)?;
        Ok(WarmupReport {
            train_step_s,
            eval_s: t.elapsed().as_secs_f64(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TestBackend, device, rng_lock};

    #[test]
    fn warmup_takes_a_step_and_a_test_pass_on_one_and_on_two_replicas() {
        let _rng = rng_lock();
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/debug.toml");
        let config = crate::config::load(&path, &[]).unwrap();
        for n in [1, 2] {
            let job = WarmupJob {
                dataset: crate::data::open(&config.data, 0).unwrap(),
                config: config.clone(),
                device_names: (0..n).map(|i| format!("cpu#{i}")).collect(),
            };
            let r = job.run::<TestBackend>(vec![device(); n]).unwrap();
            assert!(r.train_step_s > 0.0 && r.eval_s > 0.0);
        }
        let mut too_big = config.clone();
        too_big.train.batch_size = 100_000;
        let job = WarmupJob {
            dataset: crate::data::open(&too_big.data, 0).unwrap(),
            config: too_big,
            device_names: vec!["cpu".into()],
        };
        assert!(matches!(
            job.run::<TestBackend>(vec![device()]),
            Err(TrainError::BatchTooLarge { .. })
        ));
    }
}
