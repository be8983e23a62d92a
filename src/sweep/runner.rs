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

use super::spec::{SweepSpec, Trial};
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
    /// `finished`, `failed`, `interrupted` or `not run`.
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

/// Last finished epoch and its test accuracy, from a running trial's `metrics.csv`.
fn progress(run_dir: &Path) -> Option<(usize, String)> {
    let text = std::fs::read_to_string(run_dir.join("metrics.csv")).ok()?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next()?.split(',').collect();
    let rows: Vec<&str> = lines.collect();
    let last: Vec<&str> = rows.last()?.split(',').collect();
    let acc = header
        .iter()
        .position(|h| *h == "test_acc")
        .and_then(|i| last.get(i))
        .map(|v| v.to_string())
        .unwrap_or_default();
    Some((rows.len(), acc))
}

/// The trial's outcome if an earlier run of the sweep finished it.
pub fn finished_earlier(sweep_dir: &Path, trial: &Trial, metric: &str) -> Option<Outcome> {
    let run = run_dir(&trial_dir(sweep_dir, trial.index))?;
    let (status, value) = summary(&run, metric)?;
    (status == "finished").then(|| Outcome {
        index: trial.index,
        status: "finished".into(),
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
}

/// Runs `trials` (skipping those already finished), returns every trial's outcome in
/// trial order.
pub fn run(plan: &Plan, trials: &[Trial]) -> std::io::Result<Vec<Outcome>> {
    let metric = plan.spec.metric.key();
    let mut outcomes: Vec<Option<Outcome>> = vec![None; trials.len()];
    let mut queue: Vec<&Trial> = Vec::new();
    for t in trials {
        match finished_earlier(plan.sweep_dir, t, metric) {
            Some(outcome) => {
                crate::say!("kiln sweep: trial {} finished earlier, skipped", t.index);
                outcomes[t.index] = Some(outcome);
            }
            None => queue.push(t),
        }
    }
    queue.reverse();
    let total = queue.len();
    let bar = overall_bar(total);
    // Lines go above the bar on a terminal, and plainly to stderr otherwise.
    let say = |line: String| bar.suspend(|| crate::say!("{line}"));
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
            say(format!(
                "kiln sweep: trial {} on {}: {}",
                trial.index,
                plan.slots[slot].label,
                trial.label()
            ));
            running.push(Running {
                slot,
                trial,
                child,
                started: Instant::now(),
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
            let outcome = self::ended(
                plan.sweep_dir,
                &r.trial,
                metric,
                status.code(),
                plan.slots[r.slot].label.clone(),
                r.started.elapsed().as_secs_f64(),
            );
            say(ended_line(&outcome, metric, &format!(" [{ended}/{total}]")));
            outcomes[r.trial.index] = Some(outcome);
        }
        if last_status.elapsed() > Duration::from_secs(30) && !running.is_empty() {
            last_status = Instant::now();
            for r in &running {
                let dir = trial_dir(plan.sweep_dir, r.trial.index);
                let p = run_dir(&dir).and_then(|d| progress(&d));
                say(format!(
                    "kiln sweep:   trial {} on {}: {:.0} s{}",
                    r.trial.index,
                    plan.slots[r.slot].label,
                    r.started.elapsed().as_secs_f64(),
                    p.map_or(String::new(), |(e, acc)| format!(
                        ", epoch {e} done, test acc {acc}"
                    ))
                ));
            }
            say(format!(
                "kiln sweep: {ended}/{total} trials done, {} running, {} waiting",
                running.len(),
                queue.len()
            ));
        }
    }
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
