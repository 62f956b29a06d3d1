//! In-process throughput of the coordinator over `LoopbackTransport`, against the same bytes
//! moved by the raw transport in the same run.
//!
//! `cargo run --release -p kvbridge-coordinator --example throughput -- [tokens] [requests] [dcp]`
//! (defaults: 8192 tokens, 4 requests, DCP 4; MLA, 61 layers, 1152 B per token per layer,
//! page size 64, chunks of 16 pages).

use std::sync::Arc;
use std::time::Instant;

use kvbridge_coordinator::{
    AllocatedMemory, Chunk, DecodeAgent, InProcessControlHub, KvMemory, PrefillAgent,
    ReceiveRequest, StaticDirectory,
};
use kvbridge_handshake::{PeerDescriptor, Role};
use kvbridge_mock::LoopbackTransport;
use kvbridge_testkit::fill::{EntryView, TokenLayout, entry_views, fill_rows, verify_rows};
use kvbridge_transport::{KvTransport, TransferBatch, TransferOp};

const LAYERS: usize = 61;
const TOK: u64 = 1152;
const PAGE: u64 = 64;

/// Views of the KV entries of memory the coordinator allocated, for the fill and verify helpers.
fn kv_views(mem: &AllocatedMemory) -> Vec<EntryView> {
    entry_views(
        &mem.kv_regions,
        mem.memory.kv.iter().map(|e| (e.offset, e.len)),
    )
}

fn desc(role: Role, tp: u32, rank: u32, dcp: u32) -> PeerDescriptor {
    PeerDescriptor::mla(role, PAGE, LAYERS, TOK)
        .attn_tp(tp, rank)
        .dcp(dcp)
        .build()
        .expect("descriptor")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let tokens = args.first().copied().unwrap_or(8192);
    let requests = args.get(1).copied().unwrap_or(4);
    let dcp = args.get(2).copied().unwrap_or(4) as u32;
    let pages = tokens.div_ceil(PAGE);

    let hub = InProcessControlHub::new();
    let dir = StaticDirectory::new();
    let pt: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
    let pd = desc(Role::Prefill, 1, 0, 1);
    let pmem = KvMemory::allocate(&*pt, &pd, pages, 0).await?;
    let prefill = PrefillAgent::builder(
        pd.clone(),
        pmem.memory.clone(),
        pt.clone(),
        Arc::new(hub.channel("p")?),
    )
    .start()?;
    dir.add_rank("addr", prefill.rank_info());
    let table: Vec<u64> = (0..pages).collect();
    // Every room moves the same prompt, filled once: its rows are derived from pattern id 0.
    fill_rows(
        &kv_views(&pmem),
        &TokenLayout::for_rank(&pd, table.clone())?,
        0,
        0..tokens,
    )?;

    let mut decodes = Vec::new();
    for r in 0..dcp {
        let t: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
        let d = desc(Role::Decode, dcp, r, dcp);
        let mem = KvMemory::allocate(&*t, &d, pages.div_ceil(u64::from(dcp)), 0).await?;
        let agent = DecodeAgent::builder(
            d.clone(),
            mem.memory.clone(),
            t,
            Arc::new(hub.channel(format!("d{r}"))?),
            Arc::new(dir.clone()),
        )
        .start()?;
        decodes.push((agent, d, mem));
    }
    let dtable: Vec<u64> = (0..pages.div_ceil(u64::from(dcp))).collect();
    let bytes_per_request = tokens * TOK * LAYERS as u64;

    let started = Instant::now();
    for room in 1..=requests {
        prefill.create_room(room)?;
        for (d, _, _) in &decodes {
            d.receive(
                room,
                ReceiveRequest {
                    bootstrap_addr: "addr".into(),
                    page_table: dtable.clone(),
                    cached_prefix_len: 0,
                    aux_index: 0,
                },
            )?;
        }
        prefill.wait_ready(room).await?;
        let plan = kvbridge_geometry::chunk_plan(0, tokens, PAGE, 16);
        let n = plan.len();
        for (k, (range, t)) in plan.into_iter().enumerate() {
            let ids: Vec<u64> = range.map(|i| table[i as usize]).collect();
            let chunk = if k + 1 == n {
                Chunk::last(ids, t, None)
            } else {
                Chunk::new(ids, t)
            };
            prefill.send_chunk(room, chunk).await?;
        }
        for (d, _, _) in &decodes {
            d.wait(room).await?;
        }
        prefill.wait(room).await?;
        prefill.clear(room);
        for (d, _, _) in &decodes {
            d.clear(room);
        }
    }
    let coord = started.elapsed();
    for (_, d, mem) in &decodes {
        verify_rows(
            &kv_views(mem),
            &TokenLayout::for_rank(d, dtable.clone())?,
            0,
            0..tokens,
        )?;
    }
    let m = prefill.metrics();

    // The same bytes through the raw transport: one contiguous batch per layer per request.
    let rt: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
    let dst = KvMemory::allocate(&*rt, &pd, pages, 0).await?;
    let peer = pt.connect(&rt.local_descriptor()).await?;
    let started = Instant::now();
    for _ in 0..requests {
        let ops: Vec<TransferOp> = pmem
            .memory
            .kv
            .iter()
            .zip(&dst.memory.kv)
            .map(|(s, d)| TransferOp::new(s.region, 0, d.region, 0, tokens * TOK))
            .collect();
        let id = pt.post(peer, TransferBatch::write(ops)).await?;
        pt.wait(id).await?;
    }
    let raw = started.elapsed();

    // The same strided rows (one descriptor per token row, the DCP owner rule) through the raw
    // transport, one batch per decode rank per request: the fair baseline for a relayout.
    let mut targets = Vec::new();
    for _ in 0..if dcp > 1 { dcp } else { 0 } {
        let t: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
        let mem = KvMemory::allocate(&*t, &pd, pages.div_ceil(u64::from(dcp)), 0).await?;
        let peer = pt.connect(&t.local_descriptor()).await?;
        targets.push((t, mem, peer));
    }
    let d = u64::from(dcp);
    let started = Instant::now();
    for _ in 0..requests {
        let mut ids = Vec::new();
        for (r, (_, mem, peer)) in targets.iter().enumerate() {
            let mut ops = Vec::new();
            for (s, dst) in pmem.memory.kv.iter().zip(&mem.memory.kv) {
                for p in (r as u64..tokens).step_by(d as usize) {
                    ops.push(TransferOp::new(
                        s.region,
                        p * TOK,
                        dst.region,
                        (p / d) * TOK,
                        TOK,
                    ));
                }
            }
            ids.push(pt.post(*peer, TransferBatch::write(ops)).await?);
        }
        for id in ids {
            pt.wait(id).await?;
        }
    }
    let strided = started.elapsed();

    let gb = (bytes_per_request * requests) as f64 / 1e9;
    println!(
        "geometry: MLA {LAYERS} layers x {TOK} B/token, page {PAGE}, DCP 1 -> {dcp}, {tokens} tokens x {requests} requests ({:.1} MB each)",
        bytes_per_request as f64 / 1e6
    );
    println!(
        "coordinator: {:.3} s, {:.2} GB/s, {} batches, {} descriptors (verified)",
        coord.as_secs_f64(),
        gb / coord.as_secs_f64(),
        m.batches_posted,
        m.descriptors_posted
    );
    println!(
        "raw transport (contiguous, same bytes): {:.3} s, {:.2} GB/s",
        raw.as_secs_f64(),
        gb / raw.as_secs_f64()
    );
    println!(
        "coordinator / raw (contiguous): {:.2}x",
        raw.as_secs_f64() / coord.as_secs_f64()
    );
    if dcp > 1 {
        println!(
            "raw transport (same strided rows, one batch per decode rank): {:.3} s, {:.2} GB/s",
            strided.as_secs_f64(),
            gb / strided.as_secs_f64()
        );
        println!(
            "coordinator / raw (same rows): {:.2}x",
            strided.as_secs_f64() / coord.as_secs_f64()
        );
    }
    Ok(())
}
