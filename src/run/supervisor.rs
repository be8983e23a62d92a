//! The supervisor: `kiln train` runs the training in a child process and restarts it
//! from the run's latest good checkpoint when it fails in a way that may pass: a
//! device lost or hung (exit 75: the failed GPU is left out of the next attempt, the
//! global batch stays), or a panic (101, how many CUDA faults arrive). Usage errors (2),
//! other failures (1), interrupts (130) and success end the run. The process is the
//! fault boundary, as with torchrun; the supervisor never touches CUDA.

use super::failure::{Failure, UsedDevice};

/// Exit codes, as `exit.rs` maps them.
const DEVICE_UNAVAILABLE: i32 = 75;
const PANIC: i32 = 101;

#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// End with this exit code.
    Finish(i32),
    /// Start again from the latest checkpoint, on these devices (UUIDs) or, with
    /// `None`, on the same ones.
    Restart {
        devices: Option<Vec<UsedDevice>>,
        why: String,
    },
}

/// What to do after a child exited with `code` (`None`: killed by a signal).
pub fn decide(
    code: Option<i32>,
    failure: Option<&Failure>,
    used: &[UsedDevice],
    restarts_done: u32,
    max_restarts: u32,
) -> Decision {
    let transient = match code {
        Some(DEVICE_UNAVAILABLE) | Some(PANIC) | None => !failure.is_some_and(|f| f.permanent),
        Some(_) => false,
    };
    let code_out = code.unwrap_or(PANIC);
    if !transient || restarts_done >= max_restarts {
        return Decision::Finish(code_out);
    }
    let what = match (code, failure) {
        (_, Some(f)) => format!(
            "{} {} at step {}: {}",
            f.device,
            if f.kind == "hang" { "hung" } else { "failed" },
            f.step,
            f.message
        ),
        (Some(PANIC), None) => "the training process panicked".to_string(),
        (None, None) => "the training process was killed".to_string(),
        (Some(c), None) => format!("the training process exited with {c}"),
    };
    // Leave the failed GPU out when others remain and all of them can be named.
    let remaining = failure
        .and_then(|f| f.device_position)
        .filter(|&p| p < used.len() && used.len() > 1 && used.iter().all(|d| !d.uuid.is_empty()))
        .map(|p| {
            used.iter()
                .enumerate()
                .filter(|(i, _)| *i != p)
                .map(|(_, d)| d.clone())
                .collect::<Vec<_>>()
        });
    Decision::Restart {
        why: match &remaining {
            Some(r) => format!(
                "{what}; restarting without it on {}",
                r.iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => format!("{what}; restarting"),
        },
        devices: remaining,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(n: usize) -> Vec<UsedDevice> {
        (0..n)
            .map(|i| UsedDevice {
                name: format!("cuda:{i} NVIDIA H200"),
                uuid: format!("GPU-{i}"),
            })
            .collect()
    }

    fn failure(pos: Option<usize>) -> Failure {
        Failure {
            step: 412,
            device_position: pos,
            device: "cuda:1 NVIDIA H200".into(),
            kind: "error".into(),
            message: "CUDA_ERROR_LAUNCH_FAILED".into(),
            permanent: false,
        }
    }

    #[test]
    fn decisions_on_a_table_of_exits() {
        let two = gpus(2);
        for (code, fail, restarts, expect_restart) in [
            (Some(0), None, 0, false),
            (Some(130), None, 0, false),
            (Some(2), None, 0, false),
            (Some(1), None, 0, false),
            (Some(75), Some(failure(Some(1))), 0, true),
            (Some(101), None, 0, true),
            (None, None, 0, true),
            (Some(75), Some(failure(Some(1))), 3, false),
        ] {
            let d = decide(code, fail.as_ref(), &two, restarts, 3);
            assert_eq!(
                matches!(d, Decision::Restart { .. }),
                expect_restart,
                "{code:?} {restarts}: {d:?}"
            );
        }
    }

    #[test]
    fn a_failure_that_cannot_pass_is_not_retried() {
        let none = Failure::unavailable("no CUDA driver".into());
        assert_eq!(
            decide(Some(75), Some(&none), &gpus(1), 0, 3),
            Decision::Finish(75)
        );
    }

    #[test]
    fn a_failed_gpu_is_left_out_and_the_others_kept_in_order() {
        let d = decide(Some(75), Some(&failure(Some(1))), &gpus(3), 0, 3);
        let Decision::Restart {
            devices: Some(left),
            why,
        } = d
        else {
            panic!("expected a restart without the GPU")
        };
        assert_eq!(
            left.iter().map(|d| d.uuid.as_str()).collect::<Vec<_>>(),
            vec!["GPU-0", "GPU-2"]
        );
        assert!(
            why.contains("failed at step 412") && why.contains("without it on cuda:0"),
            "{why}"
        );
    }

    #[test]
    fn the_last_device_or_a_cpu_run_restarts_on_the_same_devices() {
        let one = decide(Some(75), Some(&failure(Some(0))), &gpus(1), 0, 3);
        assert!(matches!(one, Decision::Restart { devices: None, .. }));
        let cpu = vec![
            UsedDevice {
                name: "cpu".into(),
                uuid: String::new()
            };
            2
        ];
        assert!(matches!(
            decide(Some(75), Some(&failure(Some(1))), &cpu, 0, 3),
            Decision::Restart { devices: None, .. }
        ));
        assert_eq!(
            decide(Some(101), None, &gpus(2), 1, 1),
            Decision::Finish(101)
        );
    }
}
