//! What kiln prints. A write to a closed pipe or a terminal that went away never ends
//! the process (the standard `eprintln!` panics on it): training goes on, and every
//! line is also appended to the run's log file (`train.log`) once one is opened, so
//! nothing printed is lost with the terminal.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

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

/// A line on stderr (and in the log); errors writing it are ignored.
pub fn line(text: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{text}");
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

/// `println!` that never fails ([`out`]).
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::console::out(&format!($($arg)*))
    };
}
