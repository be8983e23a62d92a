//! `sweep.toml`: a base config, axes over dotted config keys, and how to rank and place
//! the trials. Expanding it gives the list of trials, each a list of `--set`
//! arguments; every trial's config is resolved (keys and values checked by the config
//! loader) before anything starts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use toml::Value;

use super::asha::AshaSpec;
use crate::config;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Goal {
    Max,
    Min,
}

/// What a trial is ranked by: a field of its `summary.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    BestTestAcc,
    FinalTestAcc,
    FinalTestLoss,
}

impl Metric {
    pub fn key(self) -> &'static str {
        match self {
            Metric::BestTestAcc => "best_test_acc",
            Metric::FinalTestAcc => "final_test_acc",
            Metric::FinalTestLoss => "final_test_loss",
        }
    }
}

/// One random axis: how its values are drawn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Draw {
    /// Uniform in `[low, high]`.
    Uniform([f64; 2]),
    /// `exp` of uniform in `[ln low, ln high]` (both positive): learning rates, decays.
    LogUniform([f64; 2]),
    /// One of the listed values, equally likely.
    Choice(Vec<Value>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomSpec {
    /// Draws (for each grid point, when there is a grid too).
    pub trials: usize,
    pub seed: u64,
    pub axes: BTreeMap<String, Draw>,
}

/// Trials in one sweep at most: each is listed, then gets a folder of its own.
const MAX_TRIALS: usize = 100_000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepSpec {
    /// The training config every trial starts from, relative to the sweep file.
    pub base: PathBuf,
    #[serde(default = "default_metric")]
    pub metric: Metric,
    #[serde(default = "default_goal")]
    pub goal: Goal,
    /// GPUs per trial; the visible GPUs are cut into slots of this many (under Slurm:
    /// each array element asks for this many). 0: the trials train on the CPU.
    #[serde(default = "one")]
    pub gpus_per_trial: usize,
    /// At most this many trials at once; 0: one per slot.
    #[serde(default)]
    pub max_parallel: usize,
    /// `--max-restarts` of each trial's `kiln train`.
    #[serde(default = "one_u32")]
    pub max_restarts: u32,
    /// Overrides for every trial, as `--set` takes them.
    #[serde(default)]
    pub set: Vec<String>,
    /// Every combination of these values.
    #[serde(default)]
    pub grid: BTreeMap<String, Vec<Value>>,
    pub random: Option<RandomSpec>,
    /// `kiln sweep --launcher slurm`: what each array element asks Slurm for.
    #[serde(default)]
    pub slurm: SlurmSpec,
    /// Stop trials that fall behind at rungs of epochs (asynchronous successive halving).
    #[serde(default)]
    pub asha: Option<AshaSpec>,
}

/// `[slurm]` of a sweep file; `kiln sweep` flags of the same names override it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SlurmSpec {
    /// `sbatch --partition`.
    pub partition: Option<String>,
    /// `sbatch --time`, per trial (e.g. `"4:00:00"`).
    pub time: Option<String>,
    /// `sbatch --account`.
    pub account: Option<String>,
    /// More `sbatch` options, one per item (e.g. `["--qos=high", "--mem=64G"]`).
    pub sbatch_args: Vec<String>,
}

fn default_metric() -> Metric {
    Metric::BestTestAcc
}
fn default_goal() -> Goal {
    Goal::Max
}
fn one() -> usize {
    1
}
fn one_u32() -> u32 {
    1
}

/// One trial: its position and the `key=value` settings that make it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trial {
    pub index: usize,
    /// `(key, value as TOML)` for each swept key, in key order.
    pub values: Vec<(String, String)>,
}

impl Trial {
    pub fn sets(&self) -> Vec<String> {
        self.values
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect()
    }

    pub fn label(&self) -> String {
        self.values
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("cannot read sweep file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{path}: trial {trial} ({label}): {source}")]
    Trial {
        path: PathBuf,
        trial: usize,
        label: String,
        source: Box<config::ConfigError>,
    },
}

impl SweepSpec {
    pub fn load(path: &Path) -> Result<Self, SweepError> {
        let text = std::fs::read_to_string(path).map_err(|source| SweepError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |message: String| SweepError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let spec: SweepSpec = toml::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        if spec.grid.is_empty() && spec.random.is_none() {
            return Err(invalid(
                "no axes: add a [grid] table (key = [values]) or [random] with axes".into(),
            ));
        }
        if let Some((k, _)) = spec.grid.iter().find(|(_, v)| v.is_empty()) {
            return Err(invalid(format!("grid axis `{k}` has no values")));
        }
        if let Some(r) = &spec.random {
            if r.trials == 0 {
                return Err(invalid("random.trials = 0: at least 1".into()));
            }
            for (k, d) in &r.axes {
                let ok = match d {
                    Draw::Uniform([a, b]) => a.is_finite() && b.is_finite() && a <= b,
                    Draw::LogUniform([a, b]) => *a > 0.0 && a <= b && b.is_finite(),
                    Draw::Choice(v) => !v.is_empty(),
                };
                if !ok {
                    return Err(invalid(format!(
                        "random axis `{k}` = {d:?}: uniform needs [low, high] with low <= high, log_uniform also low > 0, choice at least one value"
                    )));
                }
            }
        }
        // Every trial is listed (and later has a folder) before the first starts.
        let points = spec
            .grid
            .values()
            .fold(1usize, |n, v| n.saturating_mul(v.len()));
        let total = points.saturating_mul(spec.random.as_ref().map_or(1, |r| r.trials));
        if total > MAX_TRIALS {
            return Err(invalid(format!(
                "{total} trials ({points} grid point(s){}): at most {MAX_TRIALS} in one sweep",
                spec.random
                    .as_ref()
                    .map(|r| format!(" x random.trials = {}", r.trials))
                    .unwrap_or_default()
            )));
        }
        for (key, value, limit) in [
            ("gpus_per_trial", spec.gpus_per_trial, 1024),
            ("max_parallel", spec.max_parallel, 100_000),
            ("max_restarts", spec.max_restarts as usize, 1000),
        ] {
            if value > limit {
                return Err(invalid(format!("{key} = {value}: at most {limit}")));
            }
        }
        for key in spec
            .grid
            .keys()
            .chain(spec.random.iter().flat_map(|r| r.axes.keys()))
        {
            if key == "devices.visible" || key.starts_with("devices.") {
                return Err(invalid(format!(
                    "axis `{key}`: the sweep places trials on GPUs itself (gpus_per_trial); remove [devices] keys from the axes"
                )));
            }
        }
        Ok(spec)
    }

    /// The base config's path, as the sweep file names it.
    pub fn base_path(&self, sweep_file: &Path) -> PathBuf {
        match sweep_file.parent() {
            Some(dir) if self.base.is_relative() => dir.join(&self.base),
            _ => self.base.clone(),
        }
    }

    /// Every trial: the grid's combinations (last key fastest), each with
    /// `random.trials` draws when there is a random part.
    pub fn trials(&self) -> Vec<Trial> {
        let mut points: Vec<Vec<(String, String)>> = vec![Vec::new()];
        for (key, values) in &self.grid {
            points = points
                .into_iter()
                .flat_map(|p| {
                    values.iter().map(move |v| {
                        let mut p = p.clone();
                        p.push((key.clone(), v.to_string()));
                        p
                    })
                })
                .collect();
        }
        if let Some(r) = &self.random {
            let mut rng = ChaCha8Rng::seed_from_u64(r.seed);
            points = points
                .into_iter()
                .flat_map(|p| {
                    (0..r.trials)
                        .map(|_| {
                            let mut p = p.clone();
                            for (key, draw) in &r.axes {
                                p.push((key.clone(), draw_value(draw, &mut rng)));
                            }
                            p
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
        }
        points
            .into_iter()
            .enumerate()
            .map(|(index, values)| Trial { index, values })
            .collect()
    }

    /// Resolves every trial's config, so a bad key or value stops the sweep before
    /// anything runs; the ASHA rungs when the sweep has `[asha]`.
    pub fn check(
        &self,
        sweep_file: &Path,
        trials: &[Trial],
    ) -> Result<Option<Vec<u32>>, SweepError> {
        let base = self.base_path(sweep_file);
        let mut schedules = Vec::new();
        for t in trials {
            let cfg = self.trial_config(&base, sweep_file, t)?;
            if !cfg.devices.visible.is_empty() {
                return Err(SweepError::Invalid {
                    path: sweep_file.to_path_buf(),
                    message: format!(
                        "the base config {} sets devices.visible = {:?}; the sweep gives each trial its GPUs itself, so remove it",
                        base.display(),
                        cfg.devices.visible
                    ),
                });
            }
            schedules.push((t.index, cfg.train.epochs, cfg.eval.every_epochs));
        }
        self.rungs_for(sweep_file, &schedules)
    }

    /// The ASHA rungs of a sweep being resumed ([`SweepSpec::check`] ran when it started).
    pub fn asha_rungs(
        &self,
        sweep_file: &Path,
        trials: &[Trial],
    ) -> Result<Option<Vec<u32>>, SweepError> {
        if self.asha.is_none() {
            return Ok(None);
        }
        let base = self.base_path(sweep_file);
        let schedules = trials
            .iter()
            .map(|t| {
                let cfg = self.trial_config(&base, sweep_file, t)?;
                Ok((t.index, cfg.train.epochs, cfg.eval.every_epochs))
            })
            .collect::<Result<Vec<_>, SweepError>>()?;
        self.rungs_for(sweep_file, &schedules)
    }

    /// Trial `t`'s config: the base with the sweep's and the trial's settings.
    fn trial_config(
        &self,
        base: &Path,
        sweep_file: &Path,
        t: &Trial,
    ) -> Result<config::Config, SweepError> {
        let mut sets = self.set.clone();
        sets.extend(t.sets());
        config::load(base, &sets).map_err(|source| SweepError::Trial {
            path: sweep_file.to_path_buf(),
            trial: t.index,
            label: t.label(),
            source: Box::new(source),
        })
    }

    /// The ASHA rungs, when the sweep has `[asha]`, from each trial's `(index, epochs,
    /// eval.every_epochs)`: every trial must train the same number of epochs and be
    /// evaluated at every rung, so that the trials compared at a rung have measured the
    /// same thing.
    fn rungs_for(
        &self,
        sweep_file: &Path,
        schedules: &[(usize, u32, u32)],
    ) -> Result<Option<Vec<u32>>, SweepError> {
        let Some(asha) = &self.asha else {
            return Ok(None);
        };
        let invalid = |message: String| SweepError::Invalid {
            path: sweep_file.to_path_buf(),
            message,
        };
        // ASHA keeps what the goal calls better: a loss kept at its highest would stop
        // the best trials.
        if self.metric == Metric::FinalTestLoss && self.goal == Goal::Max {
            return Err(invalid(
                "metric = \"final_test_loss\" with goal = \"max\": [asha] would keep the trials with the highest loss; set goal = \"min\"".into(),
            ));
        }
        let epochs = schedules.first().map_or(0, |s| s.1);
        if let Some((trial, e, _)) = schedules.iter().find(|s| s.1 != epochs) {
            return Err(invalid(format!(
                "[asha] compares trials at the same epochs, but trial {trial} trains {e} epochs and trial 0 {epochs}; do not sweep train.epochs with [asha]"
            )));
        }
        asha.validate(epochs).map_err(invalid)?;
        let rungs = asha.rungs(epochs);
        for &(trial, _, every) in schedules {
            if let Some(r) = rungs.iter().find(|&&r| every == 0 || r % every != 0) {
                return Err(invalid(format!(
                    "[asha] judges trials by their test metric at epochs {rungs:?}, but trial {trial} has eval.every_epochs = {every}, which does not evaluate epoch {r}; set eval.every_epochs = 1 (in `set`)"
                )));
            }
        }
        Ok(Some(rungs))
    }
}

fn draw_value(draw: &Draw, rng: &mut ChaCha8Rng) -> String {
    // Four significant digits: trial labels stay readable, and what is shown is what ran.
    let short = |x: f64| format!("{:.4e}", x).parse::<f64>().unwrap_or(x).to_string();
    match draw {
        Draw::Uniform([a, b]) => short(a + (b - a) * rng.random::<f64>()),
        Draw::LogUniform([a, b]) => short((a.ln() + (b.ln() - a.ln()) * rng.random::<f64>()).exp()),
        Draw::Choice(v) => v[rng.random_range(0..v.len())].to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> Result<SweepSpec, SweepError> {
        let dir = crate::test_util::tempdir();
        let p = dir.path().join("sweep.toml");
        std::fs::write(&p, text).unwrap();
        SweepSpec::load(&p)
    }

    #[test]
    fn grid_is_every_combination_and_random_draws_repeat() {
        let s = spec(
            r#"
base = "base.toml"
[grid]
"optim.lr" = [0.1, 0.2]
"model.arch" = ["tiny", "resnet20"]
[random]
trials = 2
seed = 3
axes = { "optim.weight_decay" = { log_uniform = [1e-5, 1e-2] }, "train.label_smoothing" = { uniform = [0.0, 0.2] } }
"#,
        )
        .unwrap();
        let t = s.trials();
        assert_eq!(t.len(), 8);
        assert_eq!(t[0].values[0], ("model.arch".into(), "\"tiny\"".into()));
        assert_eq!(t[0].values[1], ("optim.lr".into(), "0.1".into()));
        assert_eq!(t, s.trials(), "the same seed draws the same trials");
        for trial in &t {
            let wd: f64 = trial.values[2].1.parse().unwrap();
            assert!((1e-5..=1e-2).contains(&wd), "{wd}");
        }
        assert_ne!(t[0].values[2], t[1].values[2]);
    }

    #[test]
    fn the_shipped_sweep_expands_and_checks() {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/sweep.toml");
        let s = SweepSpec::load(&p).unwrap();
        let t = s.trials();
        assert_eq!(t.len(), 8);
        s.check(&p, &t).unwrap();
    }

    #[test]
    fn mistakes_are_named() {
        let e = |t: &str| spec(t).unwrap_err().to_string();
        assert!(e("base = \"b.toml\"\n").contains("no axes"));
        assert!(
            e("base = \"b.toml\"\n[grid]\n\"optim.lr\" = []\n")
                .contains("`optim.lr` has no values")
        );
        assert!(
            e("base = \"b.toml\"\n[grid]\na = [1]\n[slurm]\npartiton = \"gpu\"\n")
                .contains("partiton")
        );
        assert!(
            e("base = \"b.toml\"\n[grid]\n\"devices.use\" = [[0]]\n").contains("places trials")
        );
        assert!(e("base = \"b.toml\"\nmetrc = \"x\"\n[grid]\na = [1]\n").contains("metrc"));
    }

    #[test]
    fn a_bad_axis_value_is_caught_before_anything_runs() {
        let dir = crate::test_util::tempdir();
        std::fs::write(dir.path().join("base.toml"), "[train]\nepochs = 1\n").unwrap();
        let p = dir.path().join("sweep.toml");
        std::fs::write(&p, "base = \"base.toml\"\n[grid]\n\"optim.lrr\" = [0.1]\n").unwrap();
        let s = SweepSpec::load(&p).unwrap();
        let msg = s.check(&p, &s.trials()).unwrap_err().to_string();
        assert!(
            msg.contains("trial 0") && msg.contains("did you mean `optim.lr`"),
            "{msg}"
        );
        std::fs::write(
            &p,
            "base = \"base.toml\"\n[grid]\n\"train.epochs\" = [2, -1]\n",
        )
        .unwrap();
        let s = SweepSpec::load(&p).unwrap();
        let msg = s.check(&p, &s.trials()).unwrap_err().to_string();
        assert!(
            msg.contains("trial 1") && msg.contains("train.epochs"),
            "{msg}"
        );
    }
}
