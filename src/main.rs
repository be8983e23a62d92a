//! kiln: parse the command line, dispatch, map the outcome to an exit code.

mod cli;
mod cmd;
mod collective;
mod config;
mod console;
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

// Every step hands the GPU a fresh batch of tens of megabytes (77 MB for ResNet-50 at
// 224 px), which cubecl 0.10 copies twice more before the upload. glibc maps each
// such allocation afresh and unmaps it on free, so every copy page-faults through new
// memory: 191 ms of ResNet-50's 491 ms step on an H200 host, against about 9 ms per
// copy into memory already touched. jemalloc keeps freed pages for reuse when it is
// told not to purge them (and not to purge large allocations eagerly in an arena of
// their own): the process keeps its peak host memory instead of returning it.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static malloc_conf: &[u8] = b"oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1\0";

fn main() -> ExitCode {
    let cli = cli::Cli::parse(); // clap exits 2 on usage errors
    console::set_verbosity(if cli.quiet {
        Some(console::Verbosity::Quiet)
    } else if cli.verbose {
        Some(console::Verbosity::Verbose)
    } else {
        None
    });
    match cmd::run(cli) {
        Ok(code) => code,
        Err(err) => {
            crate::say!("kiln: error: {err:#}");
            exit::code_for(&err)
        }
    }
}
