//! `kiln sweep`: expands and checks the sweep, finds the GPU slots, runs the trials and
//! writes the results.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;

use crate::cli::SweepArgs;
use crate::config::{BackendChoice, DevicesConfig};
use crate::device::{DevicePlan, GpuInfo};
use crate::exit::{INTERRUPTED, UsageError};
use crate::sweep::results;
use crate::sweep::schedule::{self, Plan};
use crate::sweep::{SweepSpec, Trial};

/// The sweep as it was started, kept in the sweep folder for `--resume`.
const SPEC: &str = "sweep.json";

pub fn run(args: SweepArgs) -> anyhow::Result<ExitCode> {
    let (spec, sweep_dir) = match (&args.config, &args.resume) {
        (Some(file), None) => {
            let mut spec = SweepSpec::load(file).map_err(|e| UsageError(e.to_string()))?;
            let trials = spec.trials();
            spec.check(file, &trials)
                .map_err(|e| UsageError(e.to_string()))?;
            // Kept with an absolute base, so --resume works from anywhere.
            spec.base = std::path::absolute(spec.base_path(file))
                .with_context(|| format!("resolving {}", spec.base.display()))?;
            let name = file
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "sweep".into());
            let dir = super::train::create_run_dir(&args.output, &name)?;
            std::fs::write(dir.join(SPEC), serde_json::to_string_pretty(&spec)?)
                .with_context(|| format!("writing {}", dir.join(SPEC).display()))?;
            (spec, dir)
        }
        (None, Some(dir)) => {
            let path = dir.join(SPEC);
            let text = std::fs::read_to_string(&path).map_err(|e| {
                UsageError(format!(
                    "{} is not a sweep folder (cannot read {}: {e})",
                    dir.display(),
                    path.display()
                ))
            })?;
            let spec: SweepSpec = serde_json::from_str(&text)
                .map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
            (spec, dir.clone())
        }
        _ => {
            return Err(UsageError(
                "give either --config SWEEP.toml (a new sweep) or --resume SWEEP_DIR".into(),
            )
            .into());
        }
    };
    let trials = spec.trials();
    let slots = schedule::slots(
        &visible_gpus()?,
        spec.gpus_per_trial,
        spec.max_parallel,
        cpu_slots(),
    )
    .map_err(UsageError)?;
    eprintln!(
        "kiln sweep: {} trials in {}, {} at a time on {}",
        trials.len(),
        sweep_dir.display(),
        slots.len(),
        slots
            .iter()
            .map(|s| s.label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let interrupt = Arc::new(AtomicBool::new(false));
    let flag = interrupt.clone();
    // Children get the signal too (same process group) and checkpoint; the sweep
    // starts no new trial and writes what it has.
    let _ = ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst));
    let exe = std::env::current_exe().context("finding the kiln executable")?;
    let plan = Plan {
        spec: &spec,
        base: &spec.base,
        sweep_dir: &sweep_dir,
        exe: &exe,
        slots: &slots,
        interrupt: interrupt.clone(),
    };
    let started = std::time::Instant::now();
    let outcomes = schedule::run(&plan, &trials)
        .with_context(|| format!("running trials in {}", sweep_dir.display()))?;
    write_results(&spec, &sweep_dir, &trials, &outcomes)?;
    eprintln!(
        "kiln sweep: {} of {} trials finished in {:.0} s",
        outcomes.iter().filter(|o| o.status == "finished").count(),
        trials.len(),
        started.elapsed().as_secs_f64()
    );
    if interrupt.load(Ordering::SeqCst) {
        eprintln!(
            "kiln sweep: interrupted; continue with kiln sweep --resume {}",
            sweep_dir.display()
        );
        return Ok(ExitCode::from(INTERRUPTED));
    }
    Ok(if outcomes.iter().all(|o| o.status == "finished") {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn write_results(
    spec: &SweepSpec,
    dir: &Path,
    trials: &[Trial],
    outcomes: &[schedule::Outcome],
) -> anyhow::Result<()> {
    let csv = dir.join("results.csv");
    results::write_csv(&csv, spec, trials, outcomes)
        .with_context(|| format!("writing {}", csv.display()))?;
    print!("{}", results::table(spec, trials, outcomes));
    let plot = dir.join("metric.png");
    if let Err(e) = results::write_plot(&plot, spec, trials, outcomes) {
        eprintln!("kiln sweep: warning: no plot: {e}");
    }
    let best = results::ranking(outcomes, spec.goal)
        .first()
        .copied()
        .filter(|&i| outcomes[i].metric.is_some());
    if let Some(i) = best
        && let Some(run) = &outcomes[i].run_dir
    {
        let to = dir.join("best.toml");
        let config = std::fs::read_to_string(run.join("config.toml"))
            .with_context(|| format!("reading {}", run.join("config.toml").display()))?;
        let text = format!(
            "# The best trial of this sweep (trial {i}: {}), its resolved config.\n# Run it: kiln train --config {}\n{config}",
            trials[i].label(),
            to.display()
        );
        std::fs::write(&to, text).with_context(|| format!("writing {}", to.display()))?;
        println!("best: trial {i}, config in {}", to.display());
    }
    println!("results: {}", csv.display());
    Ok(())
}

/// Every visible GPU as `(physical index or CUDA ordinal, UUID)`; none without a driver.
fn visible_gpus() -> anyhow::Result<Vec<(usize, String)>> {
    let cfg = DevicesConfig {
        backend: BackendChoice::Auto,
        ..DevicesConfig::default()
    };
    Ok(match super::plan_devices(&cfg)? {
        DevicePlan::Cuda { gpus, .. } => gpus.iter().map(slot_gpu).collect(),
        DevicePlan::Cpu { .. } => Vec::new(),
    })
}

fn slot_gpu(g: &GpuInfo) -> (usize, String) {
    (
        g.physical.as_ref().map_or(g.ordinal, |p| p.index),
        g.uuid.clone(),
    )
}

/// CPU trials at once: Burn's CPU backend uses every core it gets, so two at most.
fn cpu_slots() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 8).clamp(1, 2))
}
