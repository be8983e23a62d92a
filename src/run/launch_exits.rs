//! `kiln launch`'s decisions, as pure functions: how many processes a run gets, and
//! what the exits of one attempt's processes mean for the run (then
//! [`super::supervisor::decide`] says whether to restart, and on which GPUs).

/// How one rank's process ended: its rank and exit code (`None`: killed by a signal),
/// listed in the order the processes ended.
pub type Exit = (usize, Option<i32>);

/// Processes for a run: `--nproc` if given (at most one per GPU on CUDA), else one
/// per GPU. `gpus`: the GPUs the config picks; `None` on the CPU.
pub fn process_count(nproc: Option<usize>, gpus: Option<usize>) -> Result<usize, String> {
    match (nproc, gpus) {
        (Some(0), _) => Err("--nproc 0: a run needs at least one process".into()),
        (Some(n), Some(g)) if n > g => Err(format!(
            "--nproc {n} needs {n} GPUs (one per process) but [devices] picks {g}; lower --nproc or pick more GPUs (--devices, devices.use)"
        )),
        (Some(n), _) => Ok(n),
        (None, Some(g)) => Ok(g),
        (None, None) => Err("training on the CPU: say how many processes with --nproc N".into()),
    }
}

/// The exit code standing for one attempt: 0 when every process finished. Otherwise a
/// failure that is not transient (1 failed, 2 usage, 130 interrupted) wins over the
/// transient ones it caused in the other processes ("rank 0 left", exit 75); among
/// transient ones, the first process to fail names the cause. `None`: killed.
pub fn attempt_code(exits: &[Exit]) -> Option<i32> {
    let transient = |c: &Option<i32>| matches!(c, None | Some(75) | Some(101));
    if let Some((_, c)) = exits
        .iter()
        .find(|(_, c)| c.is_some() && !transient(c) && *c != Some(0))
    {
        return *c;
    }
    match exits.iter().find(|(_, c)| *c != Some(0)) {
        Some((_, c)) => *c,
        None => Some(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_follow_nproc_or_the_gpus() {
        assert_eq!(process_count(None, Some(2)), Ok(2));
        assert_eq!(process_count(Some(1), Some(2)), Ok(1));
        assert_eq!(process_count(Some(3), None), Ok(3));
        assert!(
            process_count(Some(3), Some(2))
                .unwrap_err()
                .contains("needs 3 GPUs")
        );
        assert!(process_count(None, None).unwrap_err().contains("--nproc"));
        assert!(process_count(Some(0), None).is_err());
    }

    #[test]
    fn the_attempt_is_judged_by_its_cause_not_by_the_echoes() {
        for (exits, code) in [
            (vec![(0, Some(0)), (1, Some(0))], Some(0)),
            // Rank 1 failed on its GPU; rank 0 then lost it.
            (vec![(1, Some(75)), (0, Some(75))], Some(75)),
            // Rank 1 was killed; rank 0 then lost it.
            (vec![(1, None), (0, Some(75))], None),
            // A non-finite loss on rank 0 (not transient) beats the loss of rank 0
            // that rank 1 saw first.
            (vec![(1, Some(75)), (0, Some(1))], Some(1)),
            (vec![(0, Some(130)), (1, Some(130))], Some(130)),
            (vec![(0, Some(2)), (1, Some(75))], Some(2)),
            (vec![(1, Some(101)), (0, Some(75))], Some(101)),
        ] {
            assert_eq!(attempt_code(&exits), code, "{exits:?}");
        }
    }
}
