//! One entry function per subcommand. This is glue: it resolves paths and plans, then
//! calls into the library modules; `anyhow` context is added here. What several
//! subcommands share is in `setup`.

mod bench;
mod devices;
mod dry_run;
mod eval;
mod export;
mod launch;
mod predict;
mod setup;
mod supervise;
mod sweep;
mod train;
mod warmup;

use std::process::ExitCode;

use crate::cli::{Cli, Command};

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Train(args) => train::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Predict(args) => predict::run(args),
        Command::Export(args) => export::run(args),
        Command::Devices(args) => devices::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Sweep(args) => sweep::run(args),
        Command::Launch(args) => launch::run(args),
        Command::Warmup(args) => warmup::run(args),
        Command::Completions { shell } => {
            // Written through `out!`, which a closed pipe cannot end.
            let mut script = Vec::new();
            let mut cli = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cli, "kiln", &mut script);
            crate::out!("{}", String::from_utf8_lossy(&script).trim_end());
            Ok(ExitCode::SUCCESS)
        }
    }
}
