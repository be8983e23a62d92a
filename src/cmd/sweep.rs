//! `kiln sweep`: expands and checks the sweep, finds the GPU slots, runs the trials and
//! writes the results.

use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;

use std::collections::BTreeSet;

use crate::cli::{Launcher, SweepArgs};
use crate::config::{BackendChoice, DevicesConfig};
use crate::device::{DevicePlan, GpuInfo};
use crate::exit::{INTERRUPTED, UsageError};
use crate::run::signals::Signals;
use crate::sweep::results;
use crate::sweep::runner::{self, Outcome, Placement, Plan};
use crate::sweep::slurm;
use crate::sweep::spec::SlurmSpec;
use crate::sweep::{SweepSpec, Trial};

/// The sweep as it was started, kept in the sweep folder for `--resume`.
const SPEC: &str = "sweep.json";

pub fn run(args: SweepArgs) -> anyhow::Result<ExitCode> {
    let slurm_flags = [
        (args.partition.is_some(), "--partition"),
        (args.time.is_some(), "--time"),
        (args.account.is_some(), "--account"),
        (args.no_wait, "--no-wait"),
    ];
    // A sweep that went to Slurm stays there: trials run locally beside elements
    // still in the queue would write the same folders.
    let on_slurm = args.resume.as_deref().is_some_and(slurm::submitted);
    let launcher = match args.launcher {
        Some(Launcher::Local) if on_slurm => {
            return Err(UsageError(format!(
                "{} was submitted to Slurm; resume it with --launcher slurm (or leave --launcher out)",
                args.resume.as_deref().unwrap_or(Path::new("")).display()
            ))
            .into());
        }
        Some(l) => l,
        None if on_slurm => Launcher::Slurm,
        None => Launcher::Local,
    };
    if launcher == Launcher::Local
        && let Some((_, flag)) = slurm_flags.iter().find(|(given, _)| *given)
    {
        return Err(UsageError(format!("{flag} is a Slurm option: add --launcher slurm")).into());
    }
    let (spec, sweep_dir, rungs) = match (&args.config, &args.resume) {
        (Some(file), None) => {
            let mut spec = SweepSpec::load(file).map_err(|e| UsageError(e.to_string()))?;
            let trials = spec.trials();
            let rungs = spec
                .check(file, &trials)
                .map_err(|e| UsageError(e.to_string()))?;
            refuse_asha_on_slurm(&spec, launcher, file)?;
            // Kept with an absolute base, so --resume works from anywhere.
            spec.base = std::path::absolute(spec.base_path(file))
                .with_context(|| format!("resolving {}", spec.base.display()))?;
            let name = file
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "sweep".into());
            let dir = crate::run::run_dir::create(&args.output, &name)?;
            std::fs::write(dir.join(SPEC), serde_json::to_string_pretty(&spec)?)
                .with_context(|| format!("writing {}", dir.join(SPEC).display()))?;
            (spec, dir, rungs)
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
            let rungs = spec
                .asha_rungs(&path, &spec.trials())
                .map_err(|e| UsageError(e.to_string()))?;
            (spec, dir.clone(), rungs)
        }
        _ => {
            return Err(UsageError(
                "give either --config SWEEP.toml (a new sweep) or --resume SWEEP_DIR".into(),
            )
            .into());
        }
    };
    if let Some(index) = args.trial {
        return run_element(&spec, &sweep_dir, index);
    }
    refuse_asha_on_slurm(&spec, launcher, &sweep_dir)?;
    // One sweep process per sweep folder (its trials run under it).
    let (_lock, note) = crate::run::run_dir::lock(&sweep_dir)?;
    if let Some(n) = note {
        crate::say!("kiln sweep: note: {n}");
    }
    // Trials get every signal this process gets and checkpoint; the sweep starts no
    // new trial and writes what it has.
    let signals = Signals::for_supervisor();
    let interrupt = signals.interrupted();
    let exe = std::env::current_exe().context("finding the kiln executable")?;
    let trials = spec.trials();
    let started = std::time::Instant::now();
    let outcomes = match launcher {
        Launcher::Local => run_local(&spec, &sweep_dir, &exe, &trials, rungs.as_deref(), &signals)?,
        Launcher::Slurm => {
            let options = SlurmSpec {
                partition: args.partition.clone().or(spec.slurm.partition.clone()),
                time: args.time.clone().or(spec.slurm.time.clone()),
                account: args.account.clone().or(spec.slurm.account.clone()),
                sbatch_args: spec.slurm.sbatch_args.clone(),
            };
            let wait = !args.no_wait;
            match run_slurm(&spec, &options, &sweep_dir, &exe, &trials, wait, interrupt)? {
                Some(outcomes) => outcomes,
                // Submitted without waiting.
                None => return Ok(ExitCode::SUCCESS),
            }
        }
    };
    write_results(&spec, &sweep_dir, &trials, &outcomes)?;
    let stopped = outcomes
        .iter()
        .filter(|o| o.status == runner::STOPPED_BY_ASHA)
        .count();
    crate::say!(
        "kiln sweep: {} of {} trials finished{} in {:.0} s",
        outcomes.iter().filter(|o| o.status == "finished").count(),
        trials.len(),
        if spec.asha.is_some() {
            format!(", {stopped} stopped by ASHA")
        } else {
            String::new()
        },
        started.elapsed().as_secs_f64()
    );
    if interrupt.load(Ordering::SeqCst) {
        let more = match launcher {
            Launcher::Local => "",
            Launcher::Slurm => " --launcher slurm (it waits for the trials still in Slurm's queue)",
        };
        crate::say!(
            "kiln sweep: interrupted; continue with kiln sweep --resume {}{more}",
            sweep_dir.display()
        );
        return Ok(ExitCode::from(INTERRUPTED));
    }
    Ok(
        if outcomes
            .iter()
            .all(|o| o.status == "finished" || o.status == runner::STOPPED_BY_ASHA)
        {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        },
    )
}

/// `[asha]` needs the local launcher, which watches the trials' epochs as they end.
fn refuse_asha_on_slurm(spec: &SweepSpec, launcher: Launcher, source: &Path) -> anyhow::Result<()> {
    if launcher == Launcher::Slurm && spec.asha.is_some() {
        return Err(UsageError(format!(
            "{}: [asha] stops trials as their epochs end, which only the local launcher does; remove [asha] to sweep through Slurm",
            source.display()
        ))
        .into());
    }
    Ok(())
}

/// The trials on this machine's GPU (or CPU) slots.
fn run_local(
    spec: &SweepSpec,
    sweep_dir: &Path,
    exe: &Path,
    trials: &[Trial],
    rungs: Option<&[u32]>,
    signals: &Signals,
) -> anyhow::Result<Vec<Outcome>> {
    let slots = runner::slots(
        &visible_gpus()?,
        spec.gpus_per_trial,
        spec.max_parallel,
        cpu_slots(),
    )
    .map_err(UsageError)?;
    crate::say!(
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
    if let Some(r) = rungs {
        crate::say!(
            "kiln sweep: ASHA judges trials at epochs {r:?}, keeping the best 1/{} at each",
            spec.asha.as_ref().map_or(0, |a| a.reduction)
        );
    }
    let plan = Plan {
        spec,
        base: &spec.base,
        sweep_dir,
        exe,
        slots: &slots,
        signals,
        asha_rungs: rungs,
    };
    runner::run(&plan, trials).with_context(|| format!("running trials in {}", sweep_dir.display()))
}

/// Submits the trials that are neither finished nor in Slurm's queue as one job
/// array, then (with `wait`) reports each trial as it leaves the queue; `None` when
/// it returned right after submitting.
fn run_slurm(
    spec: &SweepSpec,
    options: &SlurmSpec,
    sweep_dir: &Path,
    exe: &Path,
    trials: &[Trial],
    wait: bool,
    interrupt: &AtomicBool,
) -> anyhow::Result<Option<Vec<Outcome>>> {
    let metric = spec.metric.key();
    if let Some(why) = slurm::unusable_path(sweep_dir) {
        return Err(UsageError(why).into());
    }
    let name = slurm::job_name(sweep_dir);
    let mut jobs = slurm::load_jobs(sweep_dir).map_err(UsageError)?;
    let queued = slurm::active_trials(&name).map_err(UsageError)?;
    let mut outcomes: Vec<Option<Outcome>> = vec![None; trials.len()];
    let mut submit = Vec::new();
    for t in trials {
        if let Some(o) = runner::finished_earlier(sweep_dir, t, metric) {
            crate::say!("kiln sweep: trial {} finished earlier, skipped", t.index);
            outcomes[t.index] = Some(o);
        } else if queued.contains(&t.index) {
            crate::say!("kiln sweep: trial {} is still in Slurm's queue", t.index);
        } else {
            submit.push(t.index);
        }
    }
    if !submit.is_empty() {
        for &i in &submit {
            // A record from an earlier submission would read as this one's ending.
            let _ = std::fs::remove_file(runner::trial_dir(sweep_dir, i).join(slurm::RECORD));
        }
        let script = slurm::batch_script(&slurm::Batch {
            name: &name,
            sweep_dir,
            exe,
            trials: &submit,
            max_parallel: spec.max_parallel,
            gpus: spec.gpus_per_trial,
            options,
        });
        let path = sweep_dir
            .join("slurm")
            .join(format!("submit-{}.sh", jobs.len() + 1));
        std::fs::create_dir_all(path.parent().expect("has a parent"))?;
        std::fs::write(&path, script).with_context(|| format!("writing {}", path.display()))?;
        let id = slurm::submit(&path).map_err(UsageError)?;
        crate::say!(
            "kiln sweep: submitted {} trial(s) ({}) as Slurm job array {id} ({}); squeue -j {id} shows them, scancel {id} stops them",
            submit.len(),
            slurm::array_list(&submit),
            path.display()
        );
        jobs.push(slurm::Submission {
            job_id: id,
            trials: submit,
        });
        slurm::save_jobs(sweep_dir, &jobs)
            .with_context(|| format!("recording the job in {}", sweep_dir.display()))?;
    }
    if !wait {
        crate::say!(
            "kiln sweep: not waiting; kiln sweep --resume {} waits for the jobs and gathers the results",
            sweep_dir.display()
        );
        return Ok(None);
    }
    let mut waiting: BTreeSet<usize> = (0..trials.len())
        .filter(|&i| outcomes[i].is_none())
        .collect();
    let total = waiting.len();
    let started = std::time::Instant::now();
    let mut last_status = started;
    while !waiting.is_empty() && !interrupt.load(Ordering::SeqCst) {
        let active = slurm::active_trials(&name).map_err(anyhow::Error::msg)?;
        for i in waiting.clone() {
            if active.contains(&i) {
                continue;
            }
            waiting.remove(&i);
            let o = element_outcome(sweep_dir, &trials[i], metric);
            let done = total - waiting.len();
            crate::say!(
                "{}",
                runner::ended_line(&o, metric, &format!(" [{done}/{total}]"))
            );
            outcomes[i] = Some(o);
        }
        if last_status.elapsed().as_secs() >= 60 && !waiting.is_empty() {
            last_status = std::time::Instant::now();
            crate::say!(
                "kiln sweep: {}/{total} trials done, {} queued or running in Slurm ({name})",
                total - waiting.len(),
                waiting.len(),
            );
        }
        // Often at first, when short trials end, then gently on the controller.
        let pause = if started.elapsed().as_secs() < 60 {
            3
        } else {
            30
        };
        let until = std::time::Instant::now() + std::time::Duration::from_secs(pause);
        while !waiting.is_empty()
            && std::time::Instant::now() < until
            && !interrupt.load(Ordering::SeqCst)
        {
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
    if !waiting.is_empty() {
        crate::say!(
            "kiln sweep: {} trial(s) stay in Slurm's queue ({name}, jobs {}); scancel stops them",
            waiting.len(),
            jobs.iter()
                .map(|j| j.job_id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(Some(
        outcomes
            .into_iter()
            .enumerate()
            .map(|(i, o)| o.unwrap_or_else(|| runner::not_run(i)))
            .collect(),
    ))
}

/// How a trial that left Slurm's queue ended, from its element's record. Without one
/// (the element was killed, or shared storage has not shown the file yet, so it is
/// read again after 5 s) the trial's own `summary.json` decides.
fn element_outcome(sweep_dir: &Path, trial: &Trial, metric: &str) -> Outcome {
    let path = runner::trial_dir(sweep_dir, trial.index).join(slurm::RECORD);
    let read = || {
        std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<slurm::ElementRecord>(&t).ok())
    };
    let record = read().or_else(|| {
        std::thread::sleep(std::time::Duration::from_secs(5));
        read()
    });
    match record {
        Some(r) => runner::ended(sweep_dir, trial, metric, r.exit_code, r.place, r.wall_s),
        None => {
            let finished = runner::finished_earlier(sweep_dir, trial, metric).is_some();
            let place = "Slurm (no record: cancelled or killed?)".to_string();
            runner::ended(sweep_dir, trial, metric, finished.then_some(0), place, 0.0)
        }
    }
}

/// A Slurm array element: trial `index`'s `kiln train` here, on the GPUs Slurm gave
/// (or the CPU with `gpus_per_trial = 0`), and a record of how it ended.
fn run_element(spec: &SweepSpec, sweep_dir: &Path, index: usize) -> anyhow::Result<ExitCode> {
    let trials = spec.trials();
    let trial = trials.get(index).ok_or_else(|| {
        UsageError(format!(
            "--trial {index}: the sweep has {} trials",
            trials.len()
        ))
    })?;
    // Slurm signals the whole step when it cancels or times out the element: the
    // trial checkpoints and exits, and this process stays to record that.
    let _signals = Signals::for_supervisor();
    let exe = std::env::current_exe().context("finding the kiln executable")?;
    let placement = match spec.gpus_per_trial {
        0 => Placement::Cpu,
        _ => Placement::Gpus(None),
    };
    let started = std::time::Instant::now();
    let status = runner::train_command(spec, &spec.base, sweep_dir, &exe, trial, placement)
        .and_then(|mut c| c.status())
        .with_context(|| format!("starting trial {index}"))?;
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let record = slurm::ElementRecord {
        exit_code: status.code(),
        wall_s: started.elapsed().as_secs_f64(),
        place: format!(
            "{} (job {}_{})",
            env("SLURMD_NODENAME"),
            env("SLURM_ARRAY_JOB_ID"),
            env("SLURM_ARRAY_TASK_ID")
        ),
    };
    let path = runner::trial_dir(sweep_dir, index).join(slurm::RECORD);
    std::fs::write(&path, serde_json::to_string(&record)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(ExitCode::from(
        status.code().map_or(1, |c| c.clamp(0, 255) as u8),
    ))
}

fn write_results(
    spec: &SweepSpec,
    dir: &Path,
    trials: &[Trial],
    outcomes: &[runner::Outcome],
) -> anyhow::Result<()> {
    let csv = dir.join("results.csv");
    results::write_csv(&csv, spec, trials, outcomes)
        .with_context(|| format!("writing {}", csv.display()))?;
    crate::out!("{}", results::table(spec, trials, outcomes).trim_end());
    let plot = dir.join("metric.png");
    if let Err(e) = results::write_plot(&plot, spec, trials, outcomes) {
        crate::say!("kiln sweep: warning: no plot: {e}");
    }
    let best = results::best(outcomes, spec.goal);
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
        crate::out!("best: trial {i}, config in {}", to.display());
    }
    crate::out!("results: {}", csv.display());
    Ok(())
}

/// Every visible GPU as `(physical index or CUDA ordinal, UUID)`; none without a driver.
fn visible_gpus() -> anyhow::Result<Vec<(usize, String)>> {
    let cfg = DevicesConfig {
        backend: BackendChoice::Auto,
        ..DevicesConfig::default()
    };
    Ok(match super::setup::plan_devices(&cfg)? {
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
