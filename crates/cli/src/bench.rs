//! `kvbridge bench` (not implemented yet).

use std::process::ExitCode;

/// Arguments of `kvbridge bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {}

pub(crate) fn run(_args: BenchArgs) -> ExitCode {
    eprintln!("kvbridge bench: not implemented yet");
    ExitCode::from(2)
}
