//! Learning-rate schedules as pure functions of the optimizer step, so resuming needs
//! no scheduler state and the rate is the same whatever the number of devices.

use crate::config::{OptimConfig, ScheduleKind};

/// Steps that shape the schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Horizon {
    pub steps_per_epoch: u64,
    /// All optimizer steps of the configured epochs (not cut by `max_steps`).
    pub total_steps: u64,
}

/// Learning rate for optimizer step `step` (0-based).
pub fn lr_at(cfg: &OptimConfig, h: Horizon, step: u64) -> f64 {
    let total = h.total_steps.max(1) as f64;
    let t = step as f64;
    if cfg.schedule == ScheduleKind::Onecycle {
        let up = (cfg.onecycle_pct_start * total).max(1.0);
        let start = cfg.lr / cfg.onecycle_div;
        let end = cfg.lr / cfg.onecycle_final_div;
        return if t < up {
            cosine(start, cfg.lr, t / up)
        } else {
            cosine(cfg.lr, end, ((t - up) / (total - up).max(1.0)).min(1.0))
        };
    }
    let warmup = cfg.warmup_epochs * h.steps_per_epoch as f64;
    if t < warmup {
        return cfg.lr * (t + 1.0) / warmup;
    }
    match cfg.schedule {
        ScheduleKind::Constant => cfg.lr,
        ScheduleKind::Cosine => {
            let span = (total - warmup).max(1.0);
            cosine(cfg.lr, cfg.min_lr, ((t - warmup) / span).min(1.0))
        }
        ScheduleKind::Step => {
            let epoch = step / h.steps_per_epoch.max(1);
            let passed = cfg
                .step_milestones
                .iter()
                .filter(|&&m| epoch >= m as u64)
                .count();
            cfg.lr * cfg.step_gamma.powi(passed as i32)
        }
        ScheduleKind::Onecycle => unreachable!("handled above"),
    }
}

/// Half-cosine from `from` (at `frac` 0) to `to` (at `frac` 1).
fn cosine(from: f64, to: f64, frac: f64) -> f64 {
    to + (from - to) * 0.5 * (1.0 + (std::f64::consts::PI * frac).cos())
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: Horizon = Horizon {
        steps_per_epoch: 10,
        total_steps: 100,
    };

    fn cfg(schedule: ScheduleKind) -> OptimConfig {
        OptimConfig {
            schedule,
            lr: 1.0,
            ..OptimConfig::default()
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn cosine_starts_at_lr_ends_at_min_lr_and_halves_midway() {
        let c = OptimConfig {
            min_lr: 0.1,
            ..cfg(ScheduleKind::Cosine)
        };
        assert!(close(lr_at(&c, H, 0), 1.0));
        assert!(close(lr_at(&c, H, 50), 0.55));
        assert!(close(lr_at(&c, H, 100), 0.1));
    }

    #[test]
    fn warmup_rises_linearly_then_hands_over() {
        let c = OptimConfig {
            warmup_epochs: 1.0,
            ..cfg(ScheduleKind::Constant)
        };
        assert!(close(lr_at(&c, H, 0), 0.1));
        assert!(close(lr_at(&c, H, 4), 0.5));
        assert!(close(lr_at(&c, H, 9), 1.0));
        assert!(close(lr_at(&c, H, 57), 1.0));
    }

    #[test]
    fn step_multiplies_at_each_milestone_epoch() {
        let c = OptimConfig {
            step_milestones: vec![3, 6],
            step_gamma: 0.1,
            ..cfg(ScheduleKind::Step)
        };
        assert!(close(lr_at(&c, H, 29), 1.0));
        assert!(close(lr_at(&c, H, 30), 0.1));
        assert!(close(lr_at(&c, H, 60), 0.01));
    }

    #[test]
    fn onecycle_peaks_after_pct_start_and_ends_at_lr_over_final_div() {
        let c = OptimConfig {
            onecycle_pct_start: 0.3,
            onecycle_div: 25.0,
            onecycle_final_div: 1e4,
            ..cfg(ScheduleKind::Onecycle)
        };
        assert!(close(lr_at(&c, H, 0), 0.04));
        assert!(close(lr_at(&c, H, 30), 1.0));
        assert!(close(lr_at(&c, H, 100), 1e-4));
        assert!(lr_at(&c, H, 15) > 0.04 && lr_at(&c, H, 15) < 1.0);
    }
}
