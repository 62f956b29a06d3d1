//! `kvbridge`: the command line for people.
//!
//! Each subcommand lives in its own module and owns its argument struct. Exit codes are shared:
//! 0 success, 1 "ran fine, answer is no" (e.g. incompatible peers, failed verification),
//! 2 bad input (unreadable file, bad JSON, invalid arguments).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod check;
mod demo;
mod explain;
mod plan;
mod progress;

/// Move an LLM's KV cache from prefill to decode servers, exactly.
#[derive(Debug, Parser)]
#[command(name = "kvbridge", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Plan which KV rows move where for one chunk (DCP token plan + coalesced runs).
    Plan(plan::PlanArgs),
    /// Check a prefill and a decode descriptor for compatibility and print the rank mapping.
    Check(check::CheckArgs),
    /// Explain a problem code (e.g. KVB-E007): what it means and how to fix it.
    Explain(explain::ExplainArgs),
    /// Run real prefill and decode processes moving a real-sized KV cache, verifying every byte.
    Demo(demo::DemoArgs),
    /// Measure transport throughput against a baseline measured in the same run.
    Bench(bench::BenchArgs),
}

/// Removes a shared-memory control directory of a process that could not (it died): its
/// socket, then the (then empty) directory. Anything else in it is left alone.
pub(crate) fn remove_control_dir(dir: &std::path::Path) {
    let _ = std::fs::remove_file(dir.join("ctl.sock"));
    let _ = std::fs::remove_dir(dir);
}

/// Resolves on the first SIGINT, SIGTERM or SIGHUP, with its name (never, when they cannot be
/// watched). Processes that own shared memory stop on it through their destructors instead of
/// dying with their control directories left behind.
pub(crate) async fn terminating_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        tracing::warn!("cannot watch for signals; a signal ends this process without cleanup");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "interrupted (SIGINT)",
        _ = term.recv() => "terminated (SIGTERM)",
        _ = hup.recv() => "hung up (SIGHUP)",
    }
}

/// A NIXL transport for `--transport nixl`, or why this build cannot make one.
#[cfg(feature = "nixl")]
pub(crate) fn nixl_transport() -> Result<std::sync::Arc<dyn kvbridge_transport::KvTransport>, String>
{
    kvbridge_nixl::NixlTransport::new()
        .map(|t| std::sync::Arc::new(t) as _)
        .map_err(|e| format!("NIXL transport: {e}"))
}

/// A NIXL transport for `--transport nixl`, or why this build cannot make one.
#[cfg(not(feature = "nixl"))]
pub(crate) fn nixl_transport() -> Result<std::sync::Arc<dyn kvbridge_transport::KvTransport>, String>
{
    Err(format!(
        "NIXL transport: {}",
        kvbridge_nixl::NixlError::NotBuilt
    ))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Plan(args) => plan::run(args),
        Command::Check(args) => check::run(args),
        Command::Explain(args) => explain::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => bench::run(args),
    }
}
