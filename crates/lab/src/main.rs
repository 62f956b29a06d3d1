//! `kvbridge-lab`: kvbridge's lab, the demo and the benchmarks.
//!
//! `demo` runs real prefill and decode processes moving a real-sized KV cache, verifying every
//! byte; `bench` measures each transport and the end to end against a baseline measured in the
//! same run; `trace-svg` draws a `demo --trace` file as an SVG timeline. Exit codes: 0
//! success, 1 a failed request or verification, 2 invalid arguments (or, for `trace-svg`, a
//! file it cannot read or draw).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod demo;
mod progress;

/// kvbridge's lab: the demo and the benchmarks.
#[derive(Debug, Parser)]
#[command(name = "kvbridge-lab", version, about = "kvbridge's lab: the demo and the benchmarks", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Run real prefill and decode processes moving a real-sized KV cache, verifying every byte.
    Demo(demo::DemoArgs),
    /// Measure transport throughput against a baseline measured in the same run.
    Bench(bench::BenchArgs),
    /// Draw a `demo --trace` file as an SVG timeline (docs/tracing.md).
    TraceSvg(TraceSvgArgs),
}

/// `kvbridge-lab trace-svg FILE --output SVG [--room N]`.
#[derive(Debug, clap::Args)]
struct TraceSvgArgs {
    /// The Chrome trace file `demo --trace` wrote.
    input: std::path::PathBuf,
    /// Where to write the SVG.
    #[arg(long, short)]
    output: std::path::PathBuf,
    /// Draw only this room's spans.
    #[arg(long)]
    room: Option<u64>,
}

/// Reads the trace, writes the SVG; 2 when the file cannot be read or drawn.
fn trace_svg(args: &TraceSvgArgs) -> ExitCode {
    let drawn = std::fs::read(&args.input)
        .map_err(|e| format!("cannot read {}: {e}", args.input.display()))
        .and_then(|b| {
            serde_json::from_slice(&b)
                .map_err(|e| format!("{} is not JSON: {e}", args.input.display()))
        })
        .and_then(|doc| kvbridge_lab::telemetry::svg::render(&doc, args.room))
        .and_then(|svg| {
            std::fs::write(&args.output, svg)
                .map_err(|e| format!("cannot write {}: {e}", args.output.display()))
        });
    match drawn {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvbridge-lab trace-svg: {e}");
            ExitCode::from(2)
        }
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
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => bench::run(args),
        Command::TraceSvg(args) => trace_svg(&args),
    }
}
