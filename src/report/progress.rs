//! Progress while training: a bar with img/s and ETA on a terminal, plain lines when
//! stderr is not one (logs, CI), and a ticker that shows a slow first CUDA step is
//! compiling kernels rather than hung.

use std::cell::{Cell, RefCell};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

pub struct Progress {
    /// The bar, and its hold on the terminal's lines (`console::hold_bar`).
    bar: Option<ProgressBar>,
    held: RefCell<Option<crate::console::HeldBar>>,
    every: u64,
    epochs: u32,
    /// When the metrics were last read back for the bar.
    last_read: Cell<Instant>,
}

/// How often the bar's loss, accuracy and img/s are refreshed, whatever
/// `train.log_every_steps` is: each refresh is one read back from the devices.
const BAR_REFRESH: Duration = Duration::from_secs(1);

impl Progress {
    /// `every`: plain-line interval in steps.
    pub fn new(every: u64, epochs: u32) -> Self {
        Progress {
            bar: None,
            held: RefCell::new(None),
            every,
            epochs,
            last_read: Cell::new(Instant::now()),
        }
        .terminal(
            std::io::stderr().is_terminal()
                && crate::console::verbosity() > crate::console::Verbosity::Quiet,
        )
    }

    fn terminal(mut self, yes: bool) -> Self {
        if yes {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ETA {eta}")
                    .expect("static template is valid")
                    .progress_chars("=> "),
            );
            self.bar = Some(bar);
        }
        self
    }

    pub fn start_epoch(&self, epoch: u32, batches: u64, done: u64) {
        if let Some(bar) = &self.bar {
            // From the first epoch on, every line goes out around the bar; before it
            // there is no bar to draw.
            let mut held = self.held.borrow_mut();
            if held.is_none() {
                *held = Some(crate::console::hold_bar(bar));
            }
            bar.reset();
            bar.set_length(batches);
            bar.set_position(done);
            bar.set_prefix(format!("epoch {}/{}", epoch + 1, self.epochs));
            bar.set_message("");
        }
    }

    /// Called every step; `stats` only when values were read back from the device.
    pub fn step(
        &self,
        epoch: u32,
        batch: u64,
        batches: u64,
        step: u64,
        stats: Option<(f64, f64, f64)>,
    ) {
        let line = |(loss, acc, ips): (f64, f64, f64)| {
            format!(
                "epoch {}/{} batch {batch}/{batches} step {step}: loss {loss:.4} acc {:.2}% {ips:.0} img/s",
                epoch + 1,
                self.epochs,
                acc * 100.0
            )
        };
        match (&self.bar, stats) {
            (Some(bar), s) => {
                bar.set_position(batch);
                if let Some((loss, acc, ips)) = s {
                    bar.set_message(format!(
                        "loss {loss:.4} acc {:.2}% {ips:.0} img/s",
                        acc * 100.0
                    ));
                    // The log file gets what plain mode prints.
                    if step.is_multiple_of(self.every) {
                        crate::console::log(&line((loss, acc, ips)));
                    }
                }
            }
            (None, Some(s)) if step.is_multiple_of(self.every) => crate::say!("{}", line(s)),
            _ => {}
        }
    }

    /// Whether step `step` should read metrics back: for plain mode's lines, and for
    /// the bar once a second.
    pub fn wants_stats(&self, step: u64) -> bool {
        let due = step.is_multiple_of(self.every)
            || (self.bar.is_some() && self.last_read.get().elapsed() >= BAR_REFRESH);
        if due {
            self.last_read.set(Instant::now());
        }
        due
    }

    pub fn finish(&self) {
        self.held.take();
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Prints "still compiling" lines while the first step runs; stops when dropped.
pub struct Ticker {
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    pub fn start(what: String, cache_dir: PathBuf) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        let thread = std::thread::spawn(move || {
            let start = Instant::now();
            let mut next = Duration::from_secs(10);
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                if start.elapsed() >= next {
                    crate::say!(
                        "{what}: {:.0} s so far, {:.1} MB of kernels cached in {}",
                        start.elapsed().as_secs_f64(),
                        dir_size(&cache_dir) as f64 / 1e6,
                        cache_dir.display()
                    );
                    next += Duration::from_secs(if next.as_secs() < 60 { 10 } else { 30 });
                }
            }
        });
        Ticker {
            done,
            thread: Some(thread),
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn dir_size(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(every: u64, bar: bool) -> Progress {
        Progress {
            bar: None,
            held: RefCell::new(None),
            every,
            epochs: 1,
            last_read: Cell::new(Instant::now()),
        }
        .terminal(bar)
    }

    #[test]
    fn the_bar_reads_metrics_every_second_and_plain_lines_every_n_steps() {
        let (bar, plain) = (progress(100, true), progress(100, false));
        for p in [&bar, &plain] {
            assert!(!p.wants_stats(1));
            assert!(p.wants_stats(100));
            p.last_read.set(Instant::now() - 2 * BAR_REFRESH);
        }
        assert!(bar.wants_stats(101));
        assert!(!bar.wants_stats(102), "read a moment ago");
        assert!(
            !plain.wants_stats(101),
            "plain mode reads only for its lines"
        );
    }
}
