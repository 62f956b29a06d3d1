//! Repository automation, std-only: `cargo xtask <task>`.
//!
//! Tasks: `ci` (fmt, clippy, test, kvbridge-control without its default features, deny, sglang-cite --check), `fmt`,
//! `clippy`, `test`, `deny`, `msrv` (build with the declared rust-version), `miri` (registered
//! memory's tests under Miri, when nightly Miri is installed), `bench [NAME]`, `stress
//! [--iterations N] [--time-limit SECS] [--burners K]` (the cross-process tests, again and again,
//! on a loaded machine), `nixl-setup [DIR]` (libclang and the NIXL runtime for `kvbridge-nixl`,
//! into `target/nixl/`), `sglang-cite [--check | --against <wheel, sdist or dir>]` (every SGLang
//! citation's quote found in the pinned SGLang source; writes docs/sglang-citations.md).

use std::env;
use std::fs;
use std::hint::black_box;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

mod nixl_setup;
mod sglang_cite;
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

/// Every feature of every package but the NIXL ones, for machines without libclang: building
/// nixl-sys (features `kvbridge-nixl/nixl`, `kvbridge-lab/nixl`) runs bindgen, which needs it.
/// `tidy::the_feature_list_without_nixl_names_every_other_feature` keeps the list complete.
pub(crate) const FEATURES_WITHOUT_NIXL: &str = "kvbridge-control/channel,kvbridge-geometry/serde,\
kvbridge-memory/testing,kvbridge-transport/mock,kvbridge/full,kvbridge/auth,kvbridge/bootstrap,\
kvbridge/control,kvbridge/coordinator,kvbridge/handshake,kvbridge/machines,kvbridge/mock,kvbridge/planner,\
kvbridge/shm,kvbridge/tcp,kvbridge/transport";

/// `--all-features` where nixl-sys can be built (libclang present, as `cargo xtask nixl-setup`
/// makes it), otherwise every other feature, saying once why the NIXL tests do not run.
fn feature_args() -> Vec<&'static str> {
    static NOTED: std::sync::Once = std::sync::Once::new();
    if nixl_setup::has_libclang() {
        return vec!["--all-features"];
    }
    NOTED.call_once(|| {
        eprintln!(
            "xtask: libclang not found, so the NIXL features (nixl-sys) are left out and the NIXL \
             tests do not run; `cargo xtask nixl-setup` installs libclang and the NIXL runtime"
        )
    });
    vec!["--features", FEATURES_WITHOUT_NIXL]
}

fn clippy() -> Result<(), String> {
    let mut args = vec!["clippy", "--workspace", "--all-targets"];
    args.extend(feature_args());
    args.extend(["--", "-D", "warnings"]);
    cargo(&args)
}

fn test() -> Result<(), String> {
    let features = feature_args();
    if has_nextest() {
        let mut args = vec!["nextest", "run", "--workspace", "--no-fail-fast"];
        args.extend(&features);
        cargo(&args)?;
    } else {
        eprintln!("xtask: cargo-nextest not found, using cargo test");
        let mut args = vec!["test", "--workspace", "--lib", "--bins", "--tests"];
        args.extend(&features);
        cargo(&args)?;
    }
    // nextest does not run doctests.
    let mut args = vec!["test", "--workspace", "--doc"];
    args.extend(&features);
    cargo(&args)
}

/// kvbridge-control without its default feature `channel`: the plain data sans-IO machines use,
/// built and tested on its own so nothing there comes to need tokio.
fn control_without_channel() -> Result<(), String> {
    cargo(&["build", "-p", "kvbridge-control", "--no-default-features"])?;
    cargo(&["test", "-p", "kvbridge-control", "--no-default-features"])
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

/// Seeds of the scheduler Miri tries for the concurrent tests; each runs the tests once.
const MIRI_SEEDS: &str = "0..64";

/// Runs the tests of registered memory (`kvbridge-memory`) under Miri (concurrent overlapping
/// accesses through every accessor included), once per seed in [`MIRI_SEEDS`], then the
/// shared-memory transport's copies of rows together (`map::tests::together_*`). Succeeds with a
/// printed reason when nightly Miri is not installed (`rustup toolchain install nightly
/// --profile minimal && rustup component add --toolchain nightly miri rust-src`).
fn miri() -> Result<(), String> {
    // `cargo +nightly` goes through rustup's proxy, not the running cargo.
    let probe = Command::new("cargo")
        .args(["+nightly", "miri", "--version"])
        .output();
    match probe {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            let why = String::from_utf8_lossy(&out.stderr);
            let why = why.lines().next().unwrap_or("no output").trim();
            eprintln!("xtask: miri skipped: nightly Miri is not installed ({why})");
            return Ok(());
        }
        Err(e) => {
            eprintln!("xtask: miri skipped: could not run `cargo +nightly miri` ({e})");
            return Ok(());
        }
    }
    let args = ["+nightly", "miri", "test", "-p", "kvbridge-memory", "--lib"];
    let flags = format!("-Zmiri-many-seeds={MIRI_SEEDS}");
    eprintln!("xtask: MIRIFLAGS={flags} cargo {}", args.join(" "));
    let status = Command::new("cargo")
        .args(args)
        .env("MIRIFLAGS", &flags)
        .status()
        .map_err(|e| format!("could not run cargo +nightly miri: {e}"))?;
    if !status.success() {
        return Err(format!(
            "Miri found a problem in registered memory ({status}); rerun the command above to see it"
        ));
    }
    // The shared-memory transport's one-pass copy of several batches' rows (its own raw
    // pointers and streaming stores), on heap regions; single-threaded, so one seed.
    let args = [
        "+nightly",
        "miri",
        "test",
        "-p",
        "kvbridge-shm",
        "--lib",
        "map::tests::together_",
    ];
    eprintln!("xtask: cargo {}", args.join(" "));
    let status = Command::new("cargo")
        .args(args)
        .status()
        .map_err(|e| format!("could not run cargo +nightly miri: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "Miri found a problem in the shared-memory copies ({status}); rerun the command above \
             to see it"
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
            "kvbridge-lab",
            "--",
            "bench",
            "--transport",
            transport,
        ]),
        Some("e2e") => cargo(&[
            "run",
            "--release",
            "-p",
            "kvbridge-lab",
            "--",
            "bench",
            "--e2e",
        ]),
        // Needs `cargo xtask nixl-setup` first.
        Some("nixl") => cargo(&[
            "run",
            "--release",
            "-p",
            "kvbridge-lab",
            "--features",
            "nixl",
            "--",
            "bench",
            "--transport",
            "nixl",
        ]),
        Some(other) => Err(format!(
            "unknown bench `{other}`; choose one of: planner, shm, tcp, e2e, nixl"
        )),
    }
}

/// Waits for `child` until `deadline`; past it the child is killed and reaped, and `None`
/// says so.
fn wait_until(
    child: &mut std::process::Child,
    deadline: Instant,
) -> Result<Option<std::process::ExitStatus>, String> {
    loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// The suites `cargo xtask stress` repeats: the tests that run real processes and sockets.
const STRESS_SUITES: [(&str, &[&str]); 3] = [
    (
        "lab-e2e",
        &["-p", "kvbridge-lab", "--all-features", "--test", "e2e"],
    ),
    // Shared memory between real sockets: connections under pressure, peers that come and go.
    ("shm", &["-p", "kvbridge-shm", "--test", "*"]),
    (
        "coordinator",
        &[
            "-p",
            "kvbridge-coordinator",
            "--all-features",
            "--test",
            "*",
        ],
    ),
];

/// What `cargo xtask stress` was asked for.
#[derive(Debug, Clone, Copy, PartialEq)]
struct StressArgs {
    iterations: u32,
    time_limit: Duration,
    burners: usize,
}

fn parse_stress(args: &[String]) -> Result<StressArgs, String> {
    let mut out = StressArgs {
        iterations: 3,
        time_limit: Duration::from_secs(30 * 60),
        burners: thread::available_parallelism().map_or(2, |n| n.get()),
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("`{flag}` needs a value"))?;
        let bad = |e: std::num::ParseIntError| format!("`{flag} {value}`: {e}");
        match flag.as_str() {
            "--iterations" => out.iterations = value.parse().map_err(bad)?,
            "--time-limit" => out.time_limit = Duration::from_secs(value.parse().map_err(bad)?),
            "--burners" => out.burners = value.parse().map_err(bad)?,
            _ => {
                return Err(format!(
                    "unknown flag `{flag}`; stress takes --iterations N, --time-limit SECS, \
                     --burners K"
                ));
            }
        }
    }
    if out.iterations == 0 || out.time_limit.is_zero() {
        return Err("--iterations and --time-limit must be at least 1".to_owned());
    }
    Ok(out)
}

/// Names of the tests a libtest log reports as failed (`test NAME ... FAILED`).
fn failed_tests(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| l.strip_prefix("test ")?.strip_suffix(" ... FAILED"))
        .map(str::to_owned)
        .collect()
}

/// Threads that keep `n` CPUs busy until dropped.
struct Burners {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Burners {
    fn start(n: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..100_000 {
                            x = black_box(
                                x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1),
                            );
                        }
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Burners {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How one suite run ended.
enum SuiteRun {
    Passed,
    /// The failed tests' names (or what went wrong when no test was named).
    Failed(Vec<String>),
    /// Stopped at the time limit.
    Cut,
}

/// Runs one suite (debug build, output to `log`), killing it at `deadline`.
fn run_suite(args: &[&str], log: &PathBuf, deadline: Instant) -> Result<SuiteRun, String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let file =
        fs::File::create(log).map_err(|e| format!("cannot create {}: {e}", log.display()))?;
    let err = file
        .try_clone()
        .map_err(|e| format!("cannot reuse {}: {e}", log.display()))?;
    let mut child = Command::new(&cargo)
        .arg("test")
        .args(args)
        .args(["--", "--color", "never"])
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("could not run `{cargo}`: {e}"))?;
    let Some(status) = wait_until(&mut child, deadline)? else {
        return Ok(SuiteRun::Cut);
    };
    if status.success() {
        return Ok(SuiteRun::Passed);
    }
    let text = fs::read_to_string(log).unwrap_or_default();
    let mut failed = failed_tests(&text);
    if failed.is_empty() {
        failed.push(format!("(no test named; `cargo test` ended with {status})"));
    }
    Ok(SuiteRun::Failed(failed))
}

/// `cargo xtask stress`: the cross-process tests, `iterations` times, while `burners` threads
/// keep the CPUs busy; bounded by `time_limit`. Fails on any failed test.
fn stress(a: StressArgs) -> Result<(), String> {
    let logs = env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| PathBuf::from("target"), PathBuf::from)
        .join("stress");
    fs::create_dir_all(&logs).map_err(|e| format!("cannot create {}: {e}", logs.display()))?;
    // Build first, unloaded, so the time limit is spent on tests.
    for (_, args) in STRESS_SUITES {
        let mut build = vec!["test", "--no-run"];
        build.extend_from_slice(args);
        cargo(&build)?;
    }
    let start = Instant::now();
    let deadline = start + a.time_limit;
    let burners = Burners::start(a.burners);
    eprintln!(
        "xtask stress: {} iteration(s) under {} CPU burner thread(s), at most {} s; logs in {}",
        a.iterations,
        a.burners,
        a.time_limit.as_secs(),
        logs.display()
    );
    let mut done = 0;
    let mut failures: Vec<(u32, &str, String, PathBuf)> = Vec::new();
    'iterations: for i in 1..=a.iterations {
        for (suite, args) in STRESS_SUITES {
            let log = logs.join(format!("{i}-{suite}.log"));
            let began = Instant::now();
            let outcome = run_suite(args, &log, deadline)?;
            let secs = began.elapsed().as_secs_f64();
            match outcome {
                SuiteRun::Passed => eprintln!("xtask stress: #{i} {suite}: ok ({secs:.0} s)"),
                SuiteRun::Failed(names) => {
                    eprintln!(
                        "xtask stress: #{i} {suite}: {} FAILED ({secs:.0} s): {}",
                        names.len(),
                        names.join(", ")
                    );
                    for name in names {
                        failures.push((i, suite, name, log.clone()));
                    }
                }
                SuiteRun::Cut => {
                    eprintln!(
                        "xtask stress: #{i} {suite}: stopped at the time limit ({} s); this \
                         iteration does not count",
                        a.time_limit.as_secs()
                    );
                    break 'iterations;
                }
            }
        }
        done = i;
    }
    drop(burners);
    eprintln!(
        "xtask stress: {done} of {} iteration(s) in {:.0} s under {} burner(s): {} failure(s)",
        a.iterations,
        start.elapsed().as_secs_f64(),
        a.burners,
        failures.len()
    );
    for (i, suite, name, log) in &failures {
        eprintln!("  #{i} {suite}: {name} (log: {})", log.display());
    }
    if !failures.is_empty() {
        Err(format!("{} test failure(s) under load", failures.len()))
    } else if done == 0 {
        Err("no iteration finished within the time limit; raise --time-limit".to_owned())
    } else {
        Ok(())
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let task = args.first().map(String::as_str);
    let result = match task {
        Some("ci") => fmt()
            .and_then(|()| clippy())
            .and_then(|()| test())
            .and_then(|()| control_without_channel())
            .and_then(|()| deny())
            .and_then(|()| sglang_cite::sglang_cite(sglang_cite::Mode::Check)),
        Some("fmt") => fmt(),
        Some("clippy") => clippy(),
        Some("test") => test(),
        Some("deny") => deny(),
        Some("msrv") => msrv(),
        Some("miri") => miri(),
        Some("bench") => bench(args.get(1).map(String::as_str)),
        Some("stress") => parse_stress(&args[1..]).and_then(stress),
        Some("nixl-setup") => nixl_setup::nixl_setup(args.get(1).map(String::as_str)),
        Some("sglang-cite") => {
            sglang_cite::parse_args(&args[1..]).and_then(sglang_cite::sglang_cite)
        }
        _ => Err(
            "usage: cargo xtask <ci|fmt|clippy|test|deny|msrv|miri|bench [planner|shm|tcp|e2e|nixl]|stress \
             [--iterations N] [--time-limit SECS] [--burners K]|nixl-setup [DIR]|sglang-cite [--check|--against \
             <wheel, sdist or dir>]>"
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_test_names_come_from_the_libtest_lines() {
        let log = "running 3 tests\ntest a::ok ... ok\ntest b::broken ... FAILED\n\
                   test c ... FAILED\n\nfailures:\n    b::broken\n";
        assert_eq!(failed_tests(log), ["b::broken", "c"]);
        assert!(failed_tests("test x ... ok\n").is_empty());
    }

    #[test]
    fn stress_flags_parse_and_are_checked() {
        let args = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let a = parse_stress(&args(&[
            "--iterations",
            "5",
            "--time-limit",
            "60",
            "--burners",
            "3",
        ]))
        .unwrap();
        assert_eq!(
            a,
            StressArgs {
                iterations: 5,
                time_limit: Duration::from_secs(60),
                burners: 3
            }
        );
        assert_eq!(parse_stress(&[]).unwrap().iterations, 3);
        assert!(parse_stress(&args(&["--iterations"])).is_err());
        assert!(parse_stress(&args(&["--iterations", "0"])).is_err());
        assert!(parse_stress(&args(&["--iterations", "x"])).is_err());
        assert!(parse_stress(&args(&["--loops", "2"])).is_err());
    }
}
