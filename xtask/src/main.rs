//! Repository automation, std-only: `cargo xtask <task>`.
//!
//! Tasks: `ci` (fmt, clippy, test, deny), `fmt`, `clippy`, `test`, `deny`, `msrv` (build with
//! the declared rust-version), `bench [NAME]`.

use std::env;
use std::process::{Command, ExitCode};

#[cfg(test)]
mod tidy;

fn cargo(args: &[&str]) -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    eprintln!("xtask: cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .status()
        .map_err(|e| format!("could not run `{cargo}`: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`cargo {}` failed with {status}", args.join(" ")))
    }
}

fn has_nextest() -> bool {
    Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .args(["nextest", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn fmt() -> Result<(), String> {
    cargo(&["fmt", "--all", "--", "--check"])
}

fn clippy() -> Result<(), String> {
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--all-features",
        "--",
        "-D",
        "warnings",
    ])
}

fn test() -> Result<(), String> {
    if has_nextest() {
        cargo(&[
            "nextest",
            "run",
            "--workspace",
            "--all-features",
            "--no-fail-fast",
        ])?;
    } else {
        eprintln!("xtask: cargo-nextest not found, using cargo test");
        cargo(&[
            "test",
            "--workspace",
            "--all-features",
            "--lib",
            "--bins",
            "--tests",
        ])?;
    }
    // nextest does not run doctests.
    cargo(&["test", "--workspace", "--all-features", "--doc"])
}

fn deny() -> Result<(), String> {
    // Advisories need the RustSec database, which cannot be downloaded on these machines.
    cargo(&[
        "deny",
        "--all-features",
        "check",
        "bans",
        "licenses",
        "sources",
    ])
}

/// Checks the workspace builds with the declared `rust-version` (installs that toolchain first).
fn msrv() -> Result<(), String> {
    const MSRV: &str = "1.85.0";
    let status = Command::new("rustup")
        .args(["toolchain", "install", MSRV, "--profile", "minimal"])
        .status()
        .map_err(|e| format!("could not run rustup: {e}"))?;
    if !status.success() {
        return Err(format!("could not install Rust {MSRV} with rustup"));
    }
    // `cargo +VERSION` goes through rustup's proxy, not the running cargo.
    let status = Command::new("cargo")
        .args([
            &format!("+{MSRV}"),
            "check",
            "--workspace",
            "--all-targets",
            "--all-features",
        ])
        .status()
        .map_err(|e| format!("could not run cargo +{MSRV}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "the workspace does not build with Rust {MSRV} (its rust-version)"
        ))
    }
}

fn bench(name: Option<&str>) -> Result<(), String> {
    match name {
        None | Some("planner") => {
            cargo(&["bench", "-p", "kvbridge-geometry", "--bench", "planner"])
        }
        Some(transport @ ("shm" | "tcp")) => cargo(&[
            "run",
            "--release",
            "-p",
            "kvbridge-cli",
            "--",
            "bench",
            "--transport",
            transport,
        ]),
        Some("e2e") => cargo(&[
            "run",
            "--release",
            "-p",
            "kvbridge-cli",
            "--",
            "bench",
            "--e2e",
        ]),
        Some(other) => Err(format!(
            "unknown bench `{other}`; choose one of: planner, shm, tcp, e2e"
        )),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let task = args.first().map(String::as_str);
    let result = match task {
        Some("ci") => fmt()
            .and_then(|()| clippy())
            .and_then(|()| test())
            .and_then(|()| deny()),
        Some("fmt") => fmt(),
        Some("clippy") => clippy(),
        Some("test") => test(),
        Some("deny") => deny(),
        Some("msrv") => msrv(),
        Some("bench") => bench(args.get(1).map(String::as_str)),
        _ => Err(
            "usage: cargo xtask <ci|fmt|clippy|test|deny|msrv|bench [planner|shm|tcp|e2e]>"
                .to_owned(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
