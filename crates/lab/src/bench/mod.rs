//! `kvbridge-lab bench`: transport throughput against a baseline measured in the same run.
//!
//! The command is transport-agnostic. For each pattern it starts a **receiver process** (this
//! binary again, with the hidden `--role receiver`), which creates a transport, allocates and
//! registers the destination pool and prints its descriptor; this process is the **sender**: it
//! connects, then alternates timed runs of the pattern through the transport with the
//! **baseline**, a plain in-process `memcpy` of the same descriptors into pre-faulted memory,
//! and reports medians. Afterwards the receiver checks every destination byte and reports its
//! peak RSS.
//!
//! A transport plugs in with a [`Factory`] (see [`factory`]): `shm.rs`, `tcp.rs` and `nixl.rs`.
//! `--e2e` (the whole prefill → decode path against memcpy and the transport's own
//! large-block throughput) lives in `e2e.rs`.

use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvbridge_conformance::{SplitMix64, mix64};
use kvbridge_lab::process::{OnDrop, Output, Worker};
use kvbridge_transport::{
    KvTransport, KvTransportExt, MemoryRegion, PeerId, RegionId, TransferBatch, TransferOp,
};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::mpsc;

use crate::progress::Progress;

mod e2e;
mod nixl;
mod shm;
mod strided;
mod tcp;

/// What a [`Factory`] returns: a new transport, or why it could not be made.
pub(crate) type TransportFuture =
    Pin<Box<dyn Future<Output = Result<Arc<dyn KvTransport>, String>> + Send>>;

/// A transport constructor: each process (sender, receiver) calls it once.
pub(crate) type Factory = fn() -> TransportFuture;

/// Shared-memory control directories this process created. Each side tells the other, which
/// removes them if this process dies before its destructors could (killed).
static CONTROL_DIRS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Records a control directory a factory created.
pub(crate) fn created_control_dir(dir: &Path) {
    if let Ok(mut dirs) = CONTROL_DIRS.lock() {
        dirs.push(dir.display().to_string());
    }
}

fn control_dirs() -> Vec<String> {
    CONTROL_DIRS.lock().map(|d| d.clone()).unwrap_or_default()
}

/// Transports `kvbridge-lab bench` can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TransportKind {
    /// Shared memory between two processes on this host (kvbridge-shm).
    Shm,
    /// TCP (kvbridge-tcp).
    Tcp,
    /// NIXL's UCX backend (kvbridge-nixl; build with `--features nixl`).
    Nixl,
}

impl TransportKind {
    fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Nixl => "nixl",
        }
    }
}

/// The factory of a transport, or why it cannot be benchmarked yet.
fn factory(kind: TransportKind) -> Result<Factory, String> {
    match kind {
        TransportKind::Shm => Ok(shm::factory),
        TransportKind::Tcp => Ok(tcp::factory),
        TransportKind::Nixl => Ok(nixl::factory),
    }
}

/// What the processes of one bench run do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Role {
    /// Owns the destination pool; started by the sender.
    Receiver,
    /// The other end of the shm `latency-4k` wake-up baseline (`bench/shm.rs`).
    RawWakePeer,
}

/// Transfer patterns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Pattern {
    /// One 256 MiB block.
    Large,
    /// 4096 blocks of 64 KiB at random places.
    #[value(name = "scatter-64k")]
    Scatter64k,
    /// 3640 blocks of 73,728 bytes (one MLA page of 64 tokens) at random places.
    #[value(name = "scatter-72k")]
    Scatter72k,
    /// 16384 blocks of 16 KiB at random places.
    #[value(name = "scatter-16k")]
    Scatter16k,
    /// Latency of one 4 KiB write plus its notification (p50, p99).
    #[value(name = "latency-4k")]
    Latency4k,
    /// 3640 strided ops of 64 rows of 1152 bytes, each row every 4th of the source and the
    /// rows packed on the destination (one page-layer of a DCP 1 -> 4 relayout per op),
    /// measured against the same transport moving the same bytes as one large block.
    #[value(name = "strided-1152")]
    Strided1152,
}

impl Pattern {
    const ALL: [Pattern; 6] = [
        Pattern::Large,
        Pattern::Scatter64k,
        Pattern::Scatter72k,
        Pattern::Scatter16k,
        Pattern::Strided1152,
        Pattern::Latency4k,
    ];

    fn name(self) -> &'static str {
        match self {
            Pattern::Large => "large",
            Pattern::Scatter64k => "scatter-64k",
            Pattern::Scatter72k => "scatter-72k",
            Pattern::Scatter16k => "scatter-16k",
            Pattern::Latency4k => "latency-4k",
            Pattern::Strided1152 => "strided-1152",
        }
    }

    /// (block size, block count) at full scale; for `strided-1152`, (row size, row count).
    fn shape(self) -> (u64, u64) {
        match self {
            Pattern::Large => (256 << 20, 1),
            Pattern::Scatter64k => (64 << 10, 4096),
            Pattern::Scatter72k => (73_728, 3640),
            Pattern::Scatter16k => (16 << 10, 16384),
            Pattern::Latency4k => (4096, 1),
            // Rows; STRIDED_ROWS of them per op.
            Pattern::Strided1152 => (1152, 3640 * STRIDED_ROWS),
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Rows of the plan each descriptor covers (consecutive in the plan).
    fn rows_per_op(self) -> usize {
        match self {
            Pattern::Strided1152 => STRIDED_ROWS as usize,
            _ => 1,
        }
    }
}

/// Rows per op of `strided-1152` (one page of 64 tokens), and how many ranks share a source
/// page (every 4th row is one rank's).
const STRIDED_ROWS: u64 = 64;
const STRIDED_RANKS: u64 = 4;

/// Arguments of `kvbridge-lab bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Transport to measure.
    #[arg(long, value_enum, default_value = "shm")]
    transport: TransportKind,
    /// Run only this pattern (default: all).
    #[arg(long, value_enum)]
    pattern: Option<Pattern>,
    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// Timed runs per pattern (the median is reported).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u32).range(1..=1000))]
    runs: u32,
    /// Measure the whole prefill -> decode path instead of one transport.
    #[arg(long)]
    e2e: bool,
    /// `--e2e`: gather strided rows into pack buffers on the prefill and post contiguous
    /// ranges (default: post the planner's strided ops).
    #[arg(long, requires = "e2e")]
    pack: bool,
    /// `--e2e`: prefill DCP size (one prefill rank each).
    #[arg(long, requires = "e2e", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    prefill_dcp: u32,
    /// `--e2e`: decode DCP size (one decode rank each).
    #[arg(long, requires = "e2e", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=16))]
    dcp: u32,
    /// `--e2e`: page size of the prefill pool, in tokens.
    #[arg(long, requires = "e2e", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    prefill_page_size: u64,
    /// `--e2e`: page size of the decode pool, in tokens.
    #[arg(long, requires = "e2e", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    page_size: u64,
    /// `--transport nixl`: post strided ops as one NIXL descriptor per row (the transport's
    /// `NixlOptions::stride_descriptors` off) instead of NIXL stride descriptors, to compare
    /// the two forms.
    #[arg(long)]
    nixl_per_row: bool,
    /// Scale every pattern's size by this factor (for quick smoke runs).
    #[arg(long, hide = true, default_value_t = 1.0)]
    size_scale: f64,
    /// Internal: the role of a process started by the bench itself.
    #[arg(long, hide = true, value_enum)]
    role: Option<Role>,
    /// Internal: the receiver's pool size in bytes.
    #[arg(long, hide = true, default_value_t = 0)]
    pool_bytes: u64,
    /// Test knob (TCP across a real link, `kvbridge-netns bench`): the address this process's
    /// listeners bind.
    #[arg(long, hide = true, default_value = "127.0.0.1")]
    bind_addr: std::net::IpAddr,
    /// Test knob: start the receiver and the raw TCP sink inside this network namespace
    /// (`ip netns exec`, root), bound to `--peer-addr`.
    #[arg(long, hide = true, requires = "peer_addr")]
    peer_netns: Option<String>,
    /// Test knob: the address the processes in `--peer-netns` bind.
    #[arg(long, hide = true)]
    peer_addr: Option<std::net::IpAddr>,
    /// Test knob: the TCP transport's `connections_per_peer` (default: its default).
    #[arg(long, hide = true, value_parser = clap::value_parser!(u32).range(1..=16))]
    tcp_connections: Option<u32>,
}

/// Where this run's processes listen (`--bind-addr`, `--peer-netns`, `--peer-addr`).
#[derive(Debug, Clone)]
pub(crate) struct Net {
    /// This process's listeners.
    pub(crate) bind: std::net::IpAddr,
    /// The receiver's and the sink's namespace, if not this one.
    pub(crate) peer_netns: Option<String>,
    /// The address they bind and the sender connects to.
    pub(crate) peer: std::net::IpAddr,
    /// `--tcp-connections`.
    pub(crate) tcp_connections: Option<usize>,
}

static NET: std::sync::OnceLock<Net> = std::sync::OnceLock::new();

/// This run's addresses (loopback unless the test knobs say otherwise).
pub(crate) fn net() -> Net {
    NET.get().cloned().unwrap_or(Net {
        bind: std::net::Ipv4Addr::LOCALHOST.into(),
        peer_netns: None,
        peer: std::net::Ipv4Addr::LOCALHOST.into(),
        tcp_connections: None,
    })
}

/// A command running this binary as a peer process (receiver, sink): inside `--peer-netns`
/// and bound to `--peer-addr` when given.
pub(crate) fn peer_command(args: &[&str]) -> Result<std::process::Command, String> {
    let net = net();
    let mut c = kvbridge_lab::process::this_binary(net.peer_netns.as_deref())?;
    c.args(args).arg("--bind-addr").arg(net.peer.to_string());
    if let Some(n) = net.tcp_connections {
        c.arg("--tcp-connections").arg(n.to_string());
    }
    Ok(c)
}

/// Messages on the receiver's stdout, one JSON object per line.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
enum FromReceiver {
    Ready {
        descriptor_hex: String,
        region: u64,
        #[serde(default)]
        control_dirs: Vec<String>,
    },
    Verified {
        ok: bool,
        detail: String,
    },
    Finished {
        peak_rss_bytes: u64,
        latencies_ns: Vec<u64>,
    },
    /// The raw TCP baseline's sink listens on this port (`raw-sink`).
    RawSink {
        port: u16,
    },
    Failed {
        error: String,
    },
}

/// One result line.
#[derive(Debug, serde::Serialize)]
struct Report {
    transport: &'static str,
    pattern: &'static str,
    bytes: u64,
    blocks: u64,
    gbps: f64,
    baseline: &'static str,
    baseline_gbps: f64,
    ratio: f64,
    receiver_peak_rss_bytes: u64,
    runs: u32,
    verified: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p99_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    local_p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    local_p99_us: Option<f64>,
    /// `latency-4k`: the baseline's round trip (for TCP, a raw ping-pong of the same 4 KiB; for
    /// shm, a `memcpy` of it plus a raw cross-process wake-up round trip).
    #[serde(skip_serializing_if = "Option::is_none")]
    baseline_p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    baseline_p99_us: Option<f64>,
    /// `--transport nixl`: what the timed transfers handed to NIXL per request.
    #[serde(skip_serializing_if = "Option::is_none")]
    nixl_lists: Option<String>,
    /// TCP: the raw baseline's median for each stream count it tried.
    #[serde(skip_serializing_if = "Option::is_none")]
    raw_tcp_streams: Option<String>,
}

const BASELINE: &str = "memcpy into pre-faulted memory";
const SEED: u64 = 0x6b76_6272_6964_6765;

/// The first line of every bench: the build profile, and a warning on a debug build.
fn profile_line() -> &'static str {
    if cfg!(debug_assertions) {
        "profile: debug build (unoptimized, debug assertions on): these figures are NOT \
         representative; measure a release build (`cargo run --release -p kvbridge-lab -- bench`)"
    } else {
        "profile: release build"
    }
}

pub(crate) fn run(args: BenchArgs) -> ExitCode {
    let _ = NET.set(Net {
        bind: args.bind_addr,
        peer_netns: args.peer_netns.clone(),
        peer: args.peer_addr.unwrap_or(args.bind_addr),
        tcp_connections: args.tcp_connections.map(|n| n as usize),
    });
    nixl::PER_ROW.store(args.nixl_per_row, std::sync::atomic::Ordering::Relaxed);
    if args.role.is_none() {
        // On stdout it would break the JSON lines.
        if args.json {
            eprintln!("kvbridge-lab bench: {}", profile_line());
        } else {
            println!("{}", profile_line());
        }
    }
    if args.e2e {
        return e2e::run(&args);
    }
    if !(args.size_scale > 0.0 && args.size_scale <= 1.0) {
        eprintln!(
            "kvbridge-lab bench: --size-scale must be in (0, 1], got {}",
            args.size_scale
        );
        return ExitCode::from(2);
    }
    let make = match factory(args.transport) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("kvbridge-lab bench: {e}");
            return ExitCode::from(2);
        }
    };
    if args.role == Some(Role::RawWakePeer) {
        return shm::raw_wake_peer();
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvbridge-lab bench: could not start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let run = async {
        match args.role {
            Some(Role::Receiver) => receiver(make, args.pool_bytes).await,
            Some(Role::RawWakePeer) => ExitCode::from(2),
            // On a worker, as an application's transfers run: a task that `block_on` drives is
            // woken from a worker by a cross-thread wake-up (a futex call and a thread switch)
            // each time its batch completes, which a task on a worker is not.
            None => tokio::spawn(sender(make, args))
                .await
                .unwrap_or(ExitCode::from(1)),
        }
    };
    // A signal (a Ctrl-C reaches the receiver too) drops the run instead of killing the
    // process, so the transports' destructors remove their shared-memory directories, and a
    // receiver sees its stdin close and stops the same way.
    rt.block_on(async {
        tokio::select! {
            code = run => code,
            why = kvbridge_lab::process::terminating_signal() => {
                eprintln!("kvbridge-lab bench: {why}; stopped");
                ExitCode::from(130)
            }
        }
    })
}

/// The blocks of a pattern: (source offset, destination offset, length), and the pool size.
/// For `strided-1152` the blocks are rows, op after op (see [`Pattern::rows_per_op`]).
fn plan(pattern: Pattern, scale: f64, seed: u64) -> (u64, Vec<(u64, u64, u64)>) {
    if pattern == Pattern::Strided1152 {
        return strided_plan(scale, seed);
    }
    let (block, count) = pattern.shape();
    let (block, count) = if pattern == Pattern::Large {
        let b = ((block as f64 * scale) as u64 / 4096).max(1) * 4096;
        (b, 1)
    } else if pattern == Pattern::Latency4k {
        (block, count)
    } else {
        (block, ((count as f64 * scale).round() as u64).max(1))
    };
    let mut rng = SplitMix64::new(seed ^ block);
    let mut src: Vec<u64> = (0..count).collect();
    let mut dst: Vec<u64> = (0..count).collect();
    rng.shuffle(&mut src);
    rng.shuffle(&mut dst);
    let ops = src
        .iter()
        .zip(&dst)
        .map(|(s, d)| (s * block, d * block, block))
        .collect();
    (block * count, ops)
}

/// `strided-1152`: source pages of `STRIDED_RANKS * STRIDED_ROWS` rows; op `k` of a page takes
/// its rows `k, k + 4, ...` and packs them into a destination slot of `STRIDED_ROWS` rows at a
/// random place. Every row of both pools is covered once.
fn strided_plan(scale: f64, seed: u64) -> (u64, Vec<(u64, u64, u64)>) {
    let (row, rows) = Pattern::Strided1152.shape();
    let page = STRIDED_RANKS * STRIDED_ROWS;
    let pages = ((rows as f64 * scale) as u64 / page).max(1);
    let mut rng = SplitMix64::new(seed ^ row);
    let mut slots: Vec<u64> = (0..pages * STRIDED_RANKS).collect();
    rng.shuffle(&mut slots);
    let mut out = Vec::with_capacity((pages * page) as usize);
    for (op, slot) in slots.iter().enumerate() {
        let (p, k) = (op as u64 / STRIDED_RANKS, op as u64 % STRIDED_RANKS);
        for i in 0..STRIDED_ROWS {
            let src = (p * page + k + i * STRIDED_RANKS) * row;
            let dst = (slot * STRIDED_ROWS + i) * row;
            out.push((src, dst, row));
        }
    }
    (pages * page * row, out)
}

/// The transfer ops of a plan: one per block, or, for a strided pattern, one strided op per
/// `rows_per_op` consecutive rows (rows packed on the destination).
fn plan_ops(
    pattern: Pattern,
    ops: &[(u64, u64, u64)],
    local: RegionId,
    remote: RegionId,
) -> Vec<TransferOp> {
    ops.chunks(pattern.rows_per_op())
        .map(|rows| {
            let (s, d, len) = rows[0];
            let stride = rows.get(1).map_or(len, |r| r.0 - s);
            TransferOp::new(local, s, remote, d, len).with_rows(rows.len() as u64, stride, len)
        })
        .collect()
}

/// The source pool's content: 8-byte words derived from their offset, so any misplaced or
/// stale block is detected.
fn word_at(offset: u64) -> u64 {
    mix64((offset / 8) ^ SEED)
}

fn fill_source(region: &MemoryRegion) -> Result<(), String> {
    const STEP: usize = 1 << 20;
    let mut buf = vec![0u8; STEP];
    let mut at = 0usize;
    while at < region.len() {
        let n = STEP.min(region.len() - at);
        for (k, chunk) in buf[..n].chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&word_at((at + k * 8) as u64).to_le_bytes());
        }
        region
            .write_at(at as u64, &buf[..n])
            .map_err(|e| e.to_string())?;
        at += n;
    }
    Ok(())
}

fn verify(region: &MemoryRegion, ops: &[(u64, u64, u64)]) -> Result<(), String> {
    // Small pieces, so checking does not raise the receiver's peak RSS.
    const PIECE: u64 = 1 << 20;
    let mut buf = Vec::new();
    for &(src, dst, len) in ops {
        let mut done = 0;
        while done < len {
            let n = PIECE.min(len - done);
            buf.resize(n as usize, 0);
            region
                .read_at(dst + done, &mut buf)
                .map_err(|e| e.to_string())?;
            for (k, chunk) in buf.chunks_exact(8).enumerate() {
                let at = done + k as u64 * 8;
                if u64::from_le_bytes(chunk.try_into().unwrap_or_default()) != word_at(src + at) {
                    return Err(format!(
                        "destination byte {} (block from source offset {src}) differs",
                        dst + at
                    ));
                }
            }
            done += n;
        }
    }
    Ok(())
}

fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

fn say(msg: &FromReceiver) {
    if let Ok(line) = serde_json::to_string(msg) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

/// The receiver process: owns the destination pool, records notification latencies, verifies
/// on request (`verify <pattern> <scale>` on stdin), reports on `finish`.
async fn receiver(make: Factory, pool_bytes: u64) -> ExitCode {
    let setup = async {
        let t = make().await?;
        let (id, region) = t
            .allocate_registered(pool_bytes as usize)
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>((t, id, region))
    };
    let (t, id, region) = match setup.await {
        Ok(v) => v,
        Err(error) => {
            say(&FromReceiver::Failed { error });
            return ExitCode::from(1);
        }
    };
    say(&FromReceiver::Ready {
        descriptor_hex: hex(&t.local_descriptor()),
        region: id.0,
        control_dirs: control_dirs(),
    });
    let parent = std::os::unix::process::parent_id();
    // The sender's control directories (`sender-dirs <JSON list>`), removed here if it dies.
    let mut sender_dirs: Vec<String> = Vec::new();
    let mut finished = false;
    let heard = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let latencies = tokio::spawn(listen_for_latencies(Arc::clone(&t), Arc::clone(&heard)));
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(list) = line.strip_prefix("sender-dirs ") {
            sender_dirs = serde_json::from_str(list).unwrap_or_default();
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["verify", pattern, scale] => {
                let (Some(pattern), Ok(scale)) = (Pattern::from_name(pattern), scale.parse())
                else {
                    say(&FromReceiver::Failed {
                        error: format!("bad verify command {line:?}"),
                    });
                    continue;
                };
                let (_, ops) = plan(pattern, scale, SEED);
                let region = region.clone();
                let checked = tokio::task::spawn_blocking(move || verify(&region, &ops))
                    .await
                    .unwrap_or_else(|e| Err(e.to_string()));
                say(&FromReceiver::Verified {
                    ok: checked.is_ok(),
                    detail: checked.err().unwrap_or_default(),
                });
            }
            ["raw-sink", mode] => {
                let started = tcp::SinkMode::parse(mode)
                    .ok_or_else(|| format!("bad raw-sink command {line:?}"))
                    .and_then(|m| tcp::start_raw_sink(region.clone(), pool_bytes, m));
                match started {
                    Ok(port) => say(&FromReceiver::RawSink { port }),
                    Err(error) => say(&FromReceiver::Failed { error }),
                }
            }
            ["finish", expected] => {
                until_heard(&heard, expected.parse().unwrap_or(0)).await;
                finished = true;
                break;
            }
            _ => say(&FromReceiver::Failed {
                error: format!("unknown command {line:?}"),
            }),
        }
    }
    if !finished && !sender_dirs.is_empty() {
        // Our stdin closed early. If the sender died, we are handed to another parent (the
        // kernel closes its pipes first, so give that a moment) and remove what it could not.
        for _ in 0..50 {
            if std::os::unix::process::parent_id() != parent {
                for dir in &sender_dirs {
                    kvbridge_lab::process::remove_control_dir(Path::new(dir));
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let _ = t.shutdown().await;
    let latencies_ns = latencies.await.unwrap_or_default();
    say(&FromReceiver::Finished {
        peak_rss_bytes: peak_rss_bytes(),
        latencies_ns,
    });
    ExitCode::SUCCESS
}

/// The receiver process and what it says.
struct ReceiverProcess {
    worker: Worker,
    output: mpsc::Receiver<Output>,
}

impl ReceiverProcess {
    async fn start(kind: TransportKind, pool_bytes: u64) -> Result<Self, String> {
        let mut command =
            peer_command(&["bench", "--transport", kind.name(), "--role", "receiver"])?;
        command.arg("--pool-bytes").arg(pool_bytes.to_string());
        let (tx, output) = mpsc::channel(16);
        // Not killed on drop: its stdin closes, and it cleans up and exits.
        let worker = Worker::start("receiver", command, 0, &tx, OnDrop::CloseStdin)?;
        Ok(Self { worker, output })
    }

    /// After a failed run: stops the receiver and removes the control directories it may not
    /// have removed itself (it may have been killed, which is why the run failed).
    async fn reap(mut self) {
        self.worker.kill();
        self.worker.reap(Duration::from_secs(10), false).await;
    }

    async fn next(&mut self) -> Result<FromReceiver, String> {
        let line = match tokio::time::timeout(Duration::from_secs(120), self.output.recv()).await {
            Err(_) => return Err("the receiver process stopped answering".to_owned()),
            Ok(Some(Output::Line(_, line))) => line,
            Ok(_) => return Err("the receiver process exited early".to_owned()),
        };
        match serde_json::from_str(&line) {
            Ok(FromReceiver::Failed { error }) => Err(format!("the receiver failed: {error}")),
            Ok(msg) => Ok(msg),
            Err(e) => Err(format!("unexpected receiver output {line:?}: {e}")),
        }
    }

    async fn command(&mut self, line: &str) -> Result<(), String> {
        self.worker.send(line).await
    }
}

async fn sender(make: Factory, args: BenchArgs) -> ExitCode {
    let patterns: Vec<Pattern> = match args.pattern {
        Some(p) => vec![p],
        None => Pattern::ALL.to_vec(),
    };
    let progress = Progress::on_stderr(true);
    let mut reports = Vec::new();
    for pattern in patterns {
        match measure(make, &args, pattern, &progress).await {
            Ok(report) => {
                progress.clear();
                if args.json {
                    match serde_json::to_string(&report) {
                        Ok(line) => println!("{line}"),
                        Err(e) => eprintln!("kvbridge-lab bench: {e}"),
                    }
                }
                reports.push(report);
            }
            Err(e) => {
                progress.clear();
                eprintln!("kvbridge-lab bench: {} failed: {e}", pattern.name());
                return ExitCode::from(1);
            }
        }
    }
    if !args.json {
        print_table(&reports, args.runs);
    }
    if reports.iter().all(|r| r.verified) {
        ExitCode::SUCCESS
    } else {
        eprintln!("kvbridge-lab bench: the receiver found wrong bytes; the figures are not valid");
        ExitCode::from(1)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64
}

async fn measure(
    make: Factory,
    args: &BenchArgs,
    pattern: Pattern,
    progress: &Progress,
) -> Result<Report, String> {
    progress.show(&format!(
        "{}: starting the receiver process",
        pattern.name()
    ));
    let (pool, _) = plan(pattern, args.size_scale, SEED);
    let mut rx = ReceiverProcess::start(args.transport, pool).await?;
    let result = measure_with(&mut rx, make, args, pattern, progress).await;
    if result.is_err() {
        rx.reap().await;
    }
    result
}

impl Report {
    /// The report of a pattern before anything is measured.
    fn unmeasured(
        args: &BenchArgs,
        pattern: &'static str,
        bytes: u64,
        blocks: u64,
        baseline: &'static str,
    ) -> Self {
        Report {
            transport: args.transport.name(),
            pattern,
            bytes,
            blocks,
            gbps: 0.0,
            baseline,
            baseline_gbps: 0.0,
            ratio: 0.0,
            receiver_peak_rss_bytes: 0,
            runs: args.runs,
            verified: false,
            p50_us: None,
            p99_us: None,
            local_p50_us: None,
            local_p99_us: None,
            baseline_p50_us: None,
            baseline_p99_us: None,
            nixl_lists: None,
            raw_tcp_streams: None,
        }
    }
}

/// Waits for the receiver's `Ready`: its descriptor and the region to write.
async fn receiver_ready(rx: &mut ReceiverProcess) -> Result<(Vec<u8>, RegionId), String> {
    match rx.next().await? {
        FromReceiver::Ready {
            descriptor_hex,
            region,
            control_dirs,
        } => {
            rx.worker.control_dirs = control_dirs.into_iter().map(PathBuf::from).collect();
            Ok((
                unhex(&descriptor_hex).ok_or("the receiver sent a malformed descriptor")?,
                RegionId(region),
            ))
        }
        other => Err(format!("expected Ready from the receiver, got {other:?}")),
    }
}

/// Has the receiver start the raw TCP baseline's sink on its pool: its port.
async fn raw_sink(rx: &mut ReceiverProcess, mode: tcp::SinkMode) -> Result<u16, String> {
    rx.command(mode.command()).await?;
    match rx.next().await? {
        FromReceiver::RawSink { port } => Ok(port),
        other => Err(format!("expected RawSink from the receiver, got {other:?}")),
    }
}

/// The raw baseline a pattern is held to on a transport, started; `None` for memcpy of the
/// same blocks (or, for `strided-1152` on TCP, the transport's own large block).
async fn raw_baseline(
    rx: &mut ReceiverProcess,
    transport: TransportKind,
    pattern: Pattern,
    pool: u64,
    src: &MemoryRegion,
    (descriptor, remote): (&[u8], RegionId),
) -> Result<Option<RawBaseline>, String> {
    Ok(match (transport, pattern) {
        (TransportKind::Shm, Pattern::Strided1152) => Some(RawBaseline::LargeBlock),
        // NIXL against the same descriptors posted through nixl-sys directly (`bench/nixl.rs`),
        // for `strided-1152` one per row.
        // `strided-1152` on NIXL: against the transport's own large block (`measure_with`).
        (TransportKind::Nixl, Pattern::Strided1152) => None,
        (TransportKind::Nixl, _) => Some(RawBaseline::Nixl(nixl::DirectBaseline::start(
            src, descriptor, remote,
        )?)),
        (_, Pattern::Strided1152) => None,
        (TransportKind::Tcp, _) => {
            let mode = tcp::SinkMode::of(pattern == Pattern::Latency4k);
            let port = raw_sink(rx, mode).await?;
            Some(RawBaseline::Tcp(tcp::RawTcpBaseline::start(
                pool, port, mode,
            )?))
        }
        (TransportKind::Shm, Pattern::Latency4k) => {
            Some(RawBaseline::Wake(shm::RawWakeBaseline::start()?))
        }
        (TransportKind::Shm, _) => None,
    })
}

/// One run of the raw baseline: `raw`, or memcpy of the same blocks into `dst`; seconds.
fn run_baseline(
    raw: Option<&RawBaseline>,
    src: &MemoryRegion,
    dst: &MemoryRegion,
    pool: u64,
    ops: &[(u64, u64, u64)],
) -> Result<f64, String> {
    match raw {
        Some(RawBaseline::Tcp(raw)) => return raw.run(src),
        Some(RawBaseline::Wake(raw)) => return raw.run(src, dst, pool),
        Some(RawBaseline::LargeBlock) => {
            let start = Instant::now();
            src.copy_to(0, dst, 0, pool).map_err(|e| e.to_string())?;
            return Ok(start.elapsed().as_secs_f64());
        }
        Some(RawBaseline::Nixl(raw)) => return raw.run(ops),
        None => {}
    }
    let start = Instant::now();
    for &(s, d, len) in ops {
        src.copy_to(s, dst, d, len).map_err(|e| e.to_string())?;
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Drains the receiver's notifications until its transport closes: each "lat <unix nanos>"
/// records a one-way latency (and counts in `heard`); others are just drained.
async fn listen_for_latencies(
    t: Arc<dyn KvTransport>,
    heard: Arc<std::sync::atomic::AtomicUsize>,
) -> Vec<u64> {
    let mut lat = Vec::new();
    while let Ok(n) = t.recv_notification().await {
        let now = unix_nanos();
        if let Some(sent) = std::str::from_utf8(&n.payload)
            .ok()
            .and_then(|s| s.strip_prefix("lat "))
            .and_then(|s| s.parse::<u64>().ok())
        {
            if lat.len() < 1_000_000 {
                lat.push(now.saturating_sub(sent));
            }
            heard.fetch_add(1, std::sync::atomic::Ordering::Release);
        }
    }
    lat
}

/// Waits until `heard` counts `expected` notifications, for 10 s at most.
async fn until_heard(heard: &std::sync::atomic::AtomicUsize, expected: usize) {
    let end = Instant::now() + Duration::from_secs(10);
    while heard.load(std::sync::atomic::Ordering::Acquire) < expected && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Has the receiver verify every byte and report its memory and latencies, into `report`.
async fn verify_and_finish(
    rx: &mut ReceiverProcess,
    args: &BenchArgs,
    pattern: Pattern,
    latency_notes: usize,
    report: &mut Report,
) -> Result<(), String> {
    let name = pattern.name();
    rx.command(&format!("verify {name} {}", args.size_scale))
        .await?;
    match rx.next().await? {
        FromReceiver::Verified { ok, detail } => {
            report.verified = ok;
            if !ok {
                eprintln!("kvbridge-lab bench: {name}: {detail}");
            }
        }
        other => return Err(format!("expected Verified, got {other:?}")),
    }
    // A transport's `wait` may return before its notification is read on the other side: the
    // receiver waits (bounded) for every one it is told of before it reports.
    rx.command(&format!("finish {latency_notes}")).await?;
    let latencies = match rx.next().await? {
        FromReceiver::Finished {
            peak_rss_bytes,
            latencies_ns,
        } => {
            report.receiver_peak_rss_bytes = peak_rss_bytes;
            latencies_ns
        }
        other => return Err(format!("expected Finished, got {other:?}")),
    };
    if pattern == Pattern::Latency4k {
        let mut l = latencies;
        l.sort_unstable();
        report.p50_us = Some(percentile(&l, 0.5) / 1e3);
        report.p99_us = Some(percentile(&l, 0.99) / 1e3);
    }
    Ok(())
}

async fn measure_with(
    rx: &mut ReceiverProcess,
    make: Factory,
    args: &BenchArgs,
    pattern: Pattern,
    progress: &Progress,
) -> Result<Report, String> {
    let name = pattern.name();
    let (pool, ops) = plan(pattern, args.size_scale, SEED);
    let (descriptor, remote) = receiver_ready(rx).await?;
    let t = make().await?;
    let dirs = serde_json::to_string(&control_dirs()).map_err(|e| e.to_string())?;
    rx.command(&format!("sender-dirs {dirs}")).await?;
    let e = |e: kvbridge_transport::TransportError| e.to_string();
    let (local, src) = t.allocate_registered(pool as usize).await.map_err(e)?;
    fill_source(&src)?;
    let peer = t.connect(&descriptor).await.map_err(e)?;
    let transfer_ops = plan_ops(pattern, &ops, local, remote);
    // `strided-1152` is measured against the same transport moving the same bytes as one
    // large block (its own best case), alternating.
    // On shm it is held to memcpy of one large block (`RawBaseline::LargeBlock`) instead.
    let own_large = matches!(args.transport, TransportKind::Tcp | TransportKind::Nixl);
    let large = (pattern == Pattern::Strided1152 && own_large).then(|| {
        TransferBatch::write(vec![TransferOp::new(local, 0, remote, 0, pool)])
            .with_timeout(Duration::from_secs(60))
    });
    // The baseline's destination: pre-faulted heap memory in this process.
    let baseline_dst = MemoryRegion::allocate(pool as usize).map_err(|e| e.to_string())?;
    // TCP is measured against raw TCP streams into the receiver's own pool (`bench/tcp.rs`),
    // shm's `latency-4k` against a raw cross-process wake-up round trip (`bench/shm.rs`).
    let target = (&descriptor[..], remote);
    let raw = raw_baseline(rx, args.transport, pattern, pool, &src, target).await?;
    let baseline_run = || run_baseline(raw.as_ref(), &src, &baseline_dst, pool, &ops);
    let batch = |note: Bytes| {
        TransferBatch::write(transfer_ops.clone())
            .with_notification(note)
            .with_timeout(Duration::from_secs(60))
    };
    // The baseline of one run: the raw one, or the transport's own large block.
    let base_run = || async {
        let Some(large) = &large else {
            return baseline_run();
        };
        let start = Instant::now();
        t.transfer(peer, large.clone()).await.map_err(e)?;
        Ok(start.elapsed().as_secs_f64())
    };
    // Warm-up (maps the peer's pool, warms caches), untimed.
    base_run().await?;
    t.transfer(peer, batch(Bytes::from_static(b"warm-up")))
        .await
        .map_err(e)?;

    let baseline = RawBaseline::describe(raw.as_ref(), large.is_some());
    let mut report = Report::unmeasured(args, name, pool, transfer_ops.len() as u64, baseline);
    // Notifications the receiver must have seen before it reports its latencies.
    let mut latency_notes = 0;
    if pattern == Pattern::Latency4k {
        latency_notes = latency(
            &t,
            peer,
            &ops,
            &transfer_ops,
            args,
            progress,
            &mut report,
            baseline_run,
        )
        .await?;
    } else {
        let mut base_times = Vec::new();
        let mut times = Vec::new();
        let mut lists = kvbridge_nixl::NixlStats::default();
        for run in 0..args.runs {
            progress.show(&format!("{name}: run {}/{}", run + 1, args.runs));
            // Side by side: the baseline and the transport alternate (the transport last, so
            // the receiver verifies its layout).
            base_times.push(base_run().await?);
            let start = Instant::now();
            let done = t.transfer(peer, batch(Bytes::from_static(b"run")));
            nixl::counted(&mut lists, done).await.map_err(e)?;
            times.push(start.elapsed().as_secs_f64());
        }
        report.nixl_lists = nixl::lists_for(args.transport, &lists, args.runs);
        if let Some(RawBaseline::Tcp(raw)) = &raw {
            report.raw_tcp_streams = raw.per_count();
        }
        report.gbps = pool as f64 / median(times) / 1e9;
        report.baseline_gbps = pool as f64 / median(base_times) / 1e9;
        report.ratio = report.gbps / report.baseline_gbps;
    }
    progress.show(&format!("{name}: verifying"));
    verify_and_finish(rx, args, pattern, latency_notes, &mut report).await?;
    let _ = t.shutdown().await;
    // It finished (it removes its own control directories) and exits: bounded, as every wait.
    rx.worker.reap(Duration::from_secs(10), true).await;
    Ok(report)
}

/// One 4 KiB write plus its notification, many times: one-way latency (post → notification
/// received by the peer, from the receiver's clock) and local completion (post → `wait`).
#[allow(clippy::too_many_arguments)]
async fn latency(
    t: &Arc<dyn KvTransport>,
    peer: PeerId,
    ops: &[(u64, u64, u64)],
    transfer_ops: &[TransferOp],
    args: &BenchArgs,
    progress: &Progress,
    report: &mut Report,
    baseline_run: impl Fn() -> Result<f64, String>,
) -> Result<usize, String> {
    let iterations = ((2000.0 * args.size_scale * f64::from(args.runs) / 7.0) as usize).max(20);
    let mut local = Vec::with_capacity(iterations);
    let mut base = Vec::with_capacity(iterations);
    for i in 0..iterations {
        if i % 100 == 0 {
            progress.show(&format!("latency-4k: {i}/{iterations}"));
        }
        base.push((baseline_run()? * 1e9) as u64);
        let note = Bytes::from(format!("lat {}", unix_nanos()));
        let start = Instant::now();
        t.transfer(
            peer,
            TransferBatch::write(transfer_ops.to_vec()).with_notification(note),
        )
        .await
        .map_err(|e| e.to_string())?;
        local.push(start.elapsed().as_nanos() as u64);
    }
    let bytes: u64 = ops.iter().map(|o| o.2).sum();
    local.sort_unstable();
    base.sort_unstable();
    let p50 = percentile(&local, 0.5);
    let base_p50 = percentile(&base, 0.5);
    report.local_p50_us = Some(p50 / 1e3);
    report.local_p99_us = Some(percentile(&local, 0.99) / 1e3);
    report.baseline_p50_us = Some(base_p50 / 1e3);
    report.baseline_p99_us = Some(percentile(&base, 0.99) / 1e3);
    // ratio = baseline p50 / `wait` p50. TCP's are both round trips (post to `wait` returning
    // is the data out and the receiver's `Done` back, against send and reply); shm's `wait`
    // returns once the notification is written, so its one-way figure is reported beside it.
    report.gbps = bytes as f64 / p50;
    report.baseline_gbps = bytes as f64 / base_p50;
    report.ratio = report.gbps / report.baseline_gbps;
    Ok(iterations)
}

/// A baseline other than `memcpy` of the same blocks, measured in the same run as the
/// transport.
enum RawBaseline {
    Tcp(tcp::RawTcpBaseline),
    Wake(shm::RawWakeBaseline),
    /// `memcpy` of the same bytes as one large block (what a strided pattern is held to).
    LargeBlock,
    Nixl(nixl::DirectBaseline),
}

impl RawBaseline {
    /// What a run is held to: `raw`, else the transport's own large block (`own_large`), else
    /// memcpy of the same blocks.
    fn describe(raw: Option<&RawBaseline>, own_large: bool) -> &'static str {
        match (raw, own_large) {
            (Some(raw), _) => raw.description(),
            (None, true) => LARGE_BASELINE,
            (None, false) => BASELINE,
        }
    }

    fn description(&self) -> &'static str {
        match self {
            RawBaseline::Tcp(_) => tcp::BASELINE,
            RawBaseline::Wake(_) => shm::WAKE_BASELINE,
            RawBaseline::LargeBlock => LARGE_BLOCK_BASELINE,
            RawBaseline::Nixl(_) => nixl::BASELINE,
        }
    }
}

/// The baseline of `strided-1152` on shm.
const LARGE_BLOCK_BASELINE: &str = "memcpy of the same bytes as one large block";

/// The baseline of `strided-1152` on the other transports.
const LARGE_BASELINE: &str = "the same transport moving one large block";

/// The short name of a baseline in the `latency-4k` notes.
fn baseline_label(description: &str) -> &'static str {
    match description {
        tcp::BASELINE => "raw TCP ping-pong",
        shm::WAKE_BASELINE => "memcpy + raw wake-up round trip",
        LARGE_BLOCK_BASELINE => "memcpy (one large block)",
        LARGE_BASELINE => "the transport's own large block",
        nixl::BASELINE => "direct nixl-sys",
        _ => "memcpy",
    }
}

fn print_table(reports: &[Report], runs: u32) {
    let transport = reports.first().map_or("?", |r| r.transport);
    let baseline = reports.first().map_or(BASELINE, |r| r.baseline);
    let base_col = if baseline == BASELINE {
        "memcpy"
    } else {
        "baseline"
    };
    println!(
        "{:<12} {:>10} {:>7} {:>10} {:>10} {:>7} {:>12}  notes",
        "pattern",
        "MiB",
        "blocks",
        format!("{transport} GB/s"),
        format!("{base_col} GB/s"),
        "ratio",
        "recv RSS MiB",
    );
    for r in reports {
        let notes = match (r.p50_us, r.p99_us) {
            (Some(p50), Some(p99)) => format!(
                "write+notify p50 {p50:.1} us, p99 {p99:.1} us; local wait p50 {:.1} us, \
                 p99 {:.1} us; {} p50 {:.1} us, p99 {:.1} us",
                r.local_p50_us.unwrap_or(f64::NAN),
                r.local_p99_us.unwrap_or(f64::NAN),
                baseline_label(r.baseline),
                r.baseline_p50_us.unwrap_or(f64::NAN),
                r.baseline_p99_us.unwrap_or(f64::NAN),
            ),
            _ if !r.verified => "WRONG BYTES".to_owned(),
            _ => "verified".to_owned(),
        };
        println!(
            "{:<12} {:>10.1} {:>7} {:>10.2} {:>10.2} {:>7.2} {:>12.1}  {}",
            r.pattern,
            r.bytes as f64 / (1 << 20) as f64,
            r.blocks,
            r.gbps,
            r.baseline_gbps,
            r.ratio,
            r.receiver_peak_rss_bytes as f64 / (1 << 20) as f64,
            notes
        );
    }
    println!(
        "median of {runs} runs; baseline: {baseline} of the same blocks, in the same run; \
         receiver in its own process"
    );
    for r in reports.iter().filter(|r| r.baseline != baseline) {
        println!("{}: baseline: {}, in the same run", r.pattern, r.baseline);
    }
    for r in reports {
        if let Some(lists) = &r.nixl_lists {
            println!("{}: {lists}", r.pattern);
        }
        if let Some(streams) = &r.raw_tcp_streams {
            println!("{}: raw TCP: {streams}", r.pattern);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_each_slot_once() {
        for pattern in Pattern::ALL {
            let (pool, ops) = plan(pattern, 0.01, 7);
            let (block, _) = pattern.shape();
            let mut src: Vec<u64> = ops.iter().map(|o| o.0).collect();
            let mut dst: Vec<u64> = ops.iter().map(|o| o.1).collect();
            src.sort_unstable();
            dst.sort_unstable();
            let len = ops[0].2;
            let slots: Vec<u64> = (0..ops.len() as u64).map(|i| i * len).collect();
            assert_eq!(src, slots, "{}", pattern.name());
            assert_eq!(dst, slots, "{}", pattern.name());
            assert_eq!(pool, len * ops.len() as u64);
            if pattern != Pattern::Large {
                assert_eq!(len, block);
            }
        }
        let (pool, ops) = plan(Pattern::Scatter72k, 1.0, 1);
        assert_eq!((pool, ops.len()), (3640 * 73_728, 3640));
        let (pool, ops) = plan(Pattern::Large, 1.0, 1);
        assert_eq!((pool, ops.len()), (256 << 20, 1));
    }

    #[test]
    fn strided_ops_cover_exactly_the_planned_rows() {
        let (pool, rows) = plan(Pattern::Strided1152, 0.01, SEED);
        let ops: Vec<TransferOp> = rows
            .iter()
            .map(|&(s, d, len)| TransferOp::new(RegionId(1), s, RegionId(2), d, len))
            .collect();
        let strided = plan_ops(Pattern::Strided1152, &rows, RegionId(1), RegionId(2));
        assert_eq!(strided.len() as u64 * STRIDED_ROWS, ops.len() as u64);
        assert_eq!(
            TransferBatch::write(strided)
                .expand_rows("t", None)
                .unwrap()
                .ops,
            ops
        );
        let (full_pool, full_rows) = plan(Pattern::Strided1152, 1.0, SEED);
        assert_eq!((full_pool, full_rows.len()), (268_369_920, 232_960));
        assert!(pool <= full_pool);
    }

    #[test]
    fn verification_catches_a_misplaced_block() {
        let (pool, ops) = plan(Pattern::Scatter16k, 0.001, SEED);
        let src = MemoryRegion::allocate(pool as usize).unwrap();
        let dst = MemoryRegion::allocate(pool as usize).unwrap();
        fill_source(&src).unwrap();
        for &(s, d, len) in &ops {
            src.copy_to(s, &dst, d, len).unwrap();
        }
        verify(&dst, &ops).unwrap();
        dst.write_at(ops[3].1 + 8, &[0xff]).unwrap();
        assert!(verify(&dst, &ops).unwrap_err().contains("differs"));
    }

    #[test]
    fn each_baseline_has_its_own_label() {
        assert_eq!(baseline_label(BASELINE), "memcpy");
        assert_eq!(baseline_label(tcp::BASELINE), "raw TCP ping-pong");
        assert_eq!(
            baseline_label(shm::WAKE_BASELINE),
            "memcpy + raw wake-up round trip"
        );
    }

    #[test]
    fn hex_round_trips() {
        let bytes = b"kvbridge-shm:1:\x00\xff";
        assert_eq!(unhex(&hex(bytes)).unwrap(), bytes);
        assert!(unhex("abc").is_none());
    }
}
