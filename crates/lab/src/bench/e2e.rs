//! `kvbridge-lab bench --e2e`: the whole prefill -> decode path (agents, TCP control channels,
//! HTTP bootstrap, planner, transport) against baselines moving the same bytes, in the same
//! run: as large blocks, and on shared memory as the planner's own strided ops.
//!
//! Geometry: the demo's default, MLA with 61 layers of 1152 bytes per token, one request of
//! 8192 tokens (575.7 MB; `--size-scale` shrinks the tokens), prefill DCP 1, page 64 -> decode
//! DCP 4, page 64; `--prefill-dcp`, `--dcp`, `--prefill-page-size` and `--page-size` pick
//! another pair (e.g. DCP 2 -> 4 with page 16 -> 64, or DCP 4 -> 1). Every agent runs in this
//! process, each with its own transport instance (`--transport shm|tcp`), so every path pays
//! the same copies. Timed runs alternate (memcpy, transport, coordinator, ...); medians are
//! reported.
//!
//! - **Coordinator run**: create the room, every decode rank receives it (metadata over the
//!   control channel), every prefill rank sends its chunks of 4096 tokens and waits for
//!   Success; timed until every decode rank saw Success. The planner's strided ops are posted
//!   as they are, or with `--pack` gathered into pack buffers first.
//! - **plain copy**: the request's bytes as one `memcpy` between two buffers of ordinary memory
//!   (not registered, no claims): the fastest plain copy of the same bytes on this machine.
//! - **memcpy**: the same bytes, layer by layer, copied in-process from the prefill pools to
//!   the decode pools as a few large blocks (each prefill rank's rows of a layer are back to
//!   back, and so are each decode rank's): the memory's own speed.
//! - **transport**: the same large blocks posted through the prefill transports to the decode
//!   transports: the transport's own large-block throughput.
//! - **strided limit** and **per-row memcpy** (`--transport shm` only, `strided.rs`): the
//!   planner's own ops for the request copied in this process on one thread, with streaming
//!   stores (the shared-memory target's baseline) or one `memcpy` per row.
//! - **direct NIXL** (`--transport nixl` only): the request's rows posted through nixl-sys
//!   directly, without kvbridge: per prefill rank a raw NIXL agent writes each decode rank its
//!   rows as one transfer, one NIXL descriptor per run of rows contiguous on both sides (what
//!   the coordinator's strided ops describe, in NIXL's own terms), polled in a tight loop, each
//!   prefill rank on a thread of its own.
//!
//! The coordinator path is verified once, untimed: the decode pools are zeroed, one run moves
//! the request, and every row of every decode rank is checked against the owner rule.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbridge_coordinator::bootstrap::{
    BootstrapClient, BootstrapConfig, BootstrapServer, HttpDirectory, RankRegistration,
};
use kvbridge_coordinator::net_channel::{NetChannel, NetChannelConfig};
use kvbridge_coordinator::{
    AllocatedMemory, Chunk, DecodeAgent, EntryRegion, KvMemory, MetricsSnapshot, PackBuffers,
    PrefillAgent, PrefillConfig, ReceiveRequest,
};
use kvbridge_handshake::{PeerDescriptor, Role};
use kvbridge_lab::views::kv_views;
use kvbridge_nixl::baseline::DirectOp;
use kvbridge_testkit::fill::{TokenLayout, fill_rows, verify_rows};
use kvbridge_transport::{KvTransport, PeerId, TransferBatch, TransferOp};

use super::strided::{PlannedRows, Rank};
use super::{BenchArgs, Factory, TransportKind, factory};

const LAYERS: usize = 61;
const TOKEN_BYTES: u64 = 1152;
const CHUNK_TOKENS: u64 = 4096;
/// Pack buffers per decode rank (`--pack`): two chunks in flight to each.
const PACK_PER_DECODE: usize = 2;
/// The pattern's request id (the same bytes whichever room moves them).
const PATTERN_ROOM: u64 = 1;
/// Targets of the coordinator against its baseline (docs/benchmarks.md, "End to end"): on the
/// demo's pair (DCP 1 page 64 -> DCP 4 page 64), shared memory against the plain copy, NIXL
/// against its own large blocks, TCP against its own large blocks; every other pair on every
/// transport against the same baselines.
const TARGET: f64 = 0.8;
const TCP_TARGET: f64 = 0.9;
const OTHER_PAIR_TARGET: f64 = 0.7;
/// Target of shared memory against the strided limit on DCP 1 -> 4 and 4 -> 1 (page 64).
const STRIDED_TARGET: f64 = 0.9;
/// Target of the NIXL transport against the same rows posted through nixl-sys directly.
const DIRECT_TARGET: f64 = 0.9;

fn desc(role: Role, page: u64, tp: u32, rank: u32, dcp: u32) -> Result<PeerDescriptor, String> {
    PeerDescriptor::mla(role, page, LAYERS, TOKEN_BYTES)
        .attn_tp(tp, rank)
        .dcp(dcp)
        .build()
        .map_err(|e| format!("internal: {e}"))
}

/// One result.
#[derive(Debug, serde::Serialize)]
struct Report {
    bench: &'static str,
    transport: &'static str,
    geometry: String,
    pack: bool,
    bytes: u64,
    runs: u32,
    coordinator_gbps: f64,
    plain_gbps: f64,
    memcpy_gbps: f64,
    transport_gbps: f64,
    /// `coordinator_gbps / plain_gbps` (the shm target).
    plain_ratio: f64,
    /// `coordinator_gbps / memcpy_gbps`.
    memcpy_ratio: f64,
    /// `coordinator_gbps / transport_gbps` (the TCP target).
    transport_ratio: f64,
    /// The strided limit (`--transport shm`): the planner's ops copied in this process on one
    /// thread with streaming stores; GB/s, ms and `coordinator_gbps / strided_gbps` (the shm
    /// target).
    strided_gbps: Option<f64>,
    strided_ms: Option<f64>,
    strided_ratio: Option<f64>,
    /// The same rows, one `memcpy` each (`--transport shm`).
    row_memcpy_gbps: Option<f64>,
    row_memcpy_ms: Option<f64>,
    row_memcpy_ratio: Option<f64>,
    /// Ops and rows the strided baselines copy per request (the planner's, as the coordinator
    /// posts them: equal to `descriptors` and `rows` without `--pack`).
    planned_descriptors: Option<u64>,
    planned_rows: Option<u64>,
    /// The direct-NIXL baseline (`--transport nixl`): GB/s, ms, NIXL descriptors per request,
    /// and `coordinator_gbps / direct_gbps` (the NIXL target).
    direct_gbps: Option<f64>,
    direct_ms: Option<f64>,
    direct_descriptors: Option<u64>,
    /// `--transport nixl`: what the coordinator's batches handed to NIXL per request.
    #[serde(skip_serializing_if = "Option::is_none")]
    nixl_lists: Option<String>,
    direct_ratio: Option<f64>,
    coordinator_ms: f64,
    plain_ms: f64,
    memcpy_ms: f64,
    transport_ms: f64,
    /// Per request, over every prefill rank: transport ops posted (a strided op counts one),
    /// KV only (the bench registers no aux buffers).
    descriptors: u64,
    /// Rows those ops cover (the descriptors of a transport without strided ops).
    rows: u64,
    /// Batches posted from pack buffers, per request (`--pack`).
    pack_batches: u64,
    /// Bytes gathered into pack buffers, per request (`--pack`).
    pack_bytes: u64,
    /// Large blocks the two baselines copy.
    baseline_blocks: u64,
    verified: bool,
}

struct Prefill {
    agent: PrefillAgent,
    desc: PeerDescriptor,
    mem: AllocatedMemory,
    transport: Arc<dyn KvTransport>,
    table: Vec<u64>,
    /// Raw connection to each decode transport (the transport baseline).
    peers: Vec<PeerId>,
}

struct Decode {
    agent: DecodeAgent,
    desc: PeerDescriptor,
    mem: AllocatedMemory,
    transport: Arc<dyn KvTransport>,
    table: Vec<u64>,
}

/// A large block of the baselines: `len` bytes from prefill `p`'s entry `layer` at `src` to
/// decode `q`'s entry `layer` at `dst` (offsets inside the entries).
#[derive(Debug, Clone, Copy)]
struct Block {
    p: usize,
    q: usize,
    layer: usize,
    src: u64,
    dst: u64,
    len: u64,
}

/// The request's geometry from the arguments.
struct Shape {
    tokens: u64,
    prefill_dcp: u32,
    dcp: u32,
    prefill_page: u64,
    page: u64,
}

impl Shape {
    /// The arguments' pair, with the tokens (8192 times `--size-scale`) rounded to whole pages
    /// of every rank on both sides.
    fn of(args: &BenchArgs) -> Self {
        let (a, b) = (args.prefill_dcp, args.dcp);
        let (pp, dp) = (args.prefill_page_size, args.page_size);
        let align = (pp * u64::from(a)).max(dp * u64::from(b));
        Self {
            tokens: ((8192.0 * args.size_scale) as u64 / align).max(1) * align,
            prefill_dcp: a,
            dcp: b,
            prefill_page: pp,
            page: dp,
        }
    }
}

pub(super) fn run(args: &BenchArgs) -> ExitCode {
    if !(args.size_scale > 0.0 && args.size_scale <= 1.0) {
        eprintln!(
            "kvbridge-lab bench --e2e: --size-scale must be in (0, 1], got {}",
            args.size_scale
        );
        return ExitCode::from(2);
    }
    // Spans are exported only when OTEL_EXPORTER_OTLP_ENDPOINT is set (tracing on vs off is
    // then the same bench); dropped after the runtime, so every span is flushed.
    let _telemetry = kvbridge_lab::telemetry::init(
        kvbridge_lab::telemetry::TelemetryOptions {
            process: "bench".to_owned(),
            default_log: "error".to_owned(),
            ..Default::default()
        },
        std::io::stderr,
    );
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvbridge-lab bench --e2e: could not start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(bench(args)) {
        Ok(report) => {
            print(args, &report);
            if report.verified {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("kvbridge-lab bench --e2e: {e}");
            ExitCode::from(1)
        }
    }
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Positions `[0, tokens)` that rank `rank` of a DCP group of `size` holds.
fn owned(tokens: u64, size: u32, rank: u32) -> u64 {
    let (size, rank) = (u64::from(size), u64::from(rank));
    tokens / size + u64::from(rank < tokens % size)
}

/// Zeroes the decodes' pools, runs one request through the coordinator and checks every
/// byte each decode rank holds: whether all are right.
async fn verified_run(
    prefills: &[Prefill],
    decodes: &[Decode],
    addr: &str,
    room: u64,
    tokens: u64,
) -> Result<bool, String> {
    for d in decodes {
        for v in kv_views(&d.mem) {
            v.region
                .fill(v.offset, v.len, 0)
                .map_err(|x| x.to_string())?;
        }
    }
    coordinator_run(prefills, decodes, addr, room, tokens).await?;
    let mut verified = true;
    let mut got = 0;
    for d in decodes {
        let layout = TokenLayout::for_rank(&d.desc, d.table.clone())?;
        match verify_rows(&kv_views(&d.mem), &layout, PATTERN_ROOM, 0..tokens) {
            Ok(n) => got += n,
            Err(err) => {
                eprintln!(
                    "kvbridge-lab bench --e2e: the coordinator left a wrong byte on decode rank {}: \
                     {err}",
                    d.desc.dcp_rank
                );
                verified = false;
            }
        }
    }
    Ok(verified && got == tokens * LAYERS as u64 * TOKEN_BYTES)
}

/// One prefill agent per prefill DCP rank, its pool filled with the request's rows and
/// registered with the bootstrap server at `addr`.
async fn start_prefills(
    args: &BenchArgs,
    make: Factory,
    addr: &str,
    tokens: u64,
    ppages: u64,
) -> Result<Vec<Prefill>, String> {
    let e = |e: kvbridge_coordinator::CoordinatorError| e.to_string();
    let (a, b, pp) = (args.prefill_dcp, args.dcp, args.prefill_page_size);
    let mut prefills = Vec::new();
    for r in 0..a {
        let pd = desc(Role::Prefill, pp, a, r, a)?;
        let pt = make().await?;
        let pmem = KvMemory::allocate(&*pt, &pd, ppages, 0).await.map_err(e)?;
        let table: Vec<u64> = (0..ppages).collect();
        let layout = TokenLayout::for_rank(&pd, table.clone())?;
        fill_rows(&kv_views(&pmem), &layout, PATTERN_ROOM, 0..tokens)?;
        let mut config = PrefillConfig::default();
        if args.pack {
            config = config.with_pack_buffers(PackBuffers::new(
                PACK_PER_DECODE * b as usize,
                CHUNK_TOKENS.max(pp * u64::from(a)),
                u64::from(b),
            ));
        }
        let agent = PrefillAgent::builder(
            pd.clone(),
            pmem.memory.clone(),
            pt.clone(),
            Arc::new(
                NetChannel::bind(NetChannelConfig::default())
                    .await
                    .map_err(|c| c.to_string())?,
            ),
        )
        .config(config)
        .kv_regions(pmem.kv_regions.clone())
        .start()
        .map_err(e)?;
        BootstrapClient::new(addr)
            .register(&RankRegistration::from(agent.rank_info()))
            .await
            .map_err(|e| e.to_string())?;
        prefills.push(Prefill {
            agent,
            desc: pd,
            mem: pmem,
            transport: pt,
            table,
            peers: Vec::new(),
        });
    }
    Ok(prefills)
}

/// One decode agent per decode DCP rank (pages in reverse order); every prefill's transport
/// also connects to each, for the raw-transport baseline.
async fn start_decodes(
    args: &BenchArgs,
    make: Factory,
    prefills: &mut [Prefill],
    dpages: u64,
) -> Result<Vec<Decode>, String> {
    let e = |e: kvbridge_coordinator::CoordinatorError| e.to_string();
    let (b, dp) = (args.dcp, args.page_size);
    let mut decodes = Vec::new();
    for r in 0..b {
        let dd = desc(Role::Decode, dp, b, r, b)?;
        let dt = make().await?;
        let dmem = KvMemory::allocate(&*dt, &dd, dpages, 0).await.map_err(e)?;
        let agent = DecodeAgent::builder(
            dd.clone(),
            dmem.memory.clone(),
            dt.clone(),
            Arc::new(
                NetChannel::bind(NetChannelConfig::default())
                    .await
                    .map_err(|c| c.to_string())?,
            ),
            Arc::new(HttpDirectory::new()),
        )
        .start()
        .map_err(e)?;
        for p in prefills.iter_mut() {
            let peer = p
                .transport
                .connect(&dt.local_descriptor())
                .await
                .map_err(|err| {
                    format!("transport baseline: connecting to decode rank {r}: {err}")
                })?;
            p.peers.push(peer);
        }
        decodes.push(Decode {
            agent,
            desc: dd,
            mem: dmem,
            transport: dt,
            table: (0..dpages).rev().collect(),
        });
    }
    Ok(decodes)
}

/// Stops every agent, then every transport.
async fn shutdown(prefills: &[Prefill], decodes: &[Decode]) {
    for p in prefills {
        p.agent.shutdown();
    }
    for d in decodes {
        d.agent.shutdown();
    }
    for p in prefills {
        let _ = p.transport.shutdown().await;
    }
    for d in decodes {
        let _ = d.transport.shutdown().await;
    }
}

/// The medians of the timed runs.
struct Medians {
    coordinator: Duration,
    plain: Duration,
    memcpy: Duration,
    transport: Duration,
    direct: Option<Duration>,
    /// The strided limit and the per-row memcpy (`--transport shm`).
    strided: Option<(Duration, Duration)>,
    /// What the coordinator's batches handed to NIXL over the runs (`--transport nixl`).
    lists: kvbridge_nixl::NixlStats,
}

/// The timed runs, alternated: plain copy, memcpy, transport, direct NIXL, strided limit,
/// per-row memcpy, coordinator; `room` is the last room used.
async fn timed_runs(
    args: &BenchArgs,
    e2e: &E2e<'_>,
    plain: &mut PlainCopy,
    direct: Option<&super::nixl::DirectE2e>,
    rows: Option<&PlannedRows>,
    room: &mut u64,
) -> Result<Medians, String> {
    let (prefills, decodes, blocks) = (e2e.prefills, e2e.decodes, e2e.blocks);
    let (mut coord, mut mem, mut raw, mut direct_runs, mut plains) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut limit, mut per_row) = (Vec::new(), Vec::new());
    let mut lists = kvbridge_nixl::NixlStats::default();
    for _ in 0..args.runs {
        plains.push(plain.run());
        mem.push(memcpy_run(prefills, decodes, blocks)?);
        raw.push(transport_run(prefills, decodes, blocks).await?);
        if let Some(d) = direct {
            direct_runs.push(d.run()?);
        }
        if let Some(r) = rows {
            limit.push(r.limit_run()?);
            per_row.push(r.memcpy_rows_run()?);
        }
        *room += 1;
        let run = coordinator_run(prefills, decodes, e2e.addr, *room, e2e.tokens);
        coord.push(super::nixl::counted(&mut lists, run).await?);
    }
    Ok(Medians {
        coordinator: median(&mut coord),
        plain: median(&mut plains),
        memcpy: median(&mut mem),
        transport: median(&mut raw),
        direct: direct.map(|_| median(&mut direct_runs)),
        strided: rows.map(|_| (median(&mut limit), median(&mut per_row))),
        lists,
    })
}

/// What the timed runs move, and where.
struct E2e<'a> {
    prefills: &'a [Prefill],
    decodes: &'a [Decode],
    blocks: &'a [Block],
    addr: &'a str,
    tokens: u64,
}

/// One pair's measurement: set-up, the untimed verified run, the alternating timed runs
/// ([`timed_runs`]) and the report.
async fn bench(args: &BenchArgs) -> Result<Report, String> {
    let make = factory(args.transport)?;
    let shape = Shape::of(args);
    let (tokens, (a, b), (pp, dp)) = (
        shape.tokens,
        (shape.prefill_dcp, shape.dcp),
        (shape.prefill_page, shape.page),
    );

    let boot = BootstrapServer::bind(BootstrapConfig::default())
        .await
        .map_err(|e| e.to_string())?;
    let addr = boot.bootstrap_addr();
    // Prefill pages in allocation order; decode pages reversed, so a row that lands on the
    // wrong page does not verify.
    let ppages = tokens.div_ceil(pp * u64::from(a));
    let dpages = tokens.div_ceil(dp * u64::from(b));
    let mut prefills = start_prefills(args, make, &addr, tokens, ppages).await?;
    let decodes = start_decodes(args, make, &mut prefills, dpages).await?;
    let blocks = large_blocks(&shape);
    let bytes: u64 = tokens * LAYERS as u64 * TOKEN_BYTES;
    debug_assert_eq!(blocks.iter().map(|k| k.len).sum::<u64>(), bytes);

    // Untimed warm-up (first mappings, registrations) and verification of the coordinator.
    let mut room = 100u64;
    let verified = verified_run(&prefills, &decodes, &addr, room, tokens).await?;
    let mut plain = PlainCopy::new(bytes);
    plain.run();
    memcpy_run(&prefills, &decodes, &blocks)?;
    transport_run(&prefills, &decodes, &blocks).await?;
    let direct = direct_baseline(args, &prefills, &decodes, tokens)?;
    let rows = strided_baseline(args, &prefills, &decodes, tokens)?;

    let metrics =
        |ps: &[Prefill]| -> Vec<MetricsSnapshot> { ps.iter().map(|p| p.agent.metrics()).collect() };
    let before = metrics(&prefills);
    let e2e = E2e {
        prefills: &prefills,
        decodes: &decodes,
        blocks: &blocks,
        addr: &addr,
        tokens,
    };
    let times = timed_runs(
        args,
        &e2e,
        &mut plain,
        direct.as_ref(),
        rows.as_ref(),
        &mut room,
    )
    .await?;
    let after = metrics(&prefills);
    let per_request = |f: fn(&MetricsSnapshot) -> u64| -> u64 {
        after
            .iter()
            .zip(&before)
            .map(|(x, y)| f(x) - f(y))
            .sum::<u64>()
            / u64::from(args.runs)
    };
    drop(plain);
    let direct_descriptors = direct.as_ref().map(super::nixl::DirectE2e::descriptors);
    let planned = rows.as_ref().map(PlannedRows::counts);
    // The raw agents go before the transports whose peers they are.
    drop(direct);
    drop(rows);
    shutdown(&prefills, &decodes).await;
    boot.shutdown();
    let posted = Posted {
        descriptors: per_request(|m| m.descriptors_posted),
        rows: per_request(|m| m.rows_posted),
        pack_batches: per_request(|m| m.pack_batches),
        pack_bytes: per_request(|m| m.pack_bytes),
    };
    let geometry = format!(
        "MLA {LAYERS} layers x {TOKEN_BYTES} B, {tokens} tokens, prefill DCP {} page {} -> \
         decode DCP {} page {}",
        shape.prefill_dcp, shape.prefill_page, shape.dcp, shape.page
    );
    Ok(Report::new(
        args,
        geometry,
        bytes,
        &times,
        &posted,
        planned,
        direct_descriptors,
    )
    .blocks(blocks.len() as u64, verified))
}

/// What the coordinator posted per request (its metrics over the timed runs).
struct Posted {
    descriptors: u64,
    rows: u64,
    pack_batches: u64,
    pack_bytes: u64,
}

impl Report {
    fn new(
        args: &BenchArgs,
        geometry: String,
        bytes: u64,
        t: &Medians,
        posted: &Posted,
        planned: Option<(u64, u64)>,
        direct_descriptors: Option<u64>,
    ) -> Self {
        let gbps = |d: Duration| bytes as f64 / 1e9 / d.as_secs_f64().max(1e-9);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let c = t.coordinator.as_secs_f64().max(1e-9);
        let ratio = |d: Duration| d.as_secs_f64() / c;
        Self {
            bench: "e2e",
            transport: args.transport.name(),
            geometry,
            pack: args.pack,
            bytes,
            runs: args.runs,
            coordinator_gbps: gbps(t.coordinator),
            plain_gbps: gbps(t.plain),
            memcpy_gbps: gbps(t.memcpy),
            transport_gbps: gbps(t.transport),
            plain_ratio: ratio(t.plain),
            memcpy_ratio: ratio(t.memcpy),
            transport_ratio: ratio(t.transport),
            strided_gbps: t.strided.map(|(l, _)| gbps(l)),
            strided_ms: t.strided.map(|(l, _)| ms(l)),
            strided_ratio: t.strided.map(|(l, _)| ratio(l)),
            row_memcpy_gbps: t.strided.map(|(_, r)| gbps(r)),
            row_memcpy_ms: t.strided.map(|(_, r)| ms(r)),
            row_memcpy_ratio: t.strided.map(|(_, r)| ratio(r)),
            planned_descriptors: planned.map(|(d, _)| d),
            planned_rows: planned.map(|(_, r)| r),
            direct_gbps: t.direct.map(gbps),
            direct_ms: t.direct.map(ms),
            direct_descriptors,
            nixl_lists: super::nixl::lists_for(args.transport, &t.lists, args.runs),
            direct_ratio: t.direct.map(ratio),
            coordinator_ms: ms(t.coordinator),
            plain_ms: ms(t.plain),
            memcpy_ms: ms(t.memcpy),
            transport_ms: ms(t.transport),
            descriptors: posted.descriptors,
            rows: posted.rows,
            pack_batches: posted.pack_batches,
            pack_bytes: posted.pack_bytes,
            baseline_blocks: 0,
            verified: false,
        }
    }

    /// With the baselines' block count and the verification's outcome.
    fn blocks(mut self, baseline_blocks: u64, verified: bool) -> Self {
        self.baseline_blocks = baseline_blocks;
        self.verified = verified;
        self
    }
}

/// The strided baselines for `--transport shm` (the planner's ops, planned once, warmed up by
/// one untimed run each); none for the other transports, whose copies are not this process's.
fn strided_baseline(
    args: &BenchArgs,
    prefills: &[Prefill],
    decodes: &[Decode],
    tokens: u64,
) -> Result<Option<PlannedRows>, String> {
    if !matches!(args.transport, TransportKind::Shm) {
        return Ok(None);
    }
    let src: Vec<Rank<'_>> = prefills
        .iter()
        .map(|p| Rank {
            desc: &p.desc,
            mem: &p.mem,
            table: &p.table,
        })
        .collect();
    let dst: Vec<Rank<'_>> = decodes
        .iter()
        .map(|d| Rank {
            desc: &d.desc,
            mem: &d.mem,
            table: &d.table,
        })
        .collect();
    let rows = PlannedRows::new(&src, &dst, tokens, CHUNK_TOKENS)?;
    rows.limit_run()?;
    rows.memcpy_rows_run()?;
    Ok(Some(rows))
}

/// The direct-NIXL baseline for `--transport nixl`, warmed up by one untimed run; none for the
/// other transports.
fn direct_baseline(
    args: &BenchArgs,
    prefills: &[Prefill],
    decodes: &[Decode],
    tokens: u64,
) -> Result<Option<super::nixl::DirectE2e>, String> {
    if !matches!(args.transport, TransportKind::Nixl) {
        return Ok(None);
    }
    let direct = start_direct(prefills, decodes, tokens)?;
    direct.run()?;
    Ok(Some(direct))
}

/// The direct-NIXL baseline's writers, loaded with [`direct_ops`] for this request.
fn start_direct(
    prefills: &[Prefill],
    decodes: &[Decode],
    tokens: u64,
) -> Result<super::nixl::DirectE2e, String> {
    let layouts = |ranks: &mut dyn Iterator<Item = (&PeerDescriptor, &Vec<u64>, &KvMemory)>| {
        ranks
            .map(|(d, table, mem)| {
                TokenLayout::for_rank(d, table.clone()).map(|l| (l, mem.kv.clone()))
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let src = layouts(&mut prefills.iter().map(|p| (&p.desc, &p.table, &p.mem.memory)))?;
    let dst = layouts(&mut decodes.iter().map(|d| (&d.desc, &d.table, &d.mem.memory)))?;
    let ops = direct_ops(&src, &dst, tokens)?;
    let peers: Vec<Vec<u8>> = decodes
        .iter()
        .map(|d| d.transport.local_descriptor().to_vec())
        .collect();
    let srcs: Vec<Vec<_>> = prefills.iter().map(|p| p.mem.kv_regions.clone()).collect();
    super::nixl::DirectE2e::start(&srcs, &peers, ops)
}

/// The request's rows as NIXL descriptors, `[prefill rank][decode rank]`: each position's row,
/// from the prefill rank that holds it to the decode rank that holds it, layer by layer; a row
/// that continues the previous one on both sides extends it. Ranks are given as their layout
/// and KV entries (the source index of a descriptor is its layer: one region per entry).
fn direct_ops(
    src: &[(TokenLayout, Vec<EntryRegion>)],
    dst: &[(TokenLayout, Vec<EntryRegion>)],
    tokens: u64,
) -> Result<Vec<Vec<Vec<DirectOp>>>, String> {
    let mut ops: Vec<Vec<Vec<DirectOp>>> = vec![vec![Vec::new(); dst.len()]; src.len()];
    for layer in 0..LAYERS {
        for pos in 0..tokens {
            let owner = |ranks: &[(TokenLayout, Vec<EntryRegion>)]| {
                ranks.iter().enumerate().find_map(|(i, (l, kv))| {
                    let row = l.row_of(pos)?;
                    Some((
                        i,
                        kv[layer].region,
                        kv[layer].offset + row * l.token_bytes[layer],
                    ))
                })
            };
            let (Some((p, _, src_offset)), Some((q, region, dst_offset))) =
                (owner(src), owner(dst))
            else {
                return Err(format!("internal: position {pos} has no owner"));
            };
            let op = DirectOp {
                src: layer,
                src_offset,
                region: region.0,
                dst_offset,
                len: TOKEN_BYTES,
            };
            let list = &mut ops[p][q];
            match list.last_mut() {
                Some(last)
                    if last.src == op.src
                        && last.region == op.region
                        && last.src_offset + last.len == op.src_offset
                        && last.dst_offset + last.len == op.dst_offset =>
                {
                    last.len += op.len;
                }
                _ => list.push(op),
            }
        }
    }
    Ok(ops)
}

/// The request's bytes as large blocks, layer by layer: the rows each prefill rank holds are
/// back to back in its entry (pages in allocation order), and the rows each decode rank holds
/// fill the start of its entry; the prefill ranks' rows, one rank after the other, are cut
/// where a decode rank's rows end.
fn large_blocks(s: &Shape) -> Vec<Block> {
    let src: Vec<u64> = (0..s.prefill_dcp)
        .map(|r| owned(s.tokens, s.prefill_dcp, r) * TOKEN_BYTES)
        .collect();
    let dst: Vec<u64> = (0..s.dcp)
        .map(|r| owned(s.tokens, s.dcp, r) * TOKEN_BYTES)
        .collect();
    let mut out = Vec::new();
    for layer in 0..LAYERS {
        let (mut p, mut q, mut at_p, mut at_q) = (0, 0, 0, 0);
        while p < src.len() && q < dst.len() {
            let len = (src[p] - at_p).min(dst[q] - at_q);
            if len > 0 {
                out.push(Block {
                    p,
                    q,
                    layer,
                    src: at_p,
                    dst: at_q,
                    len,
                });
            }
            at_p += len;
            at_q += len;
            if at_p == src[p] {
                (p, at_p) = (p + 1, 0);
            }
            if at_q == dst[q] {
                (q, at_q) = (q + 1, 0);
            }
        }
    }
    out
}

/// The plain-copy baseline: two buffers of ordinary memory as large as the request, written
/// once before the first run so no page fault is timed.
struct PlainCopy {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl PlainCopy {
    fn new(bytes: u64) -> Self {
        let n = usize::try_from(bytes).unwrap_or(usize::MAX);
        Self {
            src: vec![1; n],
            dst: vec![2; n],
        }
    }

    /// One `memcpy` of every byte.
    fn run(&mut self) -> Duration {
        let t0 = Instant::now();
        self.dst.copy_from_slice(&self.src);
        let took = t0.elapsed();
        std::hint::black_box(&self.dst);
        took
    }
}

/// The memcpy baseline: the blocks copied in this process, one after the other.
fn memcpy_run(
    prefills: &[Prefill],
    decodes: &[Decode],
    blocks: &[Block],
) -> Result<Duration, String> {
    let src: Vec<_> = prefills.iter().map(|p| kv_views(&p.mem)).collect();
    let dst: Vec<_> = decodes.iter().map(|d| kv_views(&d.mem)).collect();
    let t0 = Instant::now();
    for k in blocks {
        let (s, d) = (&src[k.p][k.layer], &dst[k.q][k.layer]);
        s.region
            .copy_to(s.offset + k.src, &d.region, d.offset + k.dst, k.len)
            .map_err(|e| format!("memcpy baseline: {e}"))?;
    }
    Ok(t0.elapsed())
}

/// The transport baseline: the blocks as one batch per (prefill rank, decode rank), posted
/// through the prefill transports; timed until every batch is done.
async fn transport_run(
    prefills: &[Prefill],
    decodes: &[Decode],
    blocks: &[Block],
) -> Result<Duration, String> {
    // Built before the clock starts.
    let mut batches: Vec<Vec<TransferOp>> = vec![Vec::new(); prefills.len() * decodes.len()];
    for k in blocks {
        let (s, d) = (
            prefills[k.p].mem.memory.kv[k.layer],
            decodes[k.q].mem.memory.kv[k.layer],
        );
        batches[k.p * decodes.len() + k.q].push(TransferOp::new(
            s.region,
            s.offset + k.src,
            d.region,
            d.offset + k.dst,
            k.len,
        ));
    }
    let t0 = Instant::now();
    let mut ids = Vec::with_capacity(batches.len());
    for (i, ops) in batches.into_iter().enumerate() {
        if ops.is_empty() {
            continue;
        }
        let p = &prefills[i / decodes.len()];
        let peer = p.peers[i % decodes.len()];
        ids.push((
            p,
            p.transport
                .post(peer, TransferBatch::write(ops))
                .await
                .map_err(|e| format!("transport baseline: {e}"))?,
        ));
    }
    for (p, id) in ids {
        p.transport
            .wait(id)
            .await
            .map_err(|e| format!("transport baseline: {e}"))?;
    }
    Ok(t0.elapsed())
}

async fn coordinator_run(
    prefills: &[Prefill],
    decodes: &[Decode],
    addr: &str,
    room: u64,
    tokens: u64,
) -> Result<Duration, String> {
    let e = |e: kvbridge_coordinator::CoordinatorError| e.to_string();
    let t0 = Instant::now();
    for p in prefills {
        p.agent.create_room(room).map_err(e)?;
    }
    for d in decodes {
        d.agent
            .receive(
                room,
                ReceiveRequest {
                    bootstrap_addr: addr.to_owned(),
                    page_table: d.table.clone(),
                    cached_prefix_len: 0,
                    aux_index: 0,
                },
            )
            .map_err(e)?;
    }
    let mut senders = tokio::task::JoinSet::new();
    for p in prefills {
        let (agent, table) = (p.agent.clone(), p.table.clone());
        let v = p.desc.page_size * u64::from(p.desc.dcp_size);
        senders.spawn(async move {
            let prefix = agent.wait_ready(room).await?;
            let plan = kvbridge_geometry::chunk_plan(prefix, tokens, v, (CHUNK_TOKENS / v).max(1));
            let n = plan.len();
            for (k, (pages, ntok)) in plan.into_iter().enumerate() {
                let ids: Vec<u64> = pages.map(|j| table[j as usize]).collect();
                let chunk = if k + 1 == n {
                    Chunk::last(ids, ntok, None)
                } else {
                    Chunk::new(ids, ntok)
                };
                agent.send_chunk(room, chunk).await?;
            }
            agent.wait(room).await
        });
    }
    while let Some(done) = senders.join_next().await {
        done.map_err(|x| format!("a prefill sender task died: {x}"))?
            .map_err(e)?;
    }
    for d in decodes {
        d.agent.wait(room).await.map_err(e)?;
    }
    let took = t0.elapsed();
    for p in prefills {
        p.agent.clear(room);
    }
    for d in decodes {
        d.agent.clear(room);
    }
    Ok(took)
}

/// The strided baselines' lines (`--transport shm`), and a warning if their rows are not the
/// coordinator's.
fn print_strided(r: &Report) {
    if let (Some(gbps), Some(ms), Some(n)) = (r.strided_gbps, r.strided_ms, r.planned_descriptors) {
        println!(
            "  strided      {gbps:>6.2} GB/s  {ms:>8.1} ms per request  the limit: the planner's \
             {n} ops copied in this process, one thread, streaming stores"
        );
    }
    if let (Some(gbps), Some(ms), Some(n)) = (r.row_memcpy_gbps, r.row_memcpy_ms, r.planned_rows) {
        println!(
            "  row memcpy   {gbps:>6.2} GB/s  {ms:>8.1} ms per request  the same {n} rows, one \
             memcpy each"
        );
    }
    let planned = r.planned_descriptors.zip(r.planned_rows);
    if let Some((d, n)) = planned.filter(|&p| !r.pack && p != (r.descriptors, r.rows)) {
        println!(
            "  WARNING      the strided baselines copy {d} ops of {n} rows, the coordinator \
             posted {} of {}: not the same rows",
            r.descriptors, r.rows
        );
    }
}

/// The ratio the run's target applies to, what it is against, and the target: shm against
/// the strided limit (the plain copy where there is none), TCP and NIXL against their own
/// large blocks (NIXL also against the same rows posted through nixl-sys directly, printed
/// apart).
fn target_of(args: &BenchArgs, r: &Report) -> (f64, &'static str, f64) {
    let demo_pair = (
        args.prefill_dcp,
        args.prefill_page_size,
        args.dcp,
        args.page_size,
    ) == (1, 64, 4, 64);
    let limit_pair = demo_pair
        || (
            args.prefill_dcp,
            args.prefill_page_size,
            args.dcp,
            args.page_size,
        ) == (4, 64, 1, 64);
    match (args.transport, r.strided_ratio) {
        (TransportKind::Shm, Some(strided)) if limit_pair => {
            (strided, "the strided limit", STRIDED_TARGET)
        }
        (TransportKind::Shm, Some(strided)) => (strided, "the strided limit", OTHER_PAIR_TARGET),
        (TransportKind::Shm, None) => (r.plain_ratio, "the plain copy", TARGET),
        (TransportKind::Tcp, _) => (
            r.transport_ratio,
            "the transport's large blocks",
            if demo_pair {
                TCP_TARGET
            } else {
                OTHER_PAIR_TARGET
            },
        ),
        (TransportKind::Nixl, _) => (
            r.transport_ratio,
            "the transport's large blocks",
            if demo_pair { TARGET } else { OTHER_PAIR_TARGET },
        ),
    }
}

fn print(args: &BenchArgs, r: &Report) {
    if args.json {
        println!("{}", serde_json::to_string(r).unwrap_or_default());
        return;
    }
    let kind = match args.transport {
        TransportKind::Shm => "shared-memory",
        TransportKind::Tcp => "TCP",
        TransportKind::Nixl => "NIXL (UCX)",
    };
    println!(
        "kvbridge-lab bench --e2e: {}; {:.1} MB per request; {kind} transport; median of {} runs",
        r.geometry,
        r.bytes as f64 / 1e6,
        r.runs
    );
    let path = if r.pack {
        format!(
            "pack path: {} batches gathered {:.1} MB",
            r.pack_batches,
            r.pack_bytes as f64 / 1e6
        )
    } else {
        "strided ops".to_owned()
    };
    println!(
        "  coordinator  {:>6.2} GB/s  {:>8.1} ms per request  {} descriptors covering {} rows \
         ({path})",
        r.coordinator_gbps, r.coordinator_ms, r.descriptors, r.rows
    );
    println!(
        "  plain copy   {:>6.2} GB/s  {:>8.1} ms per request  one memcpy of the same bytes in \
         ordinary memory",
        r.plain_gbps, r.plain_ms
    );
    println!(
        "  memcpy       {:>6.2} GB/s  {:>8.1} ms per request  {} large blocks copied in this \
         process",
        r.memcpy_gbps, r.memcpy_ms, r.baseline_blocks
    );
    println!(
        "  transport    {:>6.2} GB/s  {:>8.1} ms per request  the same {} blocks through the \
         {kind} transport",
        r.transport_gbps, r.transport_ms, r.baseline_blocks
    );
    print_lists(r);
    print_strided(r);
    if let (Some(gbps), Some(ms), Some(n)) = (r.direct_gbps, r.direct_ms, r.direct_descriptors) {
        println!(
            "  direct NIXL  {gbps:>6.2} GB/s  {ms:>8.1} ms per request  the same rows as {n} NIXL \
             descriptors through nixl-sys, no kvbridge"
        );
    }
    let (ratio, against, target) = target_of(args, r);
    let below = |ratio: f64, target: f64| {
        if ratio >= target {
            ""
        } else {
            "  BELOW TARGET"
        }
    };
    println!(
        "  ratio        {ratio:.2}x of {against} (target >= {target:.2}x){}; {:.2}x of the plain \
         copy, {:.2}x of memcpy, {:.2}x of the transport{}",
        below(ratio, target),
        r.plain_ratio,
        r.memcpy_ratio,
        r.transport_ratio,
        r.row_memcpy_ratio
            .map(|x| format!(", {x:.2}x of the per-row memcpy"))
            .unwrap_or_default()
    );
    if let Some(direct) = r.direct_ratio {
        println!(
            "  direct       {direct:.2}x of direct NIXL (target >= {DIRECT_TARGET:.2}x){}",
            below(direct, DIRECT_TARGET)
        );
    }
    println!(
        "  verified     {}",
        if r.verified {
            "the coordinator path: every decode byte where the owner rule puts it"
        } else {
            "NO: the coordinator left a wrong byte (see above)"
        }
    );
}

/// `--transport nixl`: what the coordinator's batches handed to NIXL per request.
fn print_lists(r: &Report) {
    if let Some(lists) = &r.nixl_lists {
        println!("  NIXL lists   {lists}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranks of one role: their layouts (`table(rank)` as page table) and KV entries, each
    /// entry a region of its own (ids `base + rank * LAYERS + layer`).
    fn ranks(
        role: Role,
        dcp: u32,
        page: u64,
        pages: u64,
        base: u64,
        table: impl Fn(u64) -> Vec<u64>,
    ) -> Vec<(TokenLayout, Vec<EntryRegion>)> {
        (0..dcp)
            .map(|r| {
                let d = desc(role, page, dcp, r, dcp).unwrap();
                let kv = (0..LAYERS as u64)
                    .map(|l| {
                        let id = base + u64::from(r) * LAYERS as u64 + l;
                        EntryRegion::whole(
                            kvbridge_transport::RegionId(id),
                            pages * page * TOKEN_BYTES,
                        )
                    })
                    .collect();
                (TokenLayout::for_rank(&d, table(pages)).unwrap(), kv)
            })
            .collect()
    }

    #[test]
    fn direct_ops_move_each_row_once_to_its_owner_and_merge_only_contiguous_runs() {
        let tokens = 512;
        let forward = |n: u64| (0..n).collect::<Vec<_>>();
        let reversed = |n: u64| (0..n).rev().collect::<Vec<_>>();
        // DCP 1 -> 4: a decode rank's rows are every 4th source row, so no two merge.
        let src = ranks(Role::Prefill, 1, 64, 8, 0, forward);
        let dst = ranks(Role::Decode, 4, 64, 2, 1000, reversed);
        let ops = direct_ops(&src, &dst, tokens).unwrap();
        let all: Vec<&DirectOp> = ops.iter().flatten().flatten().collect();
        assert_eq!(all.len() as u64, tokens * LAYERS as u64);
        let mut seen = std::collections::HashSet::new();
        for (q, list) in ops[0].iter().enumerate() {
            for op in list {
                assert_eq!(op.len, TOKEN_BYTES);
                assert_eq!(op.region, 1000 + q as u64 * LAYERS as u64 + op.src as u64);
                // The source row's position is owned by decode rank q, and lands on its row.
                let pos = op.src_offset / TOKEN_BYTES;
                assert_eq!(pos % 4, q as u64);
                let row = dst[q].0.row_of(pos).unwrap();
                assert_eq!(op.dst_offset, row * TOKEN_BYTES);
                assert!(
                    seen.insert((op.region, op.dst_offset)),
                    "{op:?} written twice"
                );
            }
        }
        // DCP 1 -> 1, both tables in order: one descriptor per layer; decode pages reversed:
        // one per page and layer.
        let src = ranks(Role::Prefill, 1, 64, 8, 0, forward);
        let same = ranks(Role::Decode, 1, 64, 8, 1000, forward);
        let ops = direct_ops(&src, &same, tokens).unwrap();
        assert_eq!(ops[0][0].len(), LAYERS);
        assert!(ops[0][0].iter().all(|o| o.len == tokens * TOKEN_BYTES));
        let rev = ranks(Role::Decode, 1, 64, 8, 1000, reversed);
        let ops = direct_ops(&src, &rev, tokens).unwrap();
        assert_eq!(ops[0][0].len(), 8 * LAYERS);
        assert!(ops[0][0].iter().all(|o| o.len == 64 * TOKEN_BYTES));
    }

    #[test]
    fn large_blocks_cover_every_byte_once_and_cut_where_ranks_end() {
        let s = Shape {
            tokens: 1000,
            prefill_dcp: 2,
            dcp: 4,
            prefill_page: 16,
            page: 64,
        };
        let blocks = large_blocks(&s);
        assert_eq!(
            blocks.iter().map(|k| k.len).sum::<u64>(),
            1000 * LAYERS as u64 * TOKEN_BYTES
        );
        // Per layer: prefill ranks hold 500 rows each, decode ranks 250: four blocks.
        assert_eq!(blocks.len(), 4 * LAYERS);
        assert!(blocks.iter().all(|k| k.len == 250 * TOKEN_BYTES));
        let s = Shape {
            tokens: 10,
            prefill_dcp: 4,
            dcp: 1,
            prefill_page: 1,
            page: 1,
        };
        // Prefill ranks hold 3, 3, 2, 2 rows; the one decode rank takes them back to back.
        let layer0: Vec<(usize, u64, u64)> = large_blocks(&s)
            .into_iter()
            .filter(|k| k.layer == 0)
            .map(|k| (k.p, k.dst / TOKEN_BYTES, k.len / TOKEN_BYTES))
            .collect();
        assert_eq!(layer0, [(0, 0, 3), (1, 3, 3), (2, 6, 2), (3, 8, 2)]);
    }
}
