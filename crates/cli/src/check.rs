//! `kvbridge check` (not implemented yet).

use std::process::ExitCode;

/// Arguments of `kvbridge check`.
#[derive(Debug, clap::Args)]
pub(crate) struct CheckArgs {}

pub(crate) fn run(_args: CheckArgs) -> ExitCode {
    eprintln!("kvbridge check: not implemented yet");
    ExitCode::from(2)
}
