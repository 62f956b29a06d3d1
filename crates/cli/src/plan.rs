//! `kvbridge plan` (not implemented yet).

use std::process::ExitCode;

/// Arguments of `kvbridge plan`.
#[derive(Debug, clap::Args)]
pub(crate) struct PlanArgs {}

pub(crate) fn run(_args: PlanArgs) -> ExitCode {
    eprintln!("kvbridge plan: not implemented yet");
    ExitCode::from(2)
}
