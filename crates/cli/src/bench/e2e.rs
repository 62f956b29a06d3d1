//! `kvbridge bench --e2e`: the whole prefill -> decode path (agents, TCP control channels,
//! HTTP bootstrap, planner, transport) against the raw transport moving the same bytes with
//! the same descriptors, in the same run.
//!
//! Geometry: the demo's default, MLA with 61 layers of 1152 bytes per token, page size 64,
//! one request of 8192 tokens (575.7 MB; `--size-scale` shrinks the tokens), prefill DCP 1 ->
//! decode DCP 4. Every agent runs in this process, each with its own transport instance
//! (`--transport shm|tcp`), so both paths pay the same copies and only the coordination
//! differs. Timed runs alternate (raw, coordinator, raw, ...); medians are reported.
//!
//! - **Coordinator run**: create the room, the four decode ranks receive it (their metadata
//!   travels over the control channel), the prefill sends two chunks of 4096 tokens and waits
//!   for Success; timed until every decode rank saw Success.
//! - **Raw run**: the same rows as transport descriptors (one per token row per layer, merged
//!   where source and destination are both contiguous, as the planner does), the same two
//!   chunks, posted straight to the four decode transports; timed until every batch is done.
//!
//! Both paths are verified once, untimed: the decode pools are zeroed, one run of the path
//! moves the request, and every row of every decode rank is checked against the owner rule.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbridge_coordinator::bootstrap::{
    BootstrapClient, BootstrapConfig, BootstrapServer, HttpDirectory, RankRegistration,
};
use kvbridge_coordinator::net_channel::{NetChannel, NetChannelConfig};
use kvbridge_coordinator::testing::{TokenLayout, chunk_plan, fill_rows, verify_rows};
use kvbridge_coordinator::{
    AllocatedMemory, Chunk, DecodeAgent, KvMemory, PrefillAgent, ReceiveRequest,
};
use kvbridge_handshake::{PeerDescriptor, Role};
use kvbridge_transport::{KvTransport, PeerId, TransferBatch, TransferOp};

use super::{BenchArgs, TransportKind, factory};

const LAYERS: usize = 61;
const TOKEN_BYTES: u64 = 1152;
const PAGE: u64 = 64;
const DCP: u32 = 4;
const CHUNK_TOKENS: u64 = 4096;
/// The pattern's request id (the same bytes whichever room moves them).
const PATTERN_ROOM: u64 = 1;

fn desc(role: Role, tp: u32, rank: u32, dcp: u32) -> Result<PeerDescriptor, String> {
    PeerDescriptor::mla(role, PAGE, LAYERS, TOKEN_BYTES)
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
    bytes: u64,
    runs: u32,
    coordinator_gbps: f64,
    raw_gbps: f64,
    ratio: f64,
    coordinator_ms: f64,
    raw_ms: f64,
    coordinator_descriptors: u64,
    raw_descriptors: u64,
    verified: bool,
}

struct Decode {
    agent: DecodeAgent,
    desc: PeerDescriptor,
    mem: AllocatedMemory,
    table: Vec<u64>,
    peer: PeerId,
}

pub(super) fn run(args: &BenchArgs) -> ExitCode {
    if !(args.size_scale > 0.0 && args.size_scale <= 1.0) {
        eprintln!(
            "kvbridge bench --e2e: --size-scale must be in (0, 1], got {}",
            args.size_scale
        );
        return ExitCode::from(2);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvbridge bench --e2e: could not start the async runtime: {e}");
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
            eprintln!("kvbridge bench --e2e: {e}");
            ExitCode::from(1)
        }
    }
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

async fn bench(args: &BenchArgs) -> Result<Report, String> {
    let make = factory(args.transport)?;
    let tokens = ((8192.0 * args.size_scale) as u64).max(PAGE);
    let e = |e: kvbridge_coordinator::CoordinatorError| e.to_string();

    let boot = BootstrapServer::bind(BootstrapConfig::default())
        .await
        .map_err(e)?;
    let addr = boot.bootstrap_addr();
    let pd = desc(Role::Prefill, 1, 0, 1)?;
    let pt = make().await?;
    let ppages = tokens.div_ceil(PAGE);
    let pmem = KvMemory::allocate(&*pt, &pd, ppages, 0).await.map_err(e)?;
    let ptable: Vec<u64> = (0..ppages).rev().collect();
    let playout = TokenLayout::for_rank(&pd, ptable.clone())?;
    fill_rows(&pmem.kv_views(), &playout, PATTERN_ROOM, 0..tokens)?;
    let prefill = PrefillAgent::builder(
        pd.clone(),
        pmem.memory.clone(),
        pt.clone(),
        Arc::new(
            NetChannel::bind(NetChannelConfig::default())
                .await
                .map_err(e)?,
        ),
    )
    .start()
    .map_err(e)?;
    BootstrapClient::new(&addr)
        .register(&RankRegistration::from(prefill.rank_info()))
        .await
        .map_err(e)?;

    let dpages = tokens.div_ceil(PAGE * u64::from(DCP));
    let mut decodes = Vec::new();
    for r in 0..DCP {
        let dd = desc(Role::Decode, DCP, r, DCP)?;
        let dt = make().await?;
        let dmem = KvMemory::allocate(&*dt, &dd, dpages, 0).await.map_err(e)?;
        let agent = DecodeAgent::builder(
            dd.clone(),
            dmem.memory.clone(),
            dt.clone(),
            Arc::new(
                NetChannel::bind(NetChannelConfig::default())
                    .await
                    .map_err(e)?,
            ),
            Arc::new(HttpDirectory::new()),
        )
        .start()
        .map_err(e)?;
        let peer = pt
            .connect(&dt.local_descriptor())
            .await
            .map_err(|err| format!("raw path: connecting to decode rank {r}: {err}"))?;
        decodes.push(Decode {
            agent,
            desc: dd,
            mem: dmem,
            table: (0..dpages).map(|i| dpages - 1 - i).collect(),
            peer,
        });
    }
    let raw_batches = raw_plan(&pmem, &ptable, &decodes, tokens);
    let raw_descriptors: u64 = raw_batches.iter().map(|(_, ops)| ops.len() as u64).sum();
    let bytes: u64 = tokens * LAYERS as u64 * TOKEN_BYTES;

    let mut room = 100u64;
    // Untimed warm-up (first mappings, registrations) and verification of both paths.
    let mut verified = true;
    for coordinated in [true, false] {
        for d in &decodes {
            for v in d.mem.kv_views() {
                v.region
                    .fill(v.offset, v.len, 0)
                    .map_err(|x| x.to_string())?;
            }
        }
        if coordinated {
            room += 1;
            coordinator_run(&prefill, &decodes, &addr, room, &ptable, tokens).await?;
        } else {
            raw_run(&*pt, &decodes, &raw_batches).await?;
        }
        let mut got = 0;
        for d in &decodes {
            let layout = TokenLayout::for_rank(&d.desc, d.table.clone())?;
            match verify_rows(&d.mem.kv_views(), &layout, PATTERN_ROOM, 0..tokens) {
                Ok(b) => got += b,
                Err(err) => {
                    eprintln!(
                        "kvbridge bench --e2e: the {} path left a wrong byte on decode rank {}: {err}",
                        if coordinated { "coordinator" } else { "raw" },
                        d.desc.attn_tp_rank
                    );
                    verified = false;
                }
            }
        }
        verified &= got == bytes;
    }

    let before = prefill.metrics().descriptors_posted;
    let mut coord = Vec::new();
    let mut raw = Vec::new();
    for _ in 0..args.runs {
        raw.push(raw_run(&*pt, &decodes, &raw_batches).await?);
        room += 1;
        coord.push(coordinator_run(&prefill, &decodes, &addr, room, &ptable, tokens).await?);
    }
    let coordinator_descriptors =
        (prefill.metrics().descriptors_posted - before) / u64::from(args.runs);
    let (c, r) = (median(&mut coord), median(&mut raw));
    let gbps = |d: Duration| bytes as f64 / 1e9 / d.as_secs_f64().max(1e-9);
    prefill.shutdown();
    for d in &decodes {
        d.agent.shutdown();
    }
    let _ = pt.shutdown().await;
    Ok(Report {
        bench: "e2e",
        transport: args.transport.name(),
        geometry: format!(
            "MLA {LAYERS} layers x {TOKEN_BYTES} B, {tokens} tokens, page {PAGE}, prefill DCP 1 \
             -> decode DCP {DCP}"
        ),
        bytes,
        runs: args.runs,
        coordinator_gbps: gbps(c),
        raw_gbps: gbps(r),
        ratio: r.as_secs_f64() / c.as_secs_f64().max(1e-9),
        coordinator_ms: c.as_secs_f64() * 1e3,
        raw_ms: r.as_secs_f64() * 1e3,
        coordinator_descriptors,
        raw_descriptors,
        verified,
    })
}

/// The request's rows as transport descriptors, per chunk and decode rank: `(decode index,
/// ops)`. Token `p` of layer `e` goes from prefill row `p` to decode rank `p mod 4`, local row
/// `p div 4`; runs contiguous on both sides are merged.
fn raw_plan(
    pmem: &AllocatedMemory,
    ptable: &[u64],
    decodes: &[Decode],
    tokens: u64,
) -> Vec<(usize, Vec<TransferOp>)> {
    let d = u64::from(DCP);
    let item = PAGE * TOKEN_BYTES;
    let mut out = Vec::new();
    for (pages, _) in chunk_plan(0, tokens, PAGE, CHUNK_TOKENS / PAGE) {
        let (lo, hi) = (pages.start * PAGE, (pages.end * PAGE).min(tokens));
        for (k, dec) in decodes.iter().enumerate() {
            let mut ops: Vec<TransferOp> = Vec::new();
            for e in 0..LAYERS {
                let src = pmem.memory.kv[e];
                let dst = dec.mem.memory.kv[e];
                for p in (lo..hi).filter(|p| p % d == k as u64) {
                    let s =
                        src.offset + ptable[(p / PAGE) as usize] * item + (p % PAGE) * TOKEN_BYTES;
                    let l = p / d;
                    let t = dst.offset
                        + dec.table[(l / PAGE) as usize] * item
                        + (l % PAGE) * TOKEN_BYTES;
                    match ops.last_mut() {
                        Some(o)
                            if o.local_region == src.region
                                && o.remote_region == dst.region
                                && o.local_offset + o.len == s
                                && o.remote_offset + o.len == t =>
                        {
                            o.len += TOKEN_BYTES;
                        }
                        _ => ops.push(TransferOp::new(src.region, s, dst.region, t, TOKEN_BYTES)),
                    }
                }
            }
            out.push((k, ops));
        }
    }
    out
}

async fn raw_run(
    pt: &dyn KvTransport,
    decodes: &[Decode],
    batches: &[(usize, Vec<TransferOp>)],
) -> Result<Duration, String> {
    // Built before the clock starts: the raw path gets its descriptors for free.
    let ready: Vec<(PeerId, TransferBatch)> = batches
        .iter()
        .map(|(k, ops)| (decodes[*k].peer, TransferBatch::write(ops.clone())))
        .collect();
    let t0 = Instant::now();
    let mut ids = Vec::with_capacity(ready.len());
    for (peer, batch) in ready {
        ids.push(
            pt.post(peer, batch)
                .await
                .map_err(|e| format!("raw path: {e}"))?,
        );
    }
    for id in ids {
        pt.wait(id).await.map_err(|e| format!("raw path: {e}"))?;
    }
    Ok(t0.elapsed())
}

async fn coordinator_run(
    prefill: &PrefillAgent,
    decodes: &[Decode],
    addr: &str,
    room: u64,
    ptable: &[u64],
    tokens: u64,
) -> Result<Duration, String> {
    let e = |e: kvbridge_coordinator::CoordinatorError| e.to_string();
    let t0 = Instant::now();
    prefill.create_room(room).map_err(e)?;
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
    let prefix = prefill.wait_ready(room).await.map_err(e)?;
    let plan = chunk_plan(prefix, tokens, PAGE, CHUNK_TOKENS / PAGE);
    let n = plan.len();
    for (k, (pages, ntok)) in plan.into_iter().enumerate() {
        let ids: Vec<u64> = pages.map(|j| ptable[j as usize]).collect();
        let chunk = if k + 1 == n {
            Chunk::last(ids, ntok, None)
        } else {
            Chunk::new(ids, ntok)
        };
        prefill.send_chunk(room, chunk).await.map_err(e)?;
    }
    prefill.wait(room).await.map_err(e)?;
    for d in decodes {
        d.agent.wait(room).await.map_err(e)?;
    }
    let took = t0.elapsed();
    prefill.clear(room);
    for d in decodes {
        d.agent.clear(room);
    }
    Ok(took)
}

fn print(args: &BenchArgs, r: &Report) {
    if args.json {
        println!("{}", serde_json::to_string(r).unwrap_or_default());
        return;
    }
    let kind = match args.transport {
        TransportKind::Shm => "shared-memory",
        TransportKind::Tcp => "TCP",
    };
    println!(
        "kvbridge bench --e2e: {}; {:.1} MB per request; {kind} transport; median of {} runs",
        r.geometry,
        r.bytes as f64 / 1e6,
        r.runs
    );
    println!(
        "  coordinator  {:>6.2} GB/s  {:>8.1} ms per request  {:>7} descriptors  (agents, control \
         channel, bootstrap, planner, transport)",
        r.coordinator_gbps, r.coordinator_ms, r.coordinator_descriptors
    );
    println!(
        "  raw          {:>6.2} GB/s  {:>8.1} ms per request  {:>7} descriptors  (the same rows \
         posted straight to the transport)",
        r.raw_gbps, r.raw_ms, r.raw_descriptors
    );
    println!(
        "  ratio        {:.2}x (target >= 0.90x){}",
        r.ratio,
        if r.ratio >= 0.9 { "" } else { "  BELOW TARGET" }
    );
    println!(
        "  verified     {}",
        if r.verified {
            "both paths: every decode byte where the owner rule puts it"
        } else {
            "NO: a path left a wrong byte (see above)"
        }
    );
}
