//! `kvbridge-netns bench`: kvbridge's TCP transport across a real link (a veth pair between two
//! network namespaces, MTU 1500 and 9000) against `iperf3` over the same link in the same run.
//!
//! Per MTU: `iperf3` (best of 1 and 2 streams, the large block's byte count, median of
//! `--runs`); `kvbridge-lab bench --transport tcp --pattern large` with its receiver in the other
//! namespace (256 MiB blocks; its own same-run baseline is raw TCP streams from the same source
//! into the receiver's own pool, best of 1 and 2 per run, alternated); and the demo's
//! DCP 1 -> 4 end to end (prefill in one namespace, four decode ranks in the other, every
//! byte verified). With `--nixl`, also `kvbridge-lab bench --transport nixl --pattern large` across
//! the link with `UCX_TLS=tcp` (its same-run baseline: the same descriptors through nixl-sys
//! directly; needs a `kvbridge-lab` built with `--features nixl` and `cargo xtask nixl-setup`).
//! Prints one table, with the load average next to each figure (other work on the machine
//! moves them). Needs root; `--lab` defaults to the `kvbridge-lab` binary next to this one
//! (`cargo build --release -p kvbridge-lab -p kvbridge-netns`).

use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use kvbridge_netns::demo::{DemoSpec, Deployment};
use kvbridge_netns::{Link, LinkOptions, Proc};

const USAGE: &str = "usage: kvbridge-netns bench [--lab PATH] [--mtu 1500,9000] [--runs N] \
                     [--tcp-connections N] [--requests N] [--skip-e2e] [--nixl]";

struct Opts {
    /// The `kvbridge-lab` binary.
    lab: PathBuf,
    mtus: Vec<u32>,
    runs: u32,
    tcp_connections: Option<u32>,
    requests: u32,
    e2e: bool,
    nixl: bool,
}

fn parse() -> Result<Opts, String> {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() != Some("bench") {
        return Err(USAGE.to_owned());
    }
    let here = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut o = Opts {
        lab: here.with_file_name("kvbridge-lab"),
        mtus: vec![1500, 9000],
        runs: 3,
        tcp_connections: None,
        requests: 8,
        e2e: true,
        nixl: false,
    };
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value; {USAGE}"));
        match a.as_str() {
            "--lab" => o.lab = PathBuf::from(value()?),
            "--mtu" => {
                o.mtus = value()?
                    .split(',')
                    .map(|m| m.parse().map_err(|_| format!("bad MTU {m:?}")))
                    .collect::<Result<_, _>>()?;
            }
            "--runs" => o.runs = value()?.parse().map_err(|_| "bad --runs".to_owned())?,
            "--tcp-connections" => {
                o.tcp_connections = Some(value()?.parse().map_err(|_| "bad --tcp-connections")?);
            }
            "--requests" => {
                o.requests = value()?.parse().map_err(|_| "bad --requests".to_owned())?;
            }
            "--skip-e2e" => o.e2e = false,
            "--nixl" => o.nixl = true,
            _ => return Err(format!("unknown argument {a:?}; {USAGE}")),
        }
    }
    if !o.lab.exists() {
        return Err(format!(
            "no kvbridge-lab binary at {}; build it (cargo build --release -p kvbridge-lab) or \
             pass --lab",
            o.lab.display()
        ));
    }
    Ok(o)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Bytes of the large block (`kvbridge-lab bench`'s `large` pattern).
const LARGE: u64 = 256 << 20;

/// iperf3 across the link: GB/s (received), median of `runs`, for `streams` parallel streams.
fn iperf3(link: &Link, streams: u32, runs: u32) -> Result<f64, String> {
    let log =
        std::env::temp_dir().join(format!("kvbridge-netns-iperf3-{}.log", std::process::id()));
    let server = Proc::spawn(
        "iperf3 server",
        &link.b.netns,
        &PathBuf::from("iperf3"),
        &[
            "-s".into(),
            "-B".into(),
            link.b.addr.to_string(),
            "-p".into(),
            "5201".into(),
        ],
        &[],
        &log,
    )?;
    std::thread::sleep(Duration::from_millis(300));
    let mut rates = Vec::new();
    for _ in 0..runs {
        let out = Command::new("timeout")
            .args([
                "60",
                "ip",
                "netns",
                "exec",
                &link.a.netns,
                "iperf3",
                "-J",
                "-c",
            ])
            .arg(link.b.addr.to_string())
            .args([
                "-p",
                "5201",
                "-n",
                &LARGE.to_string(),
                "-P",
                &streams.to_string(),
            ])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run iperf3 (apt-get install iperf3): {e}"))?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
            format!(
                "iperf3 printed no JSON ({e}): {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
        let bps = v["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .ok_or_else(|| format!("iperf3 reported no rate: {}", v["error"]))?;
        rates.push(bps / 8e9);
    }
    drop(server);
    Ok(median(rates))
}

/// `kvbridge-lab bench --transport tcp|nixl --pattern large` with the receiver in side B:
/// (kvbridge GB/s, its same-run baseline's GB/s: raw TCP streams between the same buffers, best
/// of 1 and 2, or nixl-sys directly; for TCP, the raw streams' GB/s per stream count).
fn large(o: &Opts, link: &Link, transport: &str) -> Result<(f64, f64, String), String> {
    let mut c = Command::new("timeout");
    if transport == "nixl" {
        // UCX over TCP only, on the veth ends (either name: each side has one of them).
        c.env("UCX_TLS", "tcp").env(
            "UCX_NET_DEVICES",
            format!("{},{}", link.a.veth, link.b.veth),
        );
    }
    c.args(["300", "ip", "netns", "exec", &link.a.netns])
        .arg(&o.lab)
        .args(["bench", "--transport", transport])
        .args(["--pattern", "large", "--json", "--runs"])
        .arg(o.runs.to_string())
        .args(["--bind-addr", &link.a.addr.to_string()])
        .args([
            "--peer-netns",
            &link.b.netns,
            "--peer-addr",
            &link.b.addr.to_string(),
        ]);
    if let Some(n) = o.tcp_connections {
        c.args(["--tcp-connections", &n.to_string()]);
    }
    let out = c.stdin(Stdio::null()).output().map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("\"pattern\":\"large\""))
        .ok_or_else(|| {
            format!(
                "kvbridge-lab bench printed no result: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    if v["verified"] != serde_json::Value::Bool(true) {
        return Err(format!("kvbridge-lab bench did not verify: {line}"));
    }
    Ok((
        v["gbps"].as_f64().unwrap_or(0.0),
        v["baseline_gbps"].as_f64().unwrap_or(0.0),
        v["raw_tcp_streams"].as_str().unwrap_or_default().to_owned(),
    ))
}

/// The demo's DCP 1 -> 4 (MLA, 61 layers, 8192 tokens: 575 MB per request) across the link,
/// `requests` requests one at a time: GB/s of KV moved (first request named to last verified,
/// filling and checking included), and GB/s while moving (each request's first chunk posted
/// to the prefill's Success; the decode ranks check a request after it, before the next).
fn e2e(o: &Opts, mtu: u32) -> Result<(f64, f64), String> {
    let mut args: Vec<String> = [
        "demo",
        "--transport",
        "tcp",
        "--dcp",
        "4",
        "--concurrency",
        "1",
        "--timeout",
        "60",
    ]
    .map(str::to_owned)
    .to_vec();
    if let Some(n) = o.tcp_connections {
        // The demo has no connections knob of its own; say so instead of measuring the default.
        return Err(format!(
            "--tcp-connections {n} applies to the large block only"
        ));
    }
    args.extend(["--requests".to_owned(), o.requests.to_string()]);
    let spec = DemoSpec {
        exe: o.lab.clone(),
        args,
        decode_ranks: 4,
        bootstrap_port: 18999,
        secret: "kvbridge-netns bench".to_owned(),
        env: Vec::new(),
    };
    let mut d = Deployment::start(
        &format!("bench-{mtu}"),
        LinkOptions {
            mtu,
            rate_mbit: None,
        },
        spec,
    )?;
    let started = Instant::now();
    d.run(0..o.requests)?;
    let n = o.requests;
    if !d.until(Duration::from_secs(600), |d| d.ended(0..n)) {
        return Err(format!(
            "the e2e run did not finish within 600 s; logs in {}",
            d.logs.display()
        ));
    }
    let last = (0..n)
        .flat_map(|r| (0..d.procs.len()).map(move |i| (i, r)))
        .map(|k| d.ends[&k].at)
        .max()
        .unwrap_or(started);
    for r in 0..n {
        for i in 0..d.procs.len() {
            let e = &d.ends[&(i, r)];
            if !e.ok {
                return Err(format!(
                    "{} request {r} failed: {}",
                    d.procs[i].label, e.reason
                ));
            }
        }
    }
    let bytes: u64 = (0..n).map(|r| d.ends[&(0, r)].bytes).sum();
    let moving: Duration = (0..n)
        .filter_map(|r| {
            Some(
                d.ends[&(0, r)]
                    .at
                    .saturating_duration_since(*d.first_chunk.get(&r)?),
            )
        })
        .sum();
    d.finish();
    let gbps = |t: Duration| bytes as f64 / 1e9 / t.as_secs_f64().max(1e-9);
    Ok((gbps(last.duration_since(started)), gbps(moving)))
}

/// The large-block rows of one MTU (TCP, and NIXL with `--nixl`), ratios against `best`
/// (iperf3's best); false when one failed.
fn large_rows(o: &Opts, link: &Link, mtu: u32, best: f64) -> bool {
    let mut ok = true;
    let load = loadavg();
    match large(o, link, "tcp") {
        Ok((g, raw, streams)) => {
            println!(
                "| {mtu} | kvbridge TCP, 256 MiB blocks | {g:.2} | {} ({} of raw TCP) | {load} |",
                ratio(g, best),
                ratio(g, raw)
            );
            println!(
                "| {mtu} | raw TCP streams, the same source and destination buffers, best of 1 and 2 per run, alternated with kvbridge ({streams}) | {raw:.2} | {} | {load} |",
                ratio(raw, best)
            );
        }
        Err(e) => {
            ok = false;
            println!("| {mtu} | kvbridge TCP, 256 MiB blocks | error: {e} | | {load} |");
        }
    }
    if o.nixl {
        let load = loadavg();
        match large(o, link, "nixl") {
            Ok((g, raw, _)) => {
                let vs_raw = if raw > 0.0 { g / raw } else { 0.0 };
                println!(
                    "| {mtu} | kvbridge NIXL (UCX_TLS=tcp), 256 MiB blocks | {g:.2} | {} ({vs_raw:.2}x of nixl-sys) | {load} |",
                    ratio(g, best)
                );
                println!(
                    "| {mtu} | nixl-sys directly, same descriptors (kvbridge-lab bench's own baseline) | {raw:.2} | {} | {load} |",
                    ratio(raw, best)
                );
            }
            Err(e) => {
                ok = false;
                println!("| {mtu} | kvbridge NIXL, 256 MiB blocks | error: {e} | | {load} |");
            }
        }
    }
    ok
}

fn ratio(g: f64, best: f64) -> String {
    if best > 0.0 {
        format!("{:.2}x", g / best)
    } else {
        "-".to_owned()
    }
}

fn main() -> ExitCode {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("kvbridge-netns: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(why) = kvbridge_netns::unavailable() {
        eprintln!("kvbridge-netns bench: skipped: {why}");
        return ExitCode::SUCCESS;
    }
    println!(
        "link: veth pair between two network namespaces, no rate limit; iperf3 and kvbridge move {LARGE} bytes per run, median of {} runs; connections_per_peer {}",
        o.runs,
        o.tcp_connections
            .map_or("default".to_owned(), |n| n.to_string())
    );
    println!("| MTU | what | GB/s | vs iperf3 best | load avg |");
    println!("|---|---|---|---|---|");
    let mut failed = false;
    for &mtu in &o.mtus {
        let link = match Link::create(LinkOptions {
            mtu,
            rate_mbit: None,
        }) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("kvbridge-netns bench: {e}");
                return ExitCode::from(1);
            }
        };
        let mut best = 0.0f64;
        for streams in [1, 2] {
            let load = loadavg();
            match iperf3(&link, streams, o.runs) {
                Ok(g) => {
                    best = best.max(g);
                    println!("| {mtu} | iperf3 -P {streams} | {g:.2} | | {load} |");
                }
                Err(e) => {
                    failed = true;
                    println!("| {mtu} | iperf3 -P {streams} | error: {e} | | {load} |");
                }
            }
        }
        failed |= !large_rows(&o, &link, mtu, best);
        drop(link);
        if o.e2e {
            let load = loadavg();
            match e2e(&o, mtu) {
                Ok((wall, moving)) => {
                    println!(
                        "| {mtu} | demo DCP 1 -> 4 end to end, while moving (first chunk to Success, {} requests) | {moving:.2} | {} | {load} |",
                        o.requests,
                        ratio(moving, best)
                    );
                    println!(
                        "| {mtu} | demo DCP 1 -> 4, wall clock (filling and checking every byte included) | {wall:.2} | {} | {load} |",
                        ratio(wall, best)
                    );
                }
                Err(e) => {
                    failed = true;
                    println!("| {mtu} | demo DCP 1 -> 4 end to end | error: {e} | | {load} |");
                }
            }
        }
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
