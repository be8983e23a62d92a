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
use std::sync::atomic::{AtomicU8, Ordering};

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

/// A line on stderr (and in the log); errors writing it are ignored. Under `--quiet`
/// only warnings and errors reach the terminal.
pub fn line(text: &str) {
    if verbosity() > Verbosity::Quiet || is_alert(text) {
        let _ = writeln!(std::io::stderr().lock(), "{text}");
    }
    log(text);
}

/// A detail: in the log always, on the terminal under `--verbose`.
pub fn detail(text: &str) {
    if verbosity() == Verbosity::Verbose {
        let _ = writeln!(std::io::stderr().lock(), "{text}");
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
