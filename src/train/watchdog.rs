//! Notices a step that takes far longer than the steps before it: a hung GPU. It
//! records which device the step was waiting for in the run dir, aborts the gradient
//! exchange (so that no peer stays blocked in a collective waiting for this process)
//! and ends the process with exit code 75, so the supervisor restarts from the last
//! checkpoint (without that GPU when others remain). The first step of a process
//! compiles kernels and is not watched.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::exchange::Aborter;
use crate::run::failure::{Failure, write_failure};

/// Which device a step is still waiting for: (position, name).
pub type Pending = Box<dyn Fn() -> Option<(usize, String)> + Send>;

#[derive(Default)]
struct Beat {
    /// Step in progress and when it started; `None` between steps.
    current: Option<(u64, Instant)>,
    /// Recent step durations (s), for the automatic timeout.
    recent: Vec<f64>,
    armed: bool,
}

pub struct Watchdog {
    beat: Arc<Mutex<Beat>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The timeout: the configured one, or the larger of 300 s and 50 median steps.
pub fn timeout_s(configured: f64, recent: &[f64]) -> f64 {
    if configured > 0.0 {
        return configured;
    }
    let mut sorted = recent.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    (50.0 * median).max(300.0)
}

impl Watchdog {
    pub fn start(configured_s: f64, run_dir: PathBuf, pending: Pending, aborter: Aborter) -> Self {
        let beat = Arc::new(Mutex::new(Beat::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (b, s) = (beat.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("kiln-watchdog".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(200));
                    let (step, waited, limit) = {
                        let beat = b.lock().unwrap_or_else(|e| e.into_inner());
                        match (beat.armed, beat.current) {
                            (true, Some((step, since))) => {
                                (step, since.elapsed().as_secs_f64(), timeout_s(configured_s, &beat.recent))
                            }
                            _ => continue,
                        }
                    };
                    if waited > limit {
                        let (position, device) = pending().map_or((None, "unknown device".into()), |(p, n)| (Some(p), n));
                        let failure = Failure {
                            step,
                            device_position: position,
                            device: device.clone(),
                            kind: "hang".into(),
                            message: format!("no progress for {waited:.0} s (limit {limit:.0} s, watchdog.hang_timeout_s)"),
                            permanent: false,
                        };
                        let _ = write_failure(&run_dir, &failure);
                        crate::say!("kiln: error: step {step} hung on {device}: {}", failure.message);
                        aborter.abort(&format!("step {step} hung on {device}"));
                        std::process::exit(75);
                    }
                }
            })
            .expect("spawning the watchdog thread should succeed");
        Watchdog {
            beat,
            stop,
            thread: Some(thread),
        }
    }

    /// A watchdog that never fires (the bench and warmup, which have no run to
    /// restart).
    pub fn idle() -> Self {
        Watchdog {
            beat: Arc::new(Mutex::new(Beat::default())),
            stop: Arc::new(AtomicBool::new(true)),
            thread: None,
        }
    }

    pub fn step_started(&self, step: u64) {
        self.beat.lock().unwrap_or_else(|e| e.into_inner()).current = Some((step, Instant::now()));
    }

    /// Ends the step; the first one arms the watchdog.
    pub fn step_finished(&self) {
        let mut beat = self.beat.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, since)) = beat.current.take() {
            if beat.armed {
                beat.recent.push(since.elapsed().as_secs_f64());
                if beat.recent.len() > 50 {
                    beat.recent.remove(0);
                }
            }
            beat.armed = true;
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn automatic_timeout_is_fifty_median_steps_but_at_least_five_minutes() {
        assert_eq!(timeout_s(0.0, &[]), 300.0);
        assert_eq!(timeout_s(0.0, &[10.0, 12.0, 11.0]), 550.0);
        assert_eq!(timeout_s(0.0, &[0.1; 20]), 300.0);
        assert_eq!(timeout_s(7.5, &[10.0]), 7.5);
    }
}
