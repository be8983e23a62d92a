//! Signals, as users of a long job expect them: SIGINT and SIGTERM (Ctrl-C, `kill`,
//! systemd, Slurm's `scancel`) stop a run at the next step with a checkpoint, a second
//! one at once; SIGHUP (the terminal or SSH session went away) is ignored, as under
//! `nohup`, and training goes on. A supervisor (the one of `kiln train`, `kiln
//! launch`, a sweep) puts each child in a process group of its own and passes every
//! signal it gets on to it, once; a child dies with its parent, so a supervisor killed
//! with SIGKILL leaves no training behind.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use signal_hook::consts::{SIGINT, SIGTERM};

use crate::exit::INTERRUPTED;

/// What a process does with SIGINT and SIGTERM.
pub struct Signals {
    interrupted: Arc<AtomicBool>,
    children: Arc<Mutex<Vec<u32>>>,
}

impl Signals {
    /// For a process that trains: the first signal sets the flag (the loop checkpoints
    /// and exits 130), a second ends the process at once.
    pub fn for_trainer() -> Self {
        Self::install(|first| {
            if first {
                crate::say!(
                    "kiln: interrupt: finishing this step and saving a checkpoint (interrupt again to quit now)"
                );
            } else {
                crate::say!("kiln: second interrupt, exiting without a checkpoint");
                std::process::exit(INTERRUPTED as i32);
            }
        })
    }

    /// For a supervisor: every signal sets the flag and goes on to the children
    /// ([`Signals::spawn`]), which checkpoint (or, on a second one, exit at once).
    pub fn for_supervisor() -> Self {
        Self::install(|_| {})
    }

    fn install(on_signal: impl Fn(bool) + Send + 'static) -> Self {
        ignore_hangup();
        let interrupted = Arc::new(AtomicBool::new(false));
        let children: Arc<Mutex<Vec<u32>>> = Arc::new(Mutex::new(Vec::new()));
        match signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) {
            Ok(mut signals) => {
                let (flag, kids) = (interrupted.clone(), children.clone());
                let spawned = std::thread::Builder::new()
                    .name("kiln-signals".into())
                    .spawn(move || {
                        for sig in signals.forever() {
                            let first = !flag.swap(true, Ordering::SeqCst);
                            for &pid in kids.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                                // SAFETY: sends a signal to a child this process started
                                // and has not reaped yet.
                                unsafe { libc::kill(pid as libc::pid_t, sig) };
                            }
                            on_signal(first);
                        }
                    });
                if let Err(e) = spawned {
                    crate::say!("kiln: warning: cannot watch for signals ({e})");
                }
            }
            Err(e) => crate::say!(
                "kiln: warning: cannot catch interrupts ({e}); an interrupt will lose progress since the last checkpoint"
            ),
        }
        Signals {
            interrupted,
            children,
        }
    }

    /// Set once SIGINT or SIGTERM arrived.
    pub fn interrupted(&self) -> &AtomicBool {
        &self.interrupted
    }

    /// The flag, to hand to the training loop.
    pub fn flag(&self) -> Arc<AtomicBool> {
        self.interrupted.clone()
    }

    /// Starts `cmd` as a child that gets this process's signals (and only through it:
    /// a process group of its own, so a terminal's Ctrl-C does not reach it twice) and
    /// dies when this process dies.
    pub fn spawn(&self, cmd: &mut Command) -> std::io::Result<Child> {
        let parent = std::process::id() as libc::pid_t;
        cmd.process_group(0);
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (prctl, getppid, _exit).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before prctl: then nothing would kill us.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        self.children
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(child.id());
        // A signal that came while the child was starting is passed on now.
        if self.interrupted.load(Ordering::SeqCst) {
            // SAFETY: as in the signal thread.
            unsafe { libc::kill(child.id() as libc::pid_t, SIGTERM) };
        }
        Ok(child)
    }

    /// Forgets a child once it has been reaped, so its pid is never signalled again.
    pub fn forget(&self, pid: u32) {
        self.children
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|&p| p != pid);
    }

    /// Waits for `child` and returns its exit code (`None`: killed by a signal).
    pub fn wait(&self, mut child: Child) -> std::io::Result<Option<i32>> {
        let status = child.wait();
        self.forget(child.id());
        Ok(status?.code())
    }
}

/// SIGHUP is ignored, by this process and (inherited through exec) its children.
fn ignore_hangup() {
    // SAFETY: setting a signal's disposition to "ignore" has no preconditions.
    unsafe { libc::signal(libc::SIGHUP, libc::SIG_IGN) };
}
