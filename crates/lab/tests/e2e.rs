//! End to end across real processes: `kvbridge-lab demo` starts a prefill process (with the
//! bootstrap server) and one process per decode rank, over shared memory, over TCP and (feature
//! `nixl`) over NIXL, and every decode rank checks every byte it holds. Small geometries and short deadlines keep
//! each case to a second or a few. Every run gets a private temporary directory, which must be
//! empty once the demo exited, whatever was killed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A private `TMPDIR` for one demo run (the shared-memory control directories go there),
/// removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvb-e2e-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create a scratch TMPDIR");
        Self(dir)
    }

    /// `kvbridge ARGS` with this directory as its only temporary directory.
    fn command(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvbridge-lab"));
        c.env("TMPDIR", &self.0).env_remove("XDG_RUNTIME_DIR");
        c
    }

    fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .expect("read the scratch TMPDIR")
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Pids of the processes that own a shared-memory control directory here
    /// (`kvbridge-shm-<pid>-<tag>`).
    fn owners(&self) -> Vec<u32> {
        self.entries()
            .iter()
            .filter_map(|n| {
                n.strip_prefix("kvbridge-shm-")?
                    .split('-')
                    .next()?
                    .parse()
                    .ok()
            })
            .collect()
    }

    /// Waits until `n` processes own a control directory here (they are up); returns them.
    fn wait_for_owners(&self, n: usize) -> Vec<u32> {
        let start = Instant::now();
        while self.owners().len() < n {
            assert!(
                start.elapsed() < LIMIT,
                "{n} processes did not start within {LIMIT:?}: {:?}",
                self.entries()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.owners()
    }

    fn assert_empty(&self, what: &str) {
        let left = self.entries();
        assert!(
            left.is_empty(),
            "{what}: left behind in {}: {left:?}",
            self.0.display()
        );
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether process `pid` has exited (gone, or a zombie nobody reaped yet).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// Runs `kvbridge-lab demo --json ARGS` and returns (exit code, report, stderr). Fails the test if
/// the demo does not finish within `limit` (no hang, whatever happens inside), or if it left
/// anything in its temporary directory.
fn demo(args: &[&str], limit: Duration) -> (i32, Value, String) {
    let scratch = Scratch::new();
    let mut child = scratch
        .command()
        .arg("demo")
        .arg("--json")
        .args(args)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvbridge-lab demo");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "kvbridge-lab demo {args:?} did not finish within {limit:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let last = stdout.lines().last().unwrap_or_default();
    let report: Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("no JSON report ({e}); stdout:\n{stdout}\nstderr:\n{stderr}"));
    scratch.assert_empty(&format!("kvbridge-lab demo {args:?} (report {report})"));
    (out.status.code().unwrap_or(-1), report, stderr)
}

const LIMIT: Duration = Duration::from_secs(60);

fn procs(r: &Value) -> &Vec<Value> {
    r["processes"].as_array().expect("processes")
}

fn summary<'a>(r: &'a Value, role: &str, rank: u64) -> Option<&'a Value> {
    procs(r)
        .iter()
        .find(|p| p["role"] == role && p["rank"] == rank)
        .map(|p| &p["summary"])
        .filter(|s| !s.is_null())
}

/// Every process that reported holds no room, and its shared-memory directories are gone.
fn assert_clean(r: &Value) {
    for p in procs(r) {
        let s = &p["summary"];
        if s.is_null() {
            continue;
        }
        assert_eq!(s["rooms_left"], 0, "room state left behind: {p}");
        for dir in s["control_dirs"].as_array().into_iter().flatten() {
            let dir = dir.as_str().unwrap();
            assert!(!Path::new(dir).exists(), "{dir} left behind by {p}");
        }
    }
}

/// A run that must succeed with every byte verified.
fn assert_ok(args: &[&str]) -> Value {
    let (code, r, stderr) = demo(args, LIMIT);
    assert_eq!(code, 0, "report: {r:#}\nstderr:\n{stderr}");
    assert_eq!(r["ok"], true);
    assert_eq!(r["succeeded"], r["requests"]);
    assert_eq!(r["failed"], 0);
    let verified = r["verified_bytes"].as_u64().unwrap();
    assert!(verified > 0);
    assert_eq!(verified, r["expected_verified_bytes"].as_u64().unwrap());
    for p in procs(&r) {
        assert_eq!(p["exit_code"], 0, "{p}");
    }
    assert_clean(&r);
    r
}

const SMALL: &[&str] = &[
    "--layers",
    "3",
    "--page-size",
    "16",
    "--requests",
    "6",
    "--concurrency",
    "3",
    "--chunk-tokens",
    "64",
    "--timeout",
    "10",
];

/// `--transport T`, the small defaults, and `extra` (which overrides a default flag).
fn args<'a>(transport: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--transport", transport];
    for pair in SMALL.chunks(2) {
        if !extra.contains(&pair[0]) {
            v.extend_from_slice(pair);
        }
    }
    v.extend_from_slice(extra);
    v
}

fn mla_dcp(transport: &str, dcp: &str) {
    let r = assert_ok(&args(transport, &["--dcp", dcp, "--tokens", "333"]));
    // Each position on exactly one decode rank: the union is every token row of every layer.
    assert_eq!(r["expected_verified_bytes"], 6 * 333 * 3 * 1152);
    assert_eq!(procs(&r).len(), 1 + dcp.parse::<usize>().unwrap());
    // Strided ops: fewer descriptors than the rows they cover.
    let d = &r["descriptors_per_request"];
    assert!(
        d["descriptors"].as_u64().unwrap() < d["rows"].as_u64().unwrap(),
        "{d}"
    );
    assert_eq!(d["pack_batches"], 0);
}

fn mla_dcp_pack(transport: &str) {
    // Chunks of 64 tokens (4 prefill pages of 16) to 4 decode ranks: each batch holds one
    // decode page per layer, gathered into one contiguous range per layer.
    let r = assert_ok(&args(
        transport,
        &[
            "--dcp",
            "4",
            "--tokens",
            "256",
            "--chunk-tokens",
            "64",
            "--pack",
        ],
    ));
    assert_eq!(r["expected_verified_bytes"], 6 * 256 * 3 * 1152);
    let d = &r["descriptors_per_request"];
    // 4 chunks x 4 decode ranks x 3 layers, plus one aux row per decode rank.
    assert_eq!(d["descriptors"], 4 * 4 * 3 + 4, "{d}");
    assert_eq!(d["rows"], d["descriptors"], "{d}");
    assert_eq!(d["pack_batches"], 4 * 4, "{d}");
    assert_eq!(d["pack_bytes"], 256 * 3 * 1152, "{d}");
}

#[test]
fn mla_dcp_1_to_4_pack_shm() {
    mla_dcp_pack("shm");
}

#[test]
fn mla_dcp_1_to_4_pack_tcp() {
    mla_dcp_pack("tcp");
}

#[test]
fn mla_dcp_1_to_2_shm() {
    mla_dcp("shm", "2");
}

#[test]
fn mla_dcp_1_to_2_tcp() {
    mla_dcp("tcp", "2");
}

#[test]
fn mla_dcp_1_to_4_shm() {
    mla_dcp("shm", "4");
}

#[test]
fn mla_dcp_1_to_4_tcp() {
    mla_dcp("tcp", "4");
}

fn gqa_tp_2_to_4(transport: &str) {
    let r = assert_ok(&args(
        transport,
        &[
            "--geometry",
            "gqa",
            "--tokens",
            "300",
            "--kv-heads",
            "8",
            "--head-dim",
            "16",
        ],
    ));
    // Each decode rank holds 2 of the 8 heads: together every K and V byte once.
    assert_eq!(r["expected_verified_bytes"], 6 * 300 * (2 * 3 * 8 * 16 * 2));
    let decodes = procs(&r).iter().filter(|p| p["role"] == "decode").count();
    assert_eq!(decodes, 4);
}

#[test]
fn gqa_tp_2_to_4_shm() {
    gqa_tp_2_to_4("shm");
}

#[test]
fn gqa_tp_2_to_4_tcp() {
    gqa_tp_2_to_4("tcp");
}

fn chunked_with_prefix(transport: &str) {
    // Decode DCP 2, page 16: virtual page 32, so the 300 cached tokens are advertised as 288
    // and the prefill sends tokens 288..700 in chunks of 64.
    let r = assert_ok(&args(
        transport,
        &["--dcp", "2", "--tokens", "700", "--prefix-tokens", "300"],
    ));
    let aux = 2 * 64;
    assert_eq!(
        r["bytes_moved"],
        6 * ((700 - 288) * 3 * 1152 + aux),
        "only the tokens after the advertised prefix move"
    );
    assert_eq!(r["expected_verified_bytes"], 6 * 700 * 3 * 1152);
}

#[test]
fn chunked_prefill_with_a_prefix_on_the_decode_shm() {
    chunked_with_prefix("shm");
}

#[test]
fn chunked_prefill_with_a_prefix_on_the_decode_tcp() {
    chunked_with_prefix("tcp");
}

#[test]
fn any_to_any_dcp_and_page_sizes_shm() {
    assert_ok(&args(
        "shm",
        &[
            "--prefill-dcp",
            "2",
            "--dcp",
            "4",
            "--prefill-page-size",
            "16",
            "--page-size",
            "64",
            "--tokens",
            "500",
        ],
    ));
    assert_ok(&args(
        "shm",
        &[
            "--prefill-dcp",
            "4",
            "--dcp",
            "2",
            "--prefill-page-size",
            "64",
            "--page-size",
            "16",
            "--tokens",
            "333",
            "--prefix-tokens",
            "40",
        ],
    ));
}

#[test]
fn any_to_any_dcp_and_page_sizes_tcp() {
    assert_ok(&args(
        "tcp",
        &["--prefill-dcp", "4", "--dcp", "1", "--tokens", "257"],
    ));
}

const FAULT: &[&str] = &[
    "--dcp",
    "2",
    "--tokens",
    "512",
    "--layers",
    "2",
    "--page-size",
    "16",
    "--chunk-tokens",
    "64",
    "--chunk-delay-ms",
    "150",
    "--requests",
    "8",
    "--concurrency",
    "4",
    "--timeout",
    "2",
];

fn kill_decode(transport: &str) {
    let mut a = vec!["--transport", transport, "--kill", "decode:1@1"];
    a.extend_from_slice(FAULT);
    let (code, r, stderr) = demo(&a, LIMIT);
    assert_eq!(code, 1, "{r:#}\n{stderr}");
    assert_eq!(r["ok"], false);
    assert_eq!(r["killed"], serde_json::json!(["decode 1"]));
    assert_eq!(
        r["timed_out"], false,
        "every survivor ended by its deadlines"
    );
    assert!(
        summary(&r, "decode", 1).is_none(),
        "the killed rank reports nothing"
    );
    let p = summary(&r, "prefill", 0).expect("the prefill survived and reported");
    assert!(p["failed"].as_u64().unwrap() >= 1, "{p}");
    let why = p["first_failure"].as_str().unwrap();
    assert!(why.starts_with("KVTransferError(bootstrap_room="), "{why}");
    // The root cause, not an abort that followed from it.
    for consequence in [
        "cause: aborted",
        "cause: remote_failure",
        "cause: duplicate_room",
    ] {
        assert!(!why.contains(consequence), "{why}");
    }
    let d0 = summary(&r, "decode", 0).expect("decode 0 survived and reported");
    assert!(d0["failed"].as_u64().unwrap() >= 1, "{d0}");
    let failures = r["failures"].as_array().unwrap();
    assert_eq!(
        failures[0], "decode rank 1: was killed (test knob --kill)",
        "the dead process comes first: {failures:#?}"
    );
    assert!(
        failures
            .iter()
            .any(|f| f == &format!("prefill: first failure: {why}")),
        "{failures:#?}"
    );
    assert_clean(&r);
}

#[test]
fn killing_a_decode_mid_transfer_fails_the_rooms_without_a_hang_shm() {
    kill_decode("shm");
}

#[test]
fn killing_a_decode_mid_transfer_fails_the_rooms_without_a_hang_tcp() {
    kill_decode("tcp");
}

fn kill_prefill(transport: &str) {
    let mut a = vec!["--transport", transport, "--kill", "prefill@1"];
    a.extend_from_slice(FAULT);
    let (code, r, stderr) = demo(&a, LIMIT);
    assert_eq!(code, 1, "{r:#}\n{stderr}");
    assert_eq!(r["killed"], serde_json::json!(["prefill"]));
    assert_eq!(r["timed_out"], false);
    assert!(summary(&r, "prefill", 0).is_none());
    for rank in 0..2 {
        let d = summary(&r, "decode", rank).expect("decode survived and reported");
        assert!(d["failed"].as_u64().unwrap() >= 1, "{d}");
        assert_eq!(
            d["succeeded"].as_u64().unwrap()
                + d["failed"].as_u64().unwrap()
                + d["skipped"].as_u64().unwrap(),
            8,
            "{d}"
        );
        let why = d["first_failure"].as_str().unwrap();
        assert!(
            why.contains("Lost connection with prefill instance"),
            "the heartbeat notices the dead prefill: {why}"
        );
    }
    assert_clean(&r);
}

#[test]
fn killing_the_prefill_mid_transfer_fails_the_rooms_without_a_hang_shm() {
    kill_prefill("shm");
}

#[test]
fn killing_the_prefill_mid_transfer_fails_the_rooms_without_a_hang_tcp() {
    kill_prefill("tcp");
}

#[test]
fn killing_the_parent_stops_every_child_and_they_leave_nothing_behind() {
    let scratch = Scratch::new();
    // A long run (slow chunks), so the parent dies mid-transfer.
    let mut a = vec!["demo", "--transport", "shm", "--requests", "10000"];
    for pair in FAULT.chunks(2).filter(|p| p[0] != "--requests") {
        a.extend_from_slice(pair);
    }
    let mut parent = scratch
        .command()
        .args(&a)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start kvbridge-lab demo");
    // The prefill's and both decodes' control directories: every child is up.
    let children = scratch.wait_for_owners(3);
    std::thread::sleep(Duration::from_millis(500));
    assert!(parent.try_wait().unwrap().is_none(), "the demo ended early");
    parent.kill().expect("SIGKILL the parent");
    parent.wait().unwrap();
    wait_exited(&children);
    scratch.assert_empty("the children of a killed parent");
}

#[test]
fn a_frozen_decode_ends_the_run_by_the_timeout_plus_the_grace() {
    // SIGSTOP: the decode keeps its sockets open and answers nothing, so only deadlines end
    // the run. The parent kills what still runs at the first failure + --timeout + grace,
    // and removes what the killed processes left.
    let mut a = vec!["--transport", "shm", "--freeze", "decode:1@1"];
    a.extend_from_slice(FAULT);
    let (code, r, stderr) = demo(&a, LIMIT);
    assert_eq!(code, 1, "{r:#}\n{stderr}");
    assert_eq!(r["frozen"], serde_json::json!(["decode 1"]));
    assert_eq!(r["timed_out"], true, "{r:#}");
    let failures: Vec<&str> = r["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert!(
        failures.iter().any(|f| f.contains(
            "the run did not end within --timeout 2.0 s plus the grace of 10 s after the first \
             failure"
        )),
        "the failure names the deadline: {failures:#?}"
    );
    assert!(
        failures
            .iter()
            .any(|f| f.starts_with("decode rank 1: was killed by signal 9")),
        "{failures:#?}"
    );
    assert!(
        summary(&r, "decode", 0).is_some(),
        "the healthy decode ended by its own deadlines and reported: {r:#}"
    );
}

fn load(transport: &str) {
    let r = assert_ok(&[
        "--transport",
        transport,
        "--dcp",
        "2",
        "--tokens",
        "64",
        "--layers",
        "2",
        "--page-size",
        "16",
        "--chunk-tokens",
        "32",
        "--requests",
        "1000",
        "--concurrency",
        "64",
        "--timeout",
        "20",
    ]);
    assert_eq!(r["succeeded"], 1000);
    assert_eq!(r["expected_verified_bytes"], 1000 * 64 * 2 * 1152);
}

#[test]
fn thousand_requests_at_concurrency_64_shm() {
    load("shm");
}

#[test]
fn thousand_requests_at_concurrency_64_tcp() {
    load("tcp");
}

fn misconfigured(transport: &str) {
    // The seed's case: a GQA model with decode DCP 2.
    let (code, r, stderr) = demo(
        &[
            "--transport",
            transport,
            "--geometry",
            "gqa",
            "--dcp",
            "2",
            "--tokens",
            "128",
            "--layers",
            "2",
            "--page-size",
            "16",
            "--requests",
            "2",
            "--timeout",
            "2",
        ],
        LIMIT,
    );
    assert_eq!(code, 1, "{r:#}\n{stderr}");
    assert_eq!(r["ok"], false);
    assert_eq!(r["bytes_moved"], 0, "nothing moves for a refused pair");
    assert_eq!(r["timed_out"], false);
    for rank in 0..4 {
        let d = summary(&r, "decode", rank).expect("every decode reports");
        let why = d["first_failure"].as_str().unwrap();
        assert!(
            why.contains("prefill and decode are incompatible (1 problem)"),
            "{why}"
        );
        assert!(
            why.contains("KVB-E007: PD decode DCP requires an MLA or hybrid-MLA KV pool."),
            "{why}"
        );
        assert!(
            why.contains("fix: start the decode with --dcp-size 1"),
            "{why}"
        );
        assert_eq!(d["succeeded"], 0);
    }
    assert_clean(&r);
}

#[test]
fn a_misconfigured_pair_is_refused_at_connect_with_every_problem_shm() {
    misconfigured("shm");
}

#[test]
fn a_misconfigured_pair_is_refused_at_connect_with_every_problem_tcp() {
    misconfigured("tcp");
}

#[test]
fn help_explains_every_flag_and_bad_arguments_exit_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge-lab"))
        .args(["demo", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--transport",
        "--geometry",
        "--layers",
        "--bytes-per-token-layer",
        "--kv-heads",
        "--head-dim",
        "--page-size",
        "--prefill-page-size",
        "--dcp",
        "--prefill-dcp",
        "--prefill-tp",
        "--decode-tp",
        "--tokens",
        "--requests",
        "--concurrency",
        "--chunk-tokens",
        "--prefix-tokens",
        "--timeout",
        "--secret",
        "--bootstrap-port",
        "--json",
        "--verbose",
        "RUST_LOG",
        "plus a grace of 10 s",
    ] {
        assert!(
            help.contains(flag),
            "--help does not mention {flag}:\n{help}"
        );
    }
    assert!(!help.contains("--role"), "internal flags stay hidden");
    assert!(!help.contains("--freeze"), "test knobs stay hidden");
    for bad in [
        &["--tokens", "0"][..],
        &["--prefix-tokens", "10", "--tokens", "10"],
        &["--decode-tp", "3", "--dcp", "2"],
        &["--timeout", "-1"],
        &["--kill", "nobody@1"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvbridge-lab"))
            .arg("demo")
            .args(bad)
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "{bad:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_shared_secret_protects_the_control_channels() {
    assert_ok(&args(
        "tcp",
        &["--dcp", "2", "--tokens", "100", "--secret", "s3cret"],
    ));
}

fn bench_e2e(transport: &str, extra: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge-lab"))
        .args([
            "bench",
            "--e2e",
            "--json",
            "--runs",
            "1",
            "--size-scale",
            "0.02",
        ])
        .args(["--transport", transport])
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(r["bench"], "e2e");
    assert_eq!(r["verified"], true, "{r}");
    assert!(r["memcpy_ratio"].as_f64().unwrap() > 0.0);
    assert!(r["transport_ratio"].as_f64().unwrap() > 0.0);
    // The plain copy moves the request's bytes in ordinary memory: its own figure and ratio.
    assert!(r["plain_gbps"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["plain_ratio"].as_f64().unwrap() > 0.0, "{r}");
    // Strided ops cover every row of the request with fewer descriptors (pack ranges are
    // contiguous: one row each).
    let (ops, rows) = (
        r["descriptors"].as_u64().unwrap(),
        r["rows"].as_u64().unwrap(),
    );
    if r["pack"] == true {
        assert_eq!(ops, rows, "{r}");
    } else {
        assert!(ops < rows, "{r}");
    }
    if transport == "shm" {
        // The strided limit and the per-row memcpy copy the planner's ops for the request:
        // exactly the ops and rows the coordinator posted (with --pack it posts pack ranges).
        assert!(r["strided_gbps"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["strided_ratio"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["row_memcpy_gbps"].as_f64().unwrap() > 0.0, "{r}");
        if r["pack"] != true {
            assert_eq!(r["planned_descriptors"].as_u64(), Some(ops), "{r}");
            assert_eq!(r["planned_rows"].as_u64(), Some(rows), "{r}");
        }
    } else {
        assert!(r["strided_gbps"].is_null(), "{r}");
    }
    r
}

#[test]
fn bench_e2e_verifies_the_coordinator_against_both_baselines_shm() {
    let r = bench_e2e("shm", &[]);
    // The direct-NIXL baseline is NIXL's alone.
    assert!(
        r["direct_ratio"].is_null() && r["direct_descriptors"].is_null(),
        "{r}"
    );
}

#[test]
fn bench_e2e_verifies_the_coordinator_against_both_baselines_tcp() {
    bench_e2e("tcp", &[]);
}

#[test]
fn bench_e2e_pack_path_and_other_dcp_pairs() {
    let r = bench_e2e("shm", &["--pack"]);
    assert_eq!(r["pack"], true);
    assert!(r["pack_batches"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(
        r["rows"], r["descriptors"],
        "pack ranges are contiguous: {r}"
    );
    bench_e2e(
        "shm",
        &[
            "--prefill-dcp",
            "2",
            "--prefill-page-size",
            "16",
            "--page-size",
            "64",
        ],
    );
    bench_e2e("tcp", &["--prefill-dcp", "4", "--dcp", "1"]);
    bench_e2e("shm", &["--prefill-dcp", "4", "--dcp", "1"]);
}

#[test]
fn bench_names_the_build_profile_on_its_first_line_and_warns_on_a_debug_build() {
    let run = |json: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvbridge-lab"));
        c.args([
            "bench",
            "--pattern",
            "latency-4k",
            "--runs",
            "1",
            "--size-scale",
            "0.001",
        ]);
        if json {
            c.arg("--json");
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // The binary is built with the same profile as this test.
    let want = if cfg!(debug_assertions) {
        "profile: debug build (unoptimized, debug assertions on): these figures are NOT \
         representative"
    } else {
        "profile: release build"
    };
    let (stdout, _) = run(false);
    let first = stdout.lines().next().unwrap_or_default();
    assert!(first.starts_with(want), "{stdout}");
    let (stdout, stderr) = run(true);
    assert!(
        stdout.lines().all(|l| l.starts_with('{')),
        "JSON lines only on stdout: {stdout}"
    );
    assert!(
        stderr.contains(&format!("kvbridge-lab bench: {want}")),
        "{stderr}"
    );
}

/// Starts a long `kvbridge-lab bench` in `scratch`, waits until the sender and its receiver
/// process created their control directories, and returns it with (sender, receiver) pids.
fn long_bench(scratch: &Scratch) -> (std::process::Child, u32, u32) {
    let bench = scratch
        .command()
        .args(["bench", "--pattern", "large", "--runs", "1000"])
        .args(["--size-scale", "0.05"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvbridge-lab bench");
    let sender = bench.id();
    let receiver = *scratch
        .wait_for_owners(2)
        .iter()
        .find(|&&p| p != sender)
        .unwrap();
    (bench, sender, receiver)
}

fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig} {pid}");
}

fn wait_exited(pids: &[u32]) {
    let start = Instant::now();
    while !pids.iter().all(|&pid| exited(pid)) {
        assert!(start.elapsed() < LIMIT, "{pids:?} still running");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_bench_receiver_or_sender_leaves_nothing_behind() {
    for victim in ["receiver", "sender"] {
        let scratch = Scratch::new();
        let (mut bench, sender, receiver) = long_bench(&scratch);
        let pid = if victim == "sender" { sender } else { receiver };
        signal(pid, "-KILL");
        wait_exited(&[receiver]);
        let start = Instant::now();
        while bench.try_wait().unwrap().is_none() {
            assert!(start.elapsed() < LIMIT, "the sender outlived its receiver");
            std::thread::sleep(Duration::from_millis(20));
        }
        // The survivor removed what the killed process could not.
        scratch.assert_empty(&format!("a bench whose {victim} was killed"));
    }
}

#[test]
fn a_terminated_bench_and_its_receiver_leave_nothing_behind() {
    let scratch = Scratch::new();
    let (mut bench, sender, receiver) = long_bench(&scratch);
    signal(sender, "-TERM");
    let start = Instant::now();
    while bench.try_wait().unwrap().is_none() {
        if start.elapsed() > LIMIT {
            let _ = bench.kill();
            panic!("the bench did not stop within {LIMIT:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = bench.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{out:?}");
    wait_exited(&[receiver]);
    scratch.assert_empty("a terminated bench");
}

/// The same runs over NIXL's UCX backend (feature `nixl`; each skipped, with the reason printed,
/// when the NIXL runtime is not set up: `cargo xtask nixl-setup`, which `.ci/run` runs).
#[cfg(feature = "nixl")]
mod nixl {
    use super::*;

    fn ready() -> bool {
        match kvbridge_nixl::Runtime::locate() {
            Ok(_) => true,
            Err(e) => {
                eprintln!("skipped: {e}");
                false
            }
        }
    }

    #[test]
    fn mla_dcp_1_to_4_nixl() {
        if ready() {
            mla_dcp("nixl", "4");
        }
    }

    #[test]
    fn bench_e2e_over_nixl_holds_the_coordinator_to_the_same_rows_posted_directly() {
        if ready() {
            let r = bench_e2e("nixl", &[]);
            assert!(r["direct_ratio"].as_f64().unwrap() > 0.0, "{r}");
            // DCP 1 -> 4: a decode rank's rows are every 4th prefill row, so each is a NIXL
            // descriptor of its own in the direct baseline.
            assert_eq!(r["direct_descriptors"], r["rows"], "{r}");
        }
    }

    #[test]
    fn gqa_tp_2_to_4_nixl() {
        if ready() {
            gqa_tp_2_to_4("nixl");
        }
    }

    #[test]
    fn any_to_any_dcp_and_page_sizes_nixl() {
        if ready() {
            assert_ok(&args(
                "nixl",
                &[
                    "--prefill-dcp",
                    "2",
                    "--dcp",
                    "4",
                    "--prefill-page-size",
                    "16",
                    "--page-size",
                    "64",
                    "--tokens",
                    "500",
                ],
            ));
        }
    }
}
