//! `kvbridge demo` (not implemented yet).

use std::process::ExitCode;

/// Arguments of `kvbridge demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {}

pub(crate) fn run(_args: DemoArgs) -> ExitCode {
    eprintln!("kvbridge demo: not implemented yet");
    ExitCode::from(2)
}
