//! The run directory: made fresh (`DIR/<config>-<UTC time>/`), or found again to
//! resume (named, or the newest run of a config), with the config it resumes with
//! checked against the run's own; and owned by one live process at a time (a lock
//! file), so a second `kiln train` on the same run is refused instead of overwriting
//! the first one's checkpoints.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use super::checkpoints::Store;
use crate::config::{self, Config, ConfigError};

/// Keys whose change would make a resumed run a different run (other network, other
/// data order); everything else may change between resumes and is listed.
const FIXED_ON_RESUME: &[&str] = &[
    "model.",
    "data.dataset",
    "data.image_size",
    "data.max_train_samples",
    "data.synthetic_",
    "train.batch_size",
    "train.seed",
];

#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("kiln train needs --config FILE (or --resume RUN_DIR)")]
    NoConfig,
    #[error("--resume without a RUN_DIR needs --config to know which run to continue")]
    ResumeWhich,
    #[error(
        "--resume: no run of {} with a checkpoint under {}; start one without --resume, or name the run dir",
        config.display(),
        output.display()
    )]
    NoRunToResume { config: PathBuf, output: PathBuf },
    #[error("--resume {}: not a kiln run directory (no config.toml)", dir.display())]
    NotARun { dir: PathBuf },
    #[error(
        "--resume {}: these keys define the run and cannot change when resuming: {}; start a new run instead",
        dir.display(),
        changes.join(", ")
    )]
    Fixed { dir: PathBuf, changes: Vec<String> },
    #[error("cannot create {}", path.display())]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{} is in use by another kiln process ({holder}); two processes on one run would overwrite each other's checkpoints: wait for it to end, or stop it",
        dir.display()
    )]
    InUse { dir: PathBuf, holder: String },
    #[error("cannot lock {}", path.display())]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What `kiln train` works out before anything starts.
#[derive(Debug)]
pub struct Resolved {
    /// The run to continue (`--resume`).
    pub resume_dir: Option<PathBuf>,
    pub config: Config,
    /// The config file's stem: fresh runs are named after it.
    pub name: String,
    /// What changed since the run's own config (resuming).
    pub notes: Vec<String>,
}

/// What the user asked for: a config file, `--set`s, `--resume [DIR]`, `--output`.
pub struct Request<'a> {
    pub config: Option<&'a Path>,
    pub sets: &'a [String],
    /// `None`: a new run; `Some(None)`: the newest run of this config.
    pub resume: Option<Option<&'a Path>>,
    pub output: &'a Path,
}

/// The run to continue (if any), the config and its name, and notes on what changed.
pub fn resolve(req: &Request) -> Result<Resolved, RunDirError> {
    let resume_dir = match req.resume {
        None => None,
        Some(None) => Some(newest_run(req.config, req.output)?),
        Some(Some(p)) => Some(p.to_path_buf()),
    };
    let path = match (req.config, &resume_dir) {
        (Some(p), _) => p.to_path_buf(),
        (None, Some(dir)) => {
            let own = dir.join("config.toml");
            if !own.is_file() {
                return Err(RunDirError::NotARun { dir: dir.clone() });
            }
            own
        }
        (None, None) => return Err(RunDirError::NoConfig),
    };
    let config = config::load(&path, req.sets)?;
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".into());
    let notes = match &resume_dir {
        Some(dir) => check_resumable(dir, &config)?,
        None => Vec::new(),
    };
    Ok(Resolved {
        resume_dir,
        config,
        name,
        notes,
    })
}

/// Whether `run_dir` holds a checkpoint to resume from: a complete one (its manifest
/// written last), whatever the `latest` pointer says.
pub fn has_checkpoint(run_dir: &Path) -> bool {
    !Store::new(run_dir).list().is_empty()
}

/// The newest run of `config` under `output` that has a checkpoint.
fn newest_run(config: Option<&Path>, output: &Path) -> Result<PathBuf, RunDirError> {
    let config = config.ok_or(RunDirError::ResumeWhich)?;
    let stem = config
        .file_stem()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let prefix = format!("{stem}-");
    let mut runs: Vec<PathBuf> = std::fs::read_dir(output)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
                && has_checkpoint(p)
        })
        .collect();
    runs.sort();
    runs.pop().ok_or_else(|| RunDirError::NoRunToResume {
        config: config.to_path_buf(),
        output: output.to_path_buf(),
    })
}

/// The run dir must hold a run; keys that define the run must not change.
fn check_resumable(dir: &Path, config: &Config) -> Result<Vec<String>, RunDirError> {
    let saved_path = dir.join("config.toml");
    if !saved_path.is_file() {
        return Err(RunDirError::NotARun {
            dir: dir.to_path_buf(),
        });
    }
    let mut saved = config::load(&saved_path, &[])?;
    // The recorded root is absolute; compare the rest as the user wrote it.
    saved.data.root = config.data.root.clone();
    let changes = config::diff(&saved, config);
    let fixed: Vec<String> = changes
        .iter()
        .filter(|(k, _, _)| FIXED_ON_RESUME.iter().any(|f| k.starts_with(f)))
        .map(|(k, a, b)| format!("{k}: {a} -> {b}"))
        .collect();
    if !fixed.is_empty() {
        return Err(RunDirError::Fixed {
            dir: dir.to_path_buf(),
            changes: fixed,
        });
    }
    Ok(changes
        .into_iter()
        .map(|(k, a, b)| format!("resuming with {k} changed from {a} to {b}"))
        .collect())
}

/// A new run dir under `output`, named after the config and the UTC time.
pub fn create(output: &Path, name: &str) -> Result<PathBuf, RunDirError> {
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| RunDirError::Create { path, source }
    };
    std::fs::create_dir_all(output).map_err(err(output))?;
    let stamp: String = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        .to_string()
        .chars()
        .filter(|c| c.is_ascii_digit() || *c == 'T')
        .map(|c| if c == 'T' { '-' } else { c })
        .collect();
    for n in 0.. {
        let dir = output.join(if n == 0 {
            format!("{name}-{stamp}")
        } else {
            format!("{name}-{stamp}-{n}")
        });
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(err(&dir)(e)),
        }
    }
    unreachable!("some suffix is free")
}

/// Removes a run dir this command made when the run ended before it trained (a usage,
/// config or data error): only kiln's own start-up files are in it, and leaving it
/// would make `--resume` of the config find an empty run. Anything else in it (a
/// checkpoint, a file of the user's) keeps it.
pub fn discard_unstarted(dir: &Path) {
    const STARTUP: &[&str] = &[
        "config.toml",
        "devices.json",
        "ranks.json",
        LOG_FILE,
        LOCK_FILE,
        "failure.json",
    ];
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let only_startup = entries
        .filter_map(|e| e.ok())
        .all(|e| STARTUP.contains(&e.file_name().to_string_lossy().as_ref()));
    if only_startup {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// What kiln prints for a run, kept in its run dir.
pub const LOG_FILE: &str = "train.log";

/// The lock file in a run (or sweep) dir.
pub const LOCK_FILE: &str = "kiln.lock";

/// A run dir owned by this process until dropped (the kernel releases the lock when
/// the process ends, however it ends).
#[derive(Debug)]
pub struct DirLock {
    file: File,
}

impl Drop for DirLock {
    /// A process that ends cleanly leaves the file empty, so the next owner has nothing
    /// to report; one that was killed leaves its name for the next owner's note. The
    /// file itself stays: removing a locked file would let two processes lock two files.
    fn drop(&mut self) {
        let _ = self.file.set_len(0);
    }
}

/// Who holds a lock, as its file says: `pid 123 on host, since 2026-12-03T08:00:00Z`.
fn holder_text() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "this host".into());
    format!(
        "pid {} on {host}, since {}",
        std::process::id(),
        humantime::format_rfc3339_seconds(std::time::SystemTime::now())
    )
}

/// Takes `dir`'s lock for this process, or says who holds it. A lock file left by a
/// process that is gone is taken over (the kernel released its lock), with a note.
pub fn lock(dir: &Path) -> Result<(DirLock, Option<String>), RunDirError> {
    let path = dir.join(LOCK_FILE);
    let lock_err = |source| RunDirError::Lock {
        path: path.clone(),
        source,
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(lock_err)?;
    let mut previous = String::new();
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let _ = file.read_to_string(&mut previous);
            return Err(RunDirError::InUse {
                dir: dir.to_path_buf(),
                holder: match previous.trim() {
                    "" => "its owner is still starting".into(),
                    h => h.to_string(),
                },
            });
        }
        Err(TryLockError::Error(e)) => return Err(lock_err(e)),
    }
    let _ = file.read_to_string(&mut previous);
    let note = (!previous.trim().is_empty()).then(|| {
        format!(
            "{} was held by a kiln process that is gone ({}); taking it over",
            path.display(),
            previous.trim()
        )
    });
    let write = |f: &mut File| -> std::io::Result<()> {
        f.set_len(0)?;
        f.rewind()?;
        f.write_all(format!("{}\n", holder_text()).as_bytes())?;
        f.sync_all()
    };
    write(&mut file).map_err(lock_err)?;
    Ok((DirLock { file }, note))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_a_dead_holders_is_taken_over() {
        let dir = crate::test_util::tempdir();
        let (held, note) = lock(dir.path()).unwrap();
        assert!(note.is_none());
        let e = lock(dir.path()).unwrap_err().to_string();
        assert!(e.contains("in use by another kiln process"), "{e}");
        assert!(
            e.contains(&format!("pid {}", std::process::id())) && e.contains("since"),
            "{e}"
        );
        // A clean end leaves an empty file: the next owner has nothing to say.
        drop(held);
        let (again, note) = lock(dir.path()).unwrap();
        assert!(note.is_none(), "{note:?}");
        drop(again);
        // A killed process leaves its name in the file, and no lock.
        std::fs::write(
            dir.path().join(LOCK_FILE),
            "pid 1 on elsewhere, since then\n",
        )
        .unwrap();
        let (_again, note) = lock(dir.path()).unwrap();
        let note = note.expect("a note about the previous holder");
        assert!(
            note.contains("is gone") && note.contains("pid 1 on elsewhere"),
            "{note}"
        );
    }

    #[test]
    fn an_unstarted_run_dir_is_removed_and_one_with_anything_else_kept() {
        let out = crate::test_util::tempdir();
        let dir = create(out.path(), "run").unwrap();
        std::fs::write(dir.join("config.toml"), "").unwrap();
        std::fs::write(dir.join(LOG_FILE), "kiln: error").unwrap();
        discard_unstarted(&dir);
        assert!(!dir.exists());
        let dir = create(out.path(), "run").unwrap();
        std::fs::create_dir(dir.join("checkpoints")).unwrap();
        discard_unstarted(&dir);
        assert!(dir.exists());
    }

    #[test]
    fn a_run_with_checkpoints_but_no_latest_pointer_is_still_resumable() {
        let dir = crate::test_util::tempdir();
        let store = Store::new(dir.path());
        assert!(!has_checkpoint(dir.path()));
        store
            .save(4, None, |d| {
                std::fs::write(d.join("state.json"), "{}").unwrap();
                Ok(())
            })
            .unwrap();
        std::fs::remove_file(store.root().join("latest")).unwrap();
        assert!(has_checkpoint(dir.path()));
    }
}
