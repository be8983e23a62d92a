//! Runs the trials of a sweep, each a child `kiln train` in its own folder, at most one
//! per slot at a time. A GPU slot's trials see only its GPUs (`CUDA_VISIBLE_DEVICES`
//! holds their UUIDs, which renumbering cannot confuse); a CPU slot's trials train on
//! the CPU. A failing trial is recorded and the others go on.

use std::fs::File;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use super::asha::{Decision, Rungs};
use super::spec::{Goal, Metric, SweepSpec, Trial};
use crate::run::signals::Signals;

/// Where trials run.
#[derive(Debug, Clone, PartialEq)]
pub struct Slot {
    /// For people: `GPU 1`, `GPUs 0,1`, `CPU 2`.
    pub label: String,
    /// UUIDs for `CUDA_VISIBLE_DEVICES`; `None`: a CPU slot.
    pub visible: Option<String>,
}

/// Cuts the visible GPUs, `(physical index or ordinal, UUID)`, into slots of
/// `per_trial`; without GPUs, or with `per_trial` 0 (CPU trials), `cpu_slots` CPU
/// slots. At most `max_parallel` (0: no limit).
pub fn slots(
    gpus: &[(usize, String)],
    per_trial: usize,
    max_parallel: usize,
    cpu_slots: usize,
) -> Result<Vec<Slot>, String> {
    let mut out: Vec<Slot> = if gpus.is_empty() || per_trial == 0 {
        (0..cpu_slots.max(1))
            .map(|i| Slot {
                label: format!("CPU {i}"),
                visible: None,
            })
            .collect()
    } else {
        if gpus.len() < per_trial {
            return Err(format!(
                "gpus_per_trial = {per_trial}, but only {} GPU(s) are visible",
                gpus.len()
            ));
        }
        gpus.chunks_exact(per_trial)
            .map(|c| Slot {
                label: format!(
                    "GPU{} {}",
                    if c.len() > 1 { "s" } else { "" },
                    c.iter()
                        .map(|g| g.0.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                ),
                visible: Some(c.iter().map(|g| g.1.clone()).collect::<Vec<_>>().join(",")),
            })
            .collect()
    };
    if max_parallel > 0 {
        out.truncate(max_parallel);
    }
    Ok(out)
}

/// How a trial ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    pub index: usize,
    /// `finished`, `stopped by asha`, `failed`, `interrupted` or `not run`.
    pub status: String,
    pub exit_code: Option<i32>,
    pub metric: Option<f64>,
    pub run_dir: Option<PathBuf>,
    pub slot: String,
    pub wall_s: f64,
    /// The end of the trial's log, when it failed.
    pub log_tail: String,
}

pub fn trial_dir(sweep_dir: &Path, index: usize) -> PathBuf {
    sweep_dir.join(format!("trial-{index:03}"))
}

/// The run directory `kiln train` made inside a trial's folder (the newest, if several).
pub fn run_dir(trial_dir: &Path) -> Option<PathBuf> {
    let mut runs: Vec<PathBuf> = std::fs::read_dir(trial_dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("config.toml").is_file())
        .collect();
    runs.sort();
    runs.pop()
}

/// The trial's run directory when it holds a complete checkpoint to resume from (what
/// `kiln train --resume` needs: a `latest` pointer).
fn resumable_run(trial_dir: &Path) -> Option<PathBuf> {
    run_dir(trial_dir).filter(|r| r.join("checkpoints").join("latest").is_file())
}

/// `(status, metric)` from a run's `summary.json`.
pub fn summary(run_dir: &Path, metric_key: &str) -> Option<(String, Option<f64>)> {
    let text = std::fs::read_to_string(run_dir.join("summary.json")).ok()?;
    let doc: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some((
        doc["status"].as_str().unwrap_or("").to_string(),
        doc[metric_key].as_f64(),
    ))
}

fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Each row of a run's `metrics.csv`: its `epoch` cell and its `column` cell (`None`
/// where the file has no such column); `None` without a readable file.
fn metrics_cells(run_dir: &Path, column: &str) -> Option<Vec<(String, Option<String>)>> {
    let text = std::fs::read_to_string(run_dir.join("metrics.csv")).ok()?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next()?.split(',').collect();
    let find = |name: &str| header.iter().position(|h| *h == name);
    let (e, c) = (find("epoch"), find(column));
    Some(
        lines
            .map(|l| {
                let f: Vec<&str> = l.split(',').collect();
                let cell = |i: Option<usize>| i.and_then(|i| f.get(i)).map(|v| v.to_string());
                (cell(e).unwrap_or_default(), cell(c))
            })
            .collect(),
    )
}

/// Last finished epoch and its test accuracy, from a running trial's `metrics.csv`.
fn progress(run_dir: &Path) -> Option<(usize, String)> {
    let rows = metrics_cells(run_dir, "test_acc")?;
    let (_, acc) = rows.last()?;
    Some((rows.len(), acc.clone().unwrap_or_default()))
}

/// How a trial stopped by ASHA is named in outcomes and `results.csv`.
pub const STOPPED_BY_ASHA: &str = "stopped by asha";

/// The file in a trial's folder that records ASHA's decision to stop it, so that a
/// resumed sweep does not train it on.
const ASHA_STOP: &str = "asha-stopped.json";

/// Each finished epoch's test metric (`column` of `metrics.csv`), in epoch order.
fn epoch_metrics(run_dir: &Path, column: &str) -> Vec<(u32, f64)> {
    metrics_cells(run_dir, column)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(epoch, value)| {
            // An empty cell is a metric that was not finite (or not measured).
            let value = match value?.as_str() {
                "" => f64::NAN,
                v => v.parse().ok()?,
            };
            Some((epoch.parse().ok()?, value))
        })
        .collect()
}

/// ASHA in a running sweep: the rungs and what is compared there.
pub struct Asha {
    rungs: Rungs,
    reduction: u32,
    goal: Goal,
    /// The `metrics.csv` column the sweep's metric is made of.
    column: &'static str,
}

impl Asha {
    pub fn new(spec: &SweepSpec, rung_epochs: &[u32]) -> Option<Self> {
        let a = spec.asha.as_ref()?;
        Some(Asha {
            rungs: Rungs::new(rung_epochs),
            reduction: a.reduction,
            goal: spec.goal,
            column: match spec.metric {
                Metric::BestTestAcc | Metric::FinalTestAcc => "test_acc",
                Metric::FinalTestLoss => "test_loss",
            },
        })
    }

    /// Records every epoch of `run_dir` for `trial` without deciding; the last epoch.
    fn record(&mut self, trial: usize, run_dir: &Path) -> u32 {
        let mut last = 0;
        for (epoch, value) in epoch_metrics(run_dir, self.column) {
            self.rungs.record(trial, epoch, value);
            last = last.max(epoch);
        }
        last
    }

    /// Reports the epochs of `run_dir` after `after` for `trial`; the last epoch
    /// reported and, when a rung stops the trial, the line that says why.
    fn report(&mut self, trial: usize, run_dir: &Path, after: u32) -> (u32, Option<String>) {
        let mut last = after;
        for (epoch, value) in epoch_metrics(run_dir, self.column) {
            if epoch <= last {
                continue;
            }
            last = epoch;
            let d = self
                .rungs
                .report(trial, epoch, value, self.goal, self.reduction);
            if let Decision::Stop { rung, cutoff } = d {
                let n = self
                    .rungs
                    .counts()
                    .into_iter()
                    .find(|(e, _)| *e == rung)
                    .map_or(0, |c| c.1);
                let why = format!(
                    "kiln sweep: trial {trial} stopped by ASHA at epoch {rung}: {} {value:.4}, the best 1/{} of the {n} trial(s) at this rung needed {cutoff:.4}",
                    self.column, self.reduction
                );
                return (last, Some(why));
            }
        }
        (last, None)
    }
}

/// The trial's outcome if an earlier run of the sweep finished it, or ASHA stopped it.
pub fn finished_earlier(sweep_dir: &Path, trial: &Trial, metric: &str) -> Option<Outcome> {
    let dir = trial_dir(sweep_dir, trial.index);
    let run = run_dir(&dir)?;
    let (status, value) = summary(&run, metric)?;
    // A trial that finished as it was being stopped counts as finished.
    let status = if status == "finished" {
        "finished"
    } else if dir.join(ASHA_STOP).is_file() {
        STOPPED_BY_ASHA
    } else {
        return None;
    };
    Some(Outcome {
        index: trial.index,
        status: status.into(),
        exit_code: Some(0),
        metric: value,
        run_dir: Some(run),
        slot: String::new(),
        wall_s: 0.0,
        log_tail: String::new(),
    })
}

/// How a trial that ran ended, from its exit code and its folder.
pub fn ended(
    sweep_dir: &Path,
    trial: &Trial,
    metric: &str,
    code: Option<i32>,
    slot: String,
    wall_s: f64,
) -> Outcome {
    let dir = trial_dir(sweep_dir, trial.index);
    let run = run_dir(&dir);
    let sum = run.as_deref().and_then(|d| summary(d, metric));
    let state = match (code, &sum) {
        (Some(0), Some((s, _))) if s == "finished" => "finished",
        (Some(130), _) => "interrupted",
        _ => "failed",
    };
    let log_tail = if state == "failed" {
        self::log_tail(&dir.join("log.txt"), 8)
    } else {
        String::new()
    };
    Outcome {
        index: trial.index,
        status: state.into(),
        exit_code: code,
        metric: sum.and_then(|s| s.1),
        run_dir: run,
        slot,
        wall_s,
        log_tail,
    }
}

/// The line that reports a trial's end.
pub fn ended_line(o: &Outcome, metric: &str, progress: &str) -> String {
    format!(
        "kiln sweep: trial {} {} (exit {}) after {:.0} s{}{progress}",
        o.index,
        o.status,
        o.exit_code.map_or("by signal".into(), |c| c.to_string()),
        o.wall_s,
        o.metric
            .map_or(String::new(), |m| format!(", {metric} {m:.4}")),
    )
}

struct Running {
    slot: usize,
    trial: Trial,
    child: Child,
    started: Instant,
    /// The last epoch ASHA has seen.
    reported: u32,
    /// ASHA stopped it: it was sent SIGTERM (and checkpoints on its way out).
    stopped: bool,
}

/// Everything a sweep run needs besides the trials.
pub struct Plan<'a> {
    pub spec: &'a SweepSpec,
    pub base: &'a Path,
    pub sweep_dir: &'a Path,
    pub exe: &'a Path,
    pub slots: &'a [Slot],
    /// Trials get this process's signals (and die with it).
    pub signals: &'a Signals,
    /// `[asha]`'s rungs (epochs), when the sweep has it.
    pub asha_rungs: Option<&'a [u32]>,
}

/// Runs `trials` (skipping those already finished), returns every trial's outcome in
/// trial order.
pub fn run(plan: &Plan, trials: &[Trial]) -> std::io::Result<Vec<Outcome>> {
    let metric = plan.spec.metric.key();
    let mut asha = plan.asha_rungs.and_then(|r| Asha::new(plan.spec, r));
    // A resumed sweep's rungs hold what its trials reached before; a trial is judged
    // only at the rungs it reaches from now on.
    let mut reported = vec![0u32; trials.len()];
    if let Some(a) = &mut asha {
        for t in trials {
            if let Some(run) = run_dir(&trial_dir(plan.sweep_dir, t.index)) {
                reported[t.index] = a.record(t.index, &run);
            }
        }
    }
    let mut outcomes: Vec<Option<Outcome>> = vec![None; trials.len()];
    let mut queue: Vec<&Trial> = Vec::new();
    for t in trials {
        match finished_earlier(plan.sweep_dir, t, metric) {
            Some(outcome) => {
                let how = if outcome.status == STOPPED_BY_ASHA {
                    "was stopped by ASHA"
                } else {
                    "finished"
                };
                crate::say!("kiln sweep: trial {} {how} earlier, skipped", t.index);
                outcomes[t.index] = Some(outcome);
            }
            None => queue.push(t),
        }
    }
    queue.reverse();
    let total = queue.len();
    let bar = overall_bar(total);
    // Every line, this thread's or another's, goes above the bar on a terminal.
    let held = crate::console::hold_bar(&bar);
    let mut running: Vec<Running> = Vec::new();
    let mut free: Vec<usize> = (0..plan.slots.len()).rev().collect();
    let mut last_status = Instant::now();
    let mut ended = 0usize;
    loop {
        while !plan.signals.interrupted().load(Ordering::SeqCst)
            && !free.is_empty()
            && !queue.is_empty()
        {
            let slot = free.pop().expect("checked non-empty");
            let trial = queue.pop().expect("checked non-empty").clone();
            let child = start(plan, &trial, &plan.slots[slot])?;
            crate::say!(
                "kiln sweep: trial {} on {}: {}",
                trial.index,
                plan.slots[slot].label,
                trial.label()
            );
            running.push(Running {
                slot,
                reported: reported[trial.index],
                trial,
                child,
                started: Instant::now(),
                stopped: false,
            });
        }
        bar.set_position(ended as u64);
        bar.set_message(format!(
            "{} running, {} waiting",
            running.len(),
            queue.len()
        ));
        if running.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        // Once the user has interrupted the sweep, its trials are checkpointing: a
        // second signal would end them before their checkpoint.
        if let Some(a) = asha
            .as_mut()
            .filter(|_| !plan.signals.interrupted().load(Ordering::SeqCst))
        {
            for r in running.iter_mut().filter(|r| !r.stopped) {
                let dir = trial_dir(plan.sweep_dir, r.trial.index);
                let Some(run) = run_dir(&dir) else { continue };
                let (last, stop) = a.report(r.trial.index, &run, r.reported);
                r.reported = last;
                if let Some(why) = stop {
                    crate::say!("{why}");
                    // Recorded first: a sweep interrupted now still knows on resume.
                    let _ = std::fs::write(dir.join(ASHA_STOP), format!("{why}\n"));
                    // The trial's supervisor passes it on; the trial checkpoints and ends.
                    // SAFETY: kill(2) on the pid of a child not yet waited for.
                    unsafe { libc::kill(r.child.id() as i32, libc::SIGTERM) };
                    // Nor does a later interrupt reach it twice while it checkpoints.
                    plan.signals.forget(r.child.id());
                    r.stopped = true;
                }
            }
        }
        let mut i = 0;
        while i < running.len() {
            let Some(status) = running[i].child.try_wait()? else {
                i += 1;
                continue;
            };
            let r = running.swap_remove(i);
            plan.signals.forget(r.child.id());
            free.push(r.slot);
            ended += 1;
            let mut outcome = self::ended(
                plan.sweep_dir,
                &r.trial,
                metric,
                status.code(),
                plan.slots[r.slot].label.clone(),
                r.started.elapsed().as_secs_f64(),
            );
            if r.stopped {
                let dir = trial_dir(plan.sweep_dir, r.trial.index);
                if outcome.status == "finished" {
                    // It finished before the signal came: nothing to keep stopped.
                    let _ = std::fs::remove_file(dir.join(ASHA_STOP));
                } else if outcome.status == "interrupted" {
                    outcome.status = STOPPED_BY_ASHA.into();
                }
            }
            crate::say!(
                "{}",
                ended_line(&outcome, metric, &format!(" [{ended}/{total}]"))
            );
            outcomes[r.trial.index] = Some(outcome);
        }
        if last_status.elapsed() > Duration::from_secs(30) && !running.is_empty() {
            last_status = Instant::now();
            for r in &running {
                let dir = trial_dir(plan.sweep_dir, r.trial.index);
                let p = run_dir(&dir).and_then(|d| progress(&d));
                crate::say!(
                    "kiln sweep:   trial {} on {}: {:.0} s{}",
                    r.trial.index,
                    plan.slots[r.slot].label,
                    r.started.elapsed().as_secs_f64(),
                    p.map_or(String::new(), |(e, acc)| format!(
                        ", epoch {e} done, test acc {acc}"
                    ))
                );
            }
            crate::say!(
                "kiln sweep: {ended}/{total} trials done, {} running, {} waiting",
                running.len(),
                queue.len()
            );
        }
    }
    drop(held);
    bar.finish_and_clear();
    Ok(outcomes
        .into_iter()
        .enumerate()
        .map(|(i, o)| o.unwrap_or_else(|| not_run(i)))
        .collect())
}

/// The outcome of a trial that never started.
pub fn not_run(index: usize) -> Outcome {
    Outcome {
        index,
        status: "not run".into(),
        exit_code: None,
        metric: None,
        run_dir: None,
        slot: String::new(),
        wall_s: 0.0,
        log_tail: String::new(),
    }
}

/// The whole sweep's progress, drawn only when stderr is a terminal.
fn overall_bar(trials: usize) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(trials as u64);
    bar.set_style(
        ProgressStyle::with_template("sweep [{bar:30}] {pos}/{len} trials, {msg}, {elapsed}")
            .expect("static template is valid")
            .progress_chars("=> "),
    );
    bar.set_message("starting");
    bar
}

fn start(plan: &Plan, trial: &Trial, slot: &Slot) -> std::io::Result<Child> {
    let placement = match &slot.visible {
        Some(uuids) => Placement::Gpus(Some(uuids)),
        None => Placement::Cpu,
    };
    let mut cmd = train_command(
        plan.spec,
        plan.base,
        plan.sweep_dir,
        plan.exe,
        trial,
        placement,
    )?;
    plan.signals.spawn(&mut cmd)
}

/// Where a trial trains.
#[derive(Debug, Clone, Copy)]
pub enum Placement<'a> {
    /// On the GPUs these UUIDs name, or (`None`) on every GPU the process sees, as
    /// under Slurm, which sets `CUDA_VISIBLE_DEVICES` to the allocation.
    Gpus(Option<&'a str>),
    Cpu,
}

/// The trial's `kiln train`, writing into the trial's folder and its `log.txt`.
pub fn train_command(
    spec: &SweepSpec,
    base: &Path,
    sweep_dir: &Path,
    exe: &Path,
    trial: &Trial,
    placement: Placement,
) -> std::io::Result<Command> {
    let dir = trial_dir(sweep_dir, trial.index);
    std::fs::create_dir_all(&dir)?;
    let log = File::options()
        .create(true)
        .append(true)
        .open(dir.join("log.txt"))?;
    let mut cmd = Command::new(exe);
    cmd.arg("train")
        .arg("--config")
        .arg(base)
        .arg("--output")
        .arg(&dir)
        .arg("--max-restarts")
        .arg(spec.max_restarts.to_string());
    // An unfinished trial continues from its checkpoints; one stopped before its
    // first checkpoint starts again.
    if let Some(run) = resumable_run(&dir) {
        cmd.arg("--resume").arg(run);
    }
    for s in spec.set.iter().cloned().chain(trial.sets()) {
        cmd.arg("--set").arg(s);
    }
    match placement {
        Placement::Gpus(uuids) => {
            cmd.arg("--set").arg("devices.use=all");
            if let Some(uuids) = uuids {
                cmd.env("CUDA_VISIBLE_DEVICES", uuids);
            }
        }
        Placement::Cpu => {
            cmd.arg("--set").arg("devices.backend=cpu");
        }
    }
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    Ok(cmd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_are_cut_into_slots_that_name_them_by_uuid() {
        let gpus: Vec<(usize, String)> = (0..4).map(|i| (i, format!("GPU-{i}"))).collect();
        let s = slots(&gpus, 2, 0, 8).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[1].label, "GPUs 2,3");
        assert_eq!(s[1].visible.as_deref(), Some("GPU-2,GPU-3"));
        assert_eq!(slots(&gpus, 1, 3, 8).unwrap().len(), 3);
        assert!(slots(&gpus, 8, 0, 8).unwrap_err().contains("only 4 GPU(s)"));
        let cpu = slots(&[], 1, 0, 2).unwrap();
        assert_eq!((cpu.len(), cpu[0].visible.clone()), (2, None));
    }

    #[test]
    fn a_trial_resumes_only_from_a_complete_checkpoint() {
        let dir = crate::test_util::tempdir();
        let run = dir.path().join("debug-20261130-120000");
        std::fs::create_dir_all(run.join("checkpoints")).unwrap();
        std::fs::write(run.join("config.toml"), "").unwrap();
        // Stopped before its first checkpoint: start again, do not resume.
        assert_eq!(resumable_run(dir.path()), None);
        std::fs::write(run.join("checkpoints/latest"), "step-000000004").unwrap();
        assert_eq!(resumable_run(dir.path()), Some(run));
    }
}
