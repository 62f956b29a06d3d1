//! `kvbridge`: the command line for people: plan, check and explain.
//!
//! Each subcommand lives in its own module and owns its argument struct. Exit codes are shared:
//! 0 success, 1 "ran fine, answer is no" (e.g. incompatible peers), 2 bad input (unreadable
//! file, bad JSON, invalid arguments). The demo and the benchmarks are the lab's
//! (`kvbridge-lab`, crates/lab), not part of this tool.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod check;
mod explain;
mod plan;

/// Move an LLM's KV cache from prefill to decode servers, exactly.
#[derive(Debug, Parser)]
#[command(name = "kvbridge", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Plan which KV rows move where for one chunk (DCP token plan + coalesced runs).
    Plan(plan::PlanArgs),
    /// Check a prefill and a decode descriptor for compatibility and print the rank mapping.
    Check(check::CheckArgs),
    /// Explain a problem code (e.g. KVB-E007): what it means and how to fix it.
    Explain(explain::ExplainArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Plan(args) => plan::run(args),
        Command::Check(args) => check::run(args),
        Command::Explain(args) => explain::run(args),
    }
}
