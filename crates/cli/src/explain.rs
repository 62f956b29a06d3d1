//! `kvbridge explain` (not implemented yet).

use std::process::ExitCode;

/// Arguments of `kvbridge explain`.
#[derive(Debug, clap::Args)]
pub(crate) struct ExplainArgs {}

pub(crate) fn run(_args: ExplainArgs) -> ExitCode {
    eprintln!("kvbridge explain: not implemented yet");
    ExitCode::from(2)
}
