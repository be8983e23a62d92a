//! `kiln launch`: a multi-process run. One `kiln train` process per GPU (or `--nproc`
//! on the CPU), each told its rank through the environment (`device::world`) and shown
//! only its own GPU by UUID, all watched together: when one fails, the others are
//! stopped and every process restarts from the run's latest checkpoint, without a
//! failed GPU when others remain (the global batch stays; each process takes a larger
//! shard), up to `--max-restarts` times. With `--srun`, one `srun` step inside a Slurm
//! allocation takes the place of the local processes. Like the supervisor, it never
//! trains and never touches a GPU beyond probing which ones there are.

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::Path;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::setup::{plan_devices, resolve_train};
use crate::cli::{LaunchArgs, TrainArgs};
use crate::device::DevicePlan;
use crate::device::world::{
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
};
use crate::exit::UsageError;
use crate::run::failure::{RankProcess, UsedDevice, write_ranks};
use crate::run::launch_exits::{Exit, attempt_code, process_count};
use crate::run::restart::{Ended, run_attempts};
use crate::run::run_dir::{self, LOG_FILE};
use crate::run::signals::Signals;

/// After the first process of an attempt fails, how long the others get to notice
/// (they normally do at once: their link to it closed) before they are killed.
const GRACE: Duration = Duration::from_secs(30);

pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    let train = &args.train;
    if train.no_supervisor || train.supervised || train.run_dir.is_some() {
        return Err(UsageError(
            "kiln launch watches and restarts its processes itself; drop --no-supervisor".into(),
        )
        .into());
    }
    // Mistakes in the config end here, before any process starts; every attempt and
    // every rank shares one run dir, which the launcher owns.
    let resolved = resolve_train(train)?;
    let configured = if args.srun {
        Vec::new()
    } else {
        let gpus = match plan_devices(&resolved.config.devices)? {
            DevicePlan::Cuda { gpus, .. } => Some(
                gpus.iter()
                    .map(|g| UsedDevice {
                        name: format!("cuda:{} {}", g.ordinal, g.name),
                        uuid: g.uuid.clone(),
                    })
                    .collect::<Vec<_>>(),
            ),
            DevicePlan::Cpu { .. } => None,
        };
        let n = process_count(args.nproc, gpus.as_ref().map(Vec::len)).map_err(UsageError)?;
        match gpus {
            Some(g) => g.into_iter().take(n).collect(),
            None => vec![
                UsedDevice {
                    name: "cpu".into(),
                    uuid: String::new(),
                };
                n
            ],
        }
    };
    let run_dir = match &resolved.resume_dir {
        Some(dir) => dir.clone(),
        None => run_dir::create(&train.output, &resolved.name)?,
    };
    let (lock, note) = run_dir::lock(&run_dir)?;
    if let Some(n) = note {
        crate::say!("kiln: note: {n}");
    }
    let signals = Signals::for_supervisor();
    let _ = crate::console::log_to(&run_dir.join(LOG_FILE));
    let exe = std::env::current_exe().context("finding the kiln executable to start training")?;

    let code = run_attempts(
        "launch",
        &run_dir,
        train.max_restarts,
        signals.interrupted(),
        |survivors| -> anyhow::Result<Ended> {
            let used = survivors.map_or_else(|| configured.clone(), <[UsedDevice]>::to_vec);
            let code = if args.srun {
                srun_attempt(&exe, &args, &run_dir, &signals)?
            } else {
                local_attempt(&exe, &args, &run_dir, &used, &signals)?
            };
            Ok(Ended { code, used })
        },
    )?;
    // A run that never got to train (a usage, config or data error, no usable GPU)
    // leaves no empty run dir behind; anything it wrote beyond its start keeps it.
    if matches!(code, 2 | 75) && resolved.resume_dir.is_none() {
        drop(lock);
        run_dir::discard_unstarted(&run_dir);
    }
    Ok(super::supervise::exit_code(code))
}

/// `kiln train` for one attempt: the run dir to start or resume, and the user's config.
fn train_command(exe: &Path, train: &TrainArgs, run_dir: &Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.arg("train").arg("--output").arg(&train.output);
    if let Some(c) = &train.config {
        cmd.arg("--config").arg(c);
    }
    for s in &train.sets {
        cmd.arg("--set").arg(s);
    }
    if run_dir::has_checkpoint(run_dir) {
        cmd.arg("--resume").arg(run_dir);
    } else {
        cmd.arg("--run-dir").arg(run_dir);
    }
    cmd
}

/// One process per entry of `used` on this machine; their exits, in the order they came.
fn local_attempt(
    exe: &Path,
    args: &LaunchArgs,
    run_dir: &Path,
    used: &[UsedDevice],
    signals: &Signals,
) -> anyhow::Result<Option<i32>> {
    let port = match args.port {
        Some(p) => p,
        None => free_port().context("finding a free TCP port for rank 0")?,
    };
    let n = used.len();
    crate::say!(
        "kiln: launch: {n} process(es), rank 0 listening on port {port}: {}",
        used.iter()
            .enumerate()
            .map(|(r, d)| format!("rank {r} {}", d.name))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut echoes = Vec::new();
    for (rank, device) in used.iter().enumerate() {
        let mut cmd = train_command(exe, &args.train, run_dir);
        cmd.env(RANK, rank.to_string())
            .env(WORLD_SIZE, n.to_string())
            .env(LOCAL_RANK, rank.to_string())
            .env(LOCAL_WORLD_SIZE, n.to_string())
            .env(MASTER_ADDR, "127.0.0.1")
            .env(MASTER_PORT, port.to_string());
        if !device.uuid.is_empty() {
            // Its own GPU only, named by UUID: no renumbering can give it another
            // rank's. The config's own `devices.visible` would contradict it.
            cmd.env("CUDA_VISIBLE_DEVICES", &device.uuid)
                .arg("--set")
                .arg("devices.visible=\"\"");
        }
        // Through the launcher, whole lines at a time, so that the processes' lines do
        // not cut into each other; rank 0 keeps a terminal for its progress bar.
        if rank > 0 || !std::io::stderr().is_terminal() {
            cmd.stderr(Stdio::piped());
        }
        let mut child = match signals.spawn(&mut cmd) {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children);
                return Err(e).context("starting a training process");
            }
        };
        if let Some(err) = child.stderr.take() {
            let prefix = if rank > 0 {
                format!("rank {rank}: ")
            } else {
                String::new()
            };
            echoes.push(std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    let _ = std::io::stderr().write_all(format!("{prefix}{line}\n").as_bytes());
                }
            }));
        }
        children.push((rank, child));
    }
    let record: Vec<RankProcess> = children
        .iter()
        .map(|(rank, c)| RankProcess {
            rank: *rank,
            pid: c.id(),
            device: used[*rank].name.clone(),
        })
        .collect();
    if let Err(e) = write_ranks(run_dir, &record) {
        crate::say!(
            "kiln: warning: cannot record the processes in {}: {e}",
            run_dir.display()
        );
    }
    let exits = watch(children, signals);
    for e in echoes {
        let _ = e.join();
    }
    for (rank, code) in &exits {
        if *code != Some(0) {
            crate::say!(
                "kiln: launch: rank {rank} ({}) {}",
                used[*rank].name,
                match code {
                    Some(c) => format!("exited with {c}"),
                    None => "was killed".into(),
                }
            );
        }
    }
    Ok(attempt_code(&exits))
}

/// Waits for every process; once one has failed, the rest get [`GRACE`] to end on
/// their own, then are killed.
fn watch(mut running: Vec<(usize, Child)>, signals: &Signals) -> Vec<Exit> {
    let mut exits: Vec<Exit> = Vec::new();
    let mut failed_at: Option<Instant> = None;
    while !running.is_empty() {
        running.retain_mut(|(rank, child)| match child.try_wait() {
            Ok(None) => true,
            Ok(Some(status)) => {
                signals.forget(child.id());
                exits.push((*rank, status.code()));
                false
            }
            Err(_) => {
                signals.forget(child.id());
                exits.push((*rank, None));
                false
            }
        });
        if failed_at.is_none() && exits.iter().any(|(_, c)| *c != Some(0)) {
            failed_at = Some(Instant::now());
        }
        // An interrupt gives the processes the same grace to checkpoint.
        if failed_at.is_none() && signals.interrupted().load(Ordering::SeqCst) {
            failed_at = Some(Instant::now());
        }
        if failed_at.is_some_and(|t| t.elapsed() > GRACE) && !running.is_empty() {
            crate::say!(
                "kiln: launch: stopping rank(s) {} still running {} s after the first failure",
                running
                    .iter()
                    .map(|(r, _)| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                GRACE.as_secs()
            );
            stop(&mut running);
            for (rank, child) in &mut running {
                exits.push((*rank, child.wait().ok().and_then(|s| s.code())));
            }
            running.clear();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    exits
}

fn stop(children: &mut [(usize, Child)]) {
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
    }
}

/// One `srun` step of the allocation's tasks; each task reads its rank from Slurm.
/// srun ends the step when a task fails (`--kill-on-bad-exit`) and exits with the
/// failing task's code (128 + the signal for one killed by a signal).
fn srun_attempt(
    exe: &Path,
    args: &LaunchArgs,
    run_dir: &Path,
    signals: &Signals,
) -> anyhow::Result<Option<i32>> {
    let train = train_command(exe, &args.train, run_dir);
    let mut cmd = Command::new("srun");
    cmd.arg("--kill-on-bad-exit=1").args(&args.srun_args);
    cmd.arg(train.get_program()).args(train.get_args());
    crate::say!("kiln: launch: srun step for {}", run_dir.display());
    let child = signals.spawn(&mut cmd).map_err(|e| {
        UsageError(format!(
            "kiln launch --srun cannot start srun ({e}); run it inside a Slurm allocation (sbatch or salloc) on a node with Slurm's client"
        ))
    })?;
    Ok(match signals.wait(child)? {
        // A task killed by a signal: as the local launcher reports one.
        Some(c) if c > 128 && c != 130 => None,
        c => c,
    })
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
