//! The one restart loop, shared by `kiln train`'s supervisor (one training process)
//! and `kiln launch` (one per GPU): run an attempt, read how it ended and the failure
//! record it left, and let the policy (`supervisor::decide`) say whether to end or to
//! start again from the latest checkpoint, perhaps without a failed GPU.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use super::failure::{UsedDevice, take_failure};
use super::supervisor::{Decision, decide};

/// How an attempt ended: its exit code (`None`: killed by a signal) and the devices it
/// used, in order.
pub struct Ended {
    pub code: Option<i32>,
    pub used: Vec<UsedDevice>,
}

/// Runs attempts until one ends for good; returns the exit code to end with. `who`
/// prefixes the notes ("supervisor", "launch"); `attempt` gets the devices to use
/// after a GPU was left out (`None`: as configured).
pub fn run_attempts<E>(
    who: &str,
    run_dir: &Path,
    max_restarts: u32,
    interrupted: &AtomicBool,
    mut attempt: impl FnMut(Option<&[UsedDevice]>) -> Result<Ended, E>,
) -> Result<i32, E> {
    let mut survivors: Option<Vec<UsedDevice>> = None;
    for done in 0.. {
        let ended = attempt(survivors.as_deref())?;
        if interrupted.load(Ordering::SeqCst) {
            return Ok(ended.code.unwrap_or(130));
        }
        let failure = take_failure(run_dir);
        match decide(
            ended.code,
            failure.as_ref(),
            &ended.used,
            done,
            max_restarts,
        ) {
            Decision::Finish(code) => {
                if code != 0 && done >= max_restarts && matches!(code, 75 | 101) {
                    crate::say!(
                        "kiln: {who}: giving up after {done} restart(s) (--max-restarts {max_restarts})"
                    );
                }
                return Ok(code);
            }
            Decision::Restart { devices, why } => {
                crate::say!(
                    "kiln: {who}: {why} (restart {} of {max_restarts}, from the latest checkpoint in {})",
                    done + 1,
                    run_dir.display()
                );
                if devices.is_some() {
                    survivors = devices;
                }
            }
        }
    }
    unreachable!("the loop returns")
}
