//! kiln: parse the command line, dispatch, map the outcome to an exit code.

mod cli;
mod cmd;
mod config;
mod data;
mod device;
mod exit;
mod model;
mod ops;
mod report;
mod run;
mod sweep;
#[cfg(test)]
mod test_util;
mod train;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse(); // clap exits 2 on usage errors
    match cmd::run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("kiln: error: {err:#}");
            exit::code_for(&err)
        }
    }
}
