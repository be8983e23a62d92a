//! What kiln prints. A write to a closed pipe or a terminal that went away never ends
//! the process (the standard `eprintln!` panics on it): training goes on, and every
//! line is also appended to the run's log file (`train.log`) once one is opened, so
//! nothing printed is lost with the terminal.
//!
//! How much reaches the terminal is the user's choice (`--quiet`, `--verbose`); the log
//! file gets every line whatever it is.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use indicatif::ProgressBar;

/// The log file once opened; before that, the lines printed so far (a bounded number:
/// commands that never open a log keep no more).
enum Log {
    Pending(Vec<String>),
    File(File),
    Closed,
}

static LOG: Mutex<Log> = Mutex::new(Log::Pending(Vec::new()));

/// Lines kept before a log file is opened.
const PENDING_LINES: usize = 1000;

/// Appends the lines printed so far, and every line printed from now on, to `path`.
pub fn log_to(path: &Path) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let mut log = LOG.lock().unwrap_or_else(|e| e.into_inner());
    if let Log::Pending(lines) = &*log {
        for l in lines {
            file.write_all(format!("{l}\n").as_bytes())?;
        }
    }
    *log = Log::File(file);
    Ok(())
}

/// Copies `line` into the log file (or keeps it until one is opened); a failing log
/// is given up on, never the run.
pub fn log(line: &str) {
    let mut log = LOG.lock().unwrap_or_else(|e| e.into_inner());
    let failed = match &mut *log {
        Log::Pending(lines) => {
            if lines.len() < PENDING_LINES {
                lines.push(line.to_string());
            }
            false
        }
        Log::File(f) => f.write_all(format!("{line}\n").as_bytes()).is_err(),
        Log::Closed => false,
    };
    if failed {
        *log = Log::Closed;
    }
}

/// How much of what kiln says reaches the terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verbosity {
    /// Warnings and errors only (and the command's output on stdout).
    Quiet = 0,
    Normal = 1,
    /// Also the details ([`detail`]): checkpoint and test-pass times, the exchange's
    /// buckets.
    Verbose = 2,
}

static VERBOSITY: AtomicU8 = AtomicU8::new(Verbosity::Normal as u8);

/// The processes kiln starts (a supervised trainer, launched ranks, sweep trials)
/// inherit the choice through this variable.
const VERBOSITY_VAR: &str = "KILN_VERBOSITY";

impl Verbosity {
    fn name(self) -> &'static str {
        match self {
            Verbosity::Quiet => "quiet",
            Verbosity::Normal => "normal",
            Verbosity::Verbose => "verbose",
        }
    }
}

/// Sets the verbosity: `flag` when given (and passed down to the processes kiln
/// starts), else what the parent process passed down. Called first thing in `main`.
pub fn set_verbosity(flag: Option<Verbosity>) {
    let v = match flag {
        Some(v) => {
            // SAFETY: `main` calls this before any other thread runs.
            unsafe { std::env::set_var(VERBOSITY_VAR, v.name()) };
            v
        }
        None => {
            let passed = std::env::var(VERBOSITY_VAR).unwrap_or_default();
            [Verbosity::Quiet, Verbosity::Verbose]
                .into_iter()
                .find(|v| v.name() == passed)
                .unwrap_or(Verbosity::Normal)
        }
    };
    VERBOSITY.store(v as u8, Ordering::Relaxed);
}

pub fn verbosity() -> Verbosity {
    match VERBOSITY.load(Ordering::Relaxed) {
        0 => Verbosity::Quiet,
        2 => Verbosity::Verbose,
        _ => Verbosity::Normal,
    }
}

/// Whether a line is a warning or an error, which `--quiet` still shows: kiln words
/// them `...: warning: ...` and `...: error: ...`.
fn is_alert(text: &str) -> bool {
    text.contains("warning: ") || text.contains("error: ")
}

/// The progress bar drawn on stderr, if any, with the token of whoever holds it: a line
/// written from any thread while it is shown goes out around it
/// ([`ProgressBar::suspend`]), so it never tears the bar.
static BAR: Mutex<Option<(u64, ProgressBar)>> = Mutex::new(None);
static BAR_TOKENS: AtomicU64 = AtomicU64::new(0);

/// Routes the terminal's lines around `bar` (drawn on stderr) while the guard lives.
pub fn hold_bar(bar: &ProgressBar) -> HeldBar {
    let token = BAR_TOKENS.fetch_add(1, Ordering::Relaxed) + 1;
    *BAR.lock().unwrap_or_else(|e| e.into_inner()) = Some((token, bar.clone()));
    HeldBar(token)
}

/// [`hold_bar`]'s guard: dropped, lines go straight to stderr again (unless a later
/// bar holds them).
pub struct HeldBar(u64);

impl Drop for HeldBar {
    fn drop(&mut self) {
        let mut held = BAR.lock().unwrap_or_else(|e| e.into_inner());
        if held.as_ref().is_some_and(|(t, _)| *t == self.0) {
            *held = None;
        }
    }
}

/// `text` on stderr, around the progress bar when one is held; errors are ignored.
fn to_terminal(text: &str) {
    let bar = BAR
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map(|(_, bar)| bar.clone());
    around(bar, || {
        let _ = writeln!(std::io::stderr().lock(), "{text}");
    });
}

/// `write` with `bar` cleared from the terminal, drawn again after it.
fn around(bar: Option<ProgressBar>, write: impl FnOnce()) {
    match bar {
        Some(bar) => bar.suspend(write),
        None => write(),
    }
}

/// A line on stderr (and in the log); errors writing it are ignored. Under `--quiet`
/// only warnings and errors reach the terminal.
pub fn line(text: &str) {
    if verbosity() > Verbosity::Quiet || is_alert(text) {
        to_terminal(text);
    }
    log(text);
}

/// A detail: in the log always, on the terminal under `--verbose`.
pub fn detail(text: &str) {
    if verbosity() == Verbosity::Verbose {
        to_terminal(text);
    }
    log(text);
}

/// A line on stdout, the command's output (`--json`, tables); a reader that went away
/// is not an error of kiln's.
pub fn out(text: &str) {
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

/// `eprintln!` that never fails and is logged ([`line`]).
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::console::line(&format!($($arg)*))
    };
}

/// A [`detail`] line, formatted.
#[macro_export]
macro_rules! detail {
    ($($arg:tt)*) => {
        $crate::console::detail(&format!($($arg)*))
    };
}

/// `println!` that never fails ([`out`]).
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::console::out(&format!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use indicatif::{ProgressDrawTarget, TermLike};
    use std::sync::Arc;

    /// A terminal that records what is done to it.
    #[derive(Debug, Clone, Default)]
    struct Recorder(Arc<Mutex<Vec<String>>>);

    impl Recorder {
        fn take(&self) -> Vec<String> {
            std::mem::take(&mut *self.0.lock().unwrap())
        }
        fn push(&self, event: String) -> std::io::Result<()> {
            self.0.lock().unwrap().push(event);
            Ok(())
        }
    }

    impl TermLike for Recorder {
        fn width(&self) -> u16 {
            80
        }
        fn move_cursor_up(&self, n: usize) -> std::io::Result<()> {
            self.push(format!("up {n}"))
        }
        fn move_cursor_down(&self, n: usize) -> std::io::Result<()> {
            self.push(format!("down {n}"))
        }
        fn move_cursor_right(&self, n: usize) -> std::io::Result<()> {
            self.push(format!("right {n}"))
        }
        fn move_cursor_left(&self, n: usize) -> std::io::Result<()> {
            self.push(format!("left {n}"))
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.push(format!("line {s}"))
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            self.push(format!("str {s}"))
        }
        fn clear_line(&self) -> std::io::Result<()> {
            self.push("clear".into())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_line_goes_out_between_clearing_the_bar_and_drawing_it_again() {
        let term = Recorder::default();
        let target = ProgressDrawTarget::term_like(Box::new(term.clone()));
        let bar = ProgressBar::with_draw_target(Some(10), target);
        bar.set_position(3);
        assert!(!term.take().is_empty(), "the bar was drawn");
        around(None, || term.push("text".into()).unwrap());
        assert_eq!(term.take(), ["text"], "no bar: the line alone");
        around(Some(bar.clone()), || term.push("text".into()).unwrap());
        let seen = term.take();
        let at = |p: &dyn Fn(&String) -> bool| seen.iter().position(p);
        let (cleared, text) = (at(&|e| e == "clear"), at(&|e| e == "text"));
        let redrawn = seen.iter().rposition(|e| e.contains("3/10"));
        assert!(
            matches!((cleared, text, redrawn), (Some(c), Some(t), Some(r)) if c < t && t < r),
            "cleared, the line, drawn again: {seen:?}"
        );
    }

    #[test]
    fn a_held_bar_is_let_go_with_its_guard() {
        let bar = ProgressBar::hidden();
        let held = hold_bar(&bar);
        let token = held.0;
        drop(held);
        let now = BAR.lock().unwrap().as_ref().map(|(t, _)| *t);
        assert_ne!(now, Some(token));
    }
}
