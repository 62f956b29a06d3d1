//! The strided-copy baselines of `kvbridge-lab bench --e2e --transport shm`: the request's
//! rows exactly as the planner cuts them (the same owner rule, the same pages, the same
//! strided ops the coordinator posts), copied in this process on one thread, without the
//! transport's queues, turns, hand-offs and notifications.
//!
//! - **strided limit**: each chunk's ops copied with streaming stores, the decode ranks' ops
//!   of one source range together in source order (`kvbridge_shm::baseline::copy_together`,
//!   what the copy worker's gang turns do at best) where the prefill rank's batches line up,
//!   op by op otherwise: the fastest the shared-memory transport's own copy loop moves these
//!   rows on this machine.
//! - **per-row memcpy**: the same rows, one `memcpy` per row (ordinary stores).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvbridge_coordinator::machines::plan::PeerPlan;
use kvbridge_coordinator::{AllocatedMemory, Chunk, EntryRegion, WireRegion};
use kvbridge_handshake::PeerDescriptor;
use kvbridge_shm::baseline::{OpRows, RowStores, copy_op, copy_together};
use kvbridge_transport::{MemoryRegion, RegionId, TransferOp};

/// One rank of the request, as its agent was started: its descriptor, memory and page table.
pub(super) struct Rank<'a> {
    pub desc: &'a PeerDescriptor,
    pub mem: &'a AllocatedMemory,
    pub table: &'a [u64],
}

/// The planner's ops for one request: `chunks[k][p * decodes + q]` are the ops prefill rank
/// `p` posts to decode rank `q` for its chunk `k`, with every rank's regions by id.
pub(super) struct PlannedRows {
    chunks: Vec<Vec<Vec<TransferOp>>>,
    decodes: usize,
    /// Per prefill rank, its KV regions by id.
    src: Vec<HashMap<RegionId, MemoryRegion>>,
    /// Per decode rank, its KV regions by id.
    dst: Vec<HashMap<RegionId, MemoryRegion>>,
}

fn wire(entries: &[EntryRegion]) -> Vec<WireRegion> {
    entries
        .iter()
        .map(|e| WireRegion {
            region: e.region.0,
            offset: e.offset,
            len: e.len,
        })
        .collect()
}

fn by_id(mem: &AllocatedMemory) -> HashMap<RegionId, MemoryRegion> {
    mem.memory
        .kv
        .iter()
        .zip(&mem.kv_regions)
        .map(|(e, r)| (e.region, r.clone()))
        .collect()
}

/// The plan of every (prefill rank, decode rank) pair, as the prefill builds it when the
/// decode rank registers.
fn pair_plans(prefills: &[Rank<'_>], decodes: &[Rank<'_>]) -> Result<Vec<PeerPlan>, String> {
    let mut plans = Vec::new();
    for p in prefills {
        for d in decodes {
            let path = kvbridge_handshake::check(p.desc, d.desc)
                .into_result()
                .map_err(|e| format!("strided baseline: the pair does not check: {e}"))?
                .path;
            let plan = PeerPlan::new(
                path,
                p.desc,
                &wire(&p.mem.memory.kv),
                &wire(&p.mem.memory.aux),
                d.desc,
                &wire(&d.mem.memory.kv),
                &wire(&d.mem.memory.aux),
            )
            .map_err(|e| format!("strided baseline: planning the pair: {}", e.0))?;
            plans.push(plan);
        }
    }
    Ok(plans)
}

impl PlannedRows {
    /// Plans the request of `tokens` tokens chunk by chunk, as the e2e bench hands it to the
    /// prefill agents (chunks of `chunk_tokens` rounded down to whole virtual pages, at least
    /// one, no prefix).
    pub(super) fn new(
        prefills: &[Rank<'_>],
        decodes: &[Rank<'_>],
        tokens: u64,
        chunk_tokens: u64,
    ) -> Result<Self, String> {
        let plans = pair_plans(prefills, decodes)?;
        let mut chunks: Vec<Vec<Vec<TransferOp>>> = Vec::new();
        for (pi, p) in prefills.iter().enumerate() {
            let v = p.desc.page_size * u64::from(p.desc.dcp_size);
            let plan = kvbridge_geometry::chunk_plan(0, tokens, v, (chunk_tokens / v).max(1));
            let n = plan.len();
            let (mut page_offset, mut token_offset) = (0, 0);
            for (k, (pages, ntok)) in plan.into_iter().enumerate() {
                let ids: Vec<u64> = pages.map(|j| p.table[j as usize]).collect();
                let npages = ids.len() as u64;
                let chunk = if k + 1 == n {
                    Chunk::last(ids, ntok, None)
                } else {
                    Chunk::new(ids, ntok)
                };
                if chunks.len() <= k {
                    chunks.push(vec![Vec::new(); prefills.len() * decodes.len()]);
                }
                for (qi, d) in decodes.iter().enumerate() {
                    chunks[k][pi * decodes.len() + qi] = plans[pi * decodes.len() + qi]
                        .chunk_ops(&chunk, page_offset, token_offset, d.table, 0)
                        .map_err(|e| format!("strided baseline: planning chunk {k}: {}", e.0))?;
                }
                page_offset += npages;
                token_offset += ntok;
            }
        }
        Ok(Self {
            chunks,
            decodes: decodes.len(),
            src: prefills.iter().map(|p| by_id(p.mem)).collect(),
            dst: decodes.iter().map(|d| by_id(d.mem)).collect(),
        })
    }

    /// Ops (a strided op counts one) and rows per request.
    pub(super) fn counts(&self) -> (u64, u64) {
        let ops = self.chunks.iter().flatten().flatten();
        (
            ops.clone().count() as u64,
            ops.map(|o| o.count).sum::<u64>(),
        )
    }

    fn regions(&self, p: usize, q: usize, op: &TransferOp) -> Result<OpRows<'_>, String> {
        let missing = |side: &str, id: RegionId| {
            format!("internal: strided baseline: the planner named {side} region {id}")
        };
        Ok(OpRows {
            src: self.src[p]
                .get(&op.local_region)
                .ok_or_else(|| missing("prefill", op.local_region))?,
            dst: self.dst[q]
                .get(&op.remote_region)
                .ok_or_else(|| missing("decode", op.remote_region))?,
            op: *op,
        })
    }

    /// One run of the strided limit: chunk by chunk, each prefill rank's batches copied
    /// together op by op (the decode ranks' `i`-th ops read the same source pages) when they
    /// have the same number of ops, else each op alone.
    pub(super) fn limit_run(&self) -> Result<Duration, String> {
        let e = |e: kvbridge_transport::TransportError| format!("strided limit: {e}");
        let t0 = Instant::now();
        for chunk in &self.chunks {
            for (p, batches) in chunk.chunks(self.decodes).enumerate() {
                let n = batches[0].len();
                if self.decodes > 1 && batches.iter().all(|b| b.len() == n) {
                    let mut gang = Vec::with_capacity(self.decodes);
                    for i in 0..n {
                        gang.clear();
                        for (q, b) in batches.iter().enumerate() {
                            gang.push(self.regions(p, q, &b[i])?);
                        }
                        copy_together(&gang).map_err(e)?;
                    }
                    continue;
                }
                for (q, b) in batches.iter().enumerate() {
                    for op in b {
                        let r = self.regions(p, q, op)?;
                        copy_op(r.src, r.dst, op, RowStores::Streaming).map_err(e)?;
                    }
                }
            }
        }
        Ok(t0.elapsed())
    }

    /// One run of the per-row memcpy: every op's rows, one `memcpy` each, batch by batch.
    pub(super) fn memcpy_rows_run(&self) -> Result<Duration, String> {
        let t0 = Instant::now();
        for chunk in &self.chunks {
            for (i, batch) in chunk.iter().enumerate() {
                let (p, q) = (i / self.decodes, i % self.decodes);
                for op in batch {
                    let r = self.regions(p, q, op)?;
                    copy_op(r.src, r.dst, op, RowStores::Memcpy)
                        .map_err(|e| format!("per-row memcpy: {e}"))?;
                }
            }
        }
        Ok(t0.elapsed())
    }
}
