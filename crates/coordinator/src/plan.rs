//! From a chunk to transport descriptors, for one (prefill rank, decode rank) pair.
//!
//! All planning logic lives in `kvbridge-geometry` (page runs, the DCP token plan, head
//! slicing) and `kvbridge-handshake` (which path a pair uses). This module only builds the two
//! pools' geometry from the descriptors and registered memory, calls the planner, and places
//! the entry-relative byte ranges into the two sides' registered regions, checking every
//! descriptor against the entry it addresses (a decode's page ids never make the prefill
//! write outside the decode's advertised entry).

use kvbridge_geometry::{
    ByteRange, ByteRanges, DcpPlanInput, EntryPair, HeadSharding, HeadSource, PoolFormat,
    PoolGeometry, ReshardInput, SendPages, identity_pairs, page_path_ranges,
};
use kvbridge_handshake::{PeerDescriptor, TransferPath};
use kvbridge_transport::{RegionId, TransferOp};

use crate::memory::KvMemory;
use crate::messages::WireRegion;

/// One chunk of a room's send range, as the prefill scheduler hands it over (spec 01 §2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Prefill page ids of this chunk (page size of the prefill pool).
    pub pages: Vec<u64>,
    /// Tokens in this chunk; only the last chunk may end mid-page.
    pub num_kv_tokens: u64,
    /// Whether this is the last chunk of the room (its aux rows follow its KV).
    pub is_last: bool,
    /// The prefill's aux (metadata) row for this room; required on the last chunk when the
    /// pool has aux buffers.
    pub aux_index: Option<u64>,
}

impl Chunk {
    /// A non-last chunk of whole pages.
    pub fn new(pages: Vec<u64>, num_kv_tokens: u64) -> Self {
        Self {
            pages,
            num_kv_tokens,
            is_last: false,
            aux_index: None,
        }
    }

    /// The last chunk, with the prefill's aux row (may be `None` when there are no aux buffers).
    pub fn last(pages: Vec<u64>, num_kv_tokens: u64, aux_index: Option<u64>) -> Self {
        Self {
            pages,
            num_kv_tokens,
            is_last: true,
            aux_index,
        }
    }
}

/// A planning failure, with the text to record as the room's reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PlanError(pub(crate) String);

impl From<kvbridge_geometry::GeometryError> for PlanError {
    fn from(e: kvbridge_geometry::GeometryError) -> Self {
        PlanError(e.to_string())
    }
}

fn format_of(d: &PeerDescriptor) -> PoolFormat {
    match d.kv_pool {
        kvbridge_geometry::PoolKind::Mha => PoolFormat::Mha {
            total_kv_heads: d.total_kv_heads.unwrap_or(0),
            head_dim: d.head_dim.unwrap_or(0),
        },
        kvbridge_geometry::PoolKind::Mla => PoolFormat::Mla,
        kvbridge_geometry::PoolKind::HybridMla => PoolFormat::HybridMla,
    }
}

/// The pool geometry of a side, given how many pages its registered entries hold.
pub(crate) fn pool_geometry(d: &PeerDescriptor, num_pages: u64) -> Result<PoolGeometry, PlanError> {
    let n_target = d.num_target_entries();
    Ok(PoolGeometry::builder(d.page_size)
        .num_pages(num_pages)
        .target_entries(&d.kv_item_lens[..n_target])
        .draft_entries(&d.kv_item_lens[n_target..])
        .format(format_of(d))
        .dtype(d.kv_cache_dtype.clone())
        .build()?)
}

fn pages_of(regions: &[WireRegion], item_lens: &[u64]) -> u64 {
    regions
        .iter()
        .zip(item_lens)
        .map(|(r, &l)| r.len.checked_div(l).unwrap_or(0))
        .min()
        .unwrap_or(0)
}

/// How the KV of one decode rank is produced from this prefill rank.
#[derive(Debug, Clone)]
enum Producer {
    Pages,
    Heads(HeadSharding, HeadSource),
    /// This prefill rank holds none of the peer's heads (GQA replication picked another
    /// replica): it sends aux rows only.
    NoHeads,
    Dcp,
    /// Any prefill DCP `a` → decode DCP `b`, any page sizes (owner rule), optionally with a
    /// head slice (MHA/GQA with different attention TP sizes).
    Reshard {
        heads: Option<(HeadSharding, HeadSource)>,
    },
}

/// The head slice this prefill rank sends to the peer, or `None` when it holds none of the
/// peer's heads.
fn head_source(
    me: &PeerDescriptor,
    peer: &PeerDescriptor,
) -> Result<Option<(HeadSharding, HeadSource)>, PlanError> {
    let h = u64::from(me.total_kv_heads.or(peer.total_kv_heads).unwrap_or(0));
    let sharding = HeadSharding::new(h, u64::from(me.attn_tp_size), u64::from(peer.attn_tp_size))?;
    let mine = u64::from(me.attn_tp_rank);
    Ok(sharding
        .sources_for(u64::from(peer.attn_tp_rank))?
        .into_iter()
        .find(|s| s.src_rank == mine)
        .map(|source| (sharding, source)))
}

/// Everything needed to turn chunks into descriptors for one decode peer; built once at
/// registration.
#[derive(Debug, Clone)]
pub(crate) struct PeerPlan {
    producer: Producer,
    src: PoolGeometry,
    dst: PoolGeometry,
    pairs: Vec<EntryPair>,
    src_kv: Vec<(RegionId, u64, u64)>,
    dst_kv: Vec<(RegionId, u64, u64)>,
    src_aux: Vec<(RegionId, u64, u64, u64)>,
    dst_aux: Vec<(RegionId, u64, u64, u64)>,
    dst_dcp_size: u64,
    dst_dcp_rank: u64,
    src_dcp_size: u64,
    src_dcp_rank: u64,
}

impl PeerPlan {
    pub(crate) fn new(
        path: TransferPath,
        me: &PeerDescriptor,
        my_memory: &KvMemory,
        peer: &PeerDescriptor,
        peer_kv: &[WireRegion],
        peer_aux: &[WireRegion],
    ) -> Result<Self, PlanError> {
        if peer_kv.len() != peer.kv_item_lens.len() {
            return Err(PlanError(format!(
                "the decode registered {} KV regions but its descriptor lists {} entries",
                peer_kv.len(),
                peer.kv_item_lens.len()
            )));
        }
        if peer_aux.len() != peer.aux_item_lens.len() {
            return Err(PlanError(format!(
                "the decode registered {} aux regions but its descriptor lists {} aux buffers",
                peer_aux.len(),
                peer.aux_item_lens.len()
            )));
        }
        let src = pool_geometry(me, my_memory.num_pages(me))?;
        let dst = pool_geometry(peer, pages_of(peer_kv, &peer.kv_item_lens))?;
        let (n_src, n_dst) = (me.kv_item_lens.len(), peer.kv_item_lens.len());
        if n_src != n_dst {
            return Err(PlanError(format!(
                "PP-heterogeneous transfer requires layer ids on both peers; got src={n_src} \
                 dst={n_dst} entries (descriptors carry no layer ids, so both sides must \
                 register the same entries)"
            )));
        }
        let pairs = identity_pairs(n_src);
        let producer = match path {
            TransferPath::Pages => Producer::Pages,
            TransferPath::DcpTokenPlan => Producer::Dcp,
            TransferPath::HeadSlices => match head_source(me, peer)? {
                Some((sharding, source)) => Producer::Heads(sharding, source),
                None => Producer::NoHeads,
            },
            TransferPath::Rows { head_slices: false } => Producer::Reshard { heads: None },
            TransferPath::Rows { head_slices: true } => match head_source(me, peer)? {
                Some(hs) => Producer::Reshard { heads: Some(hs) },
                None => Producer::NoHeads,
            },
            other => {
                return Err(PlanError(format!(
                    "the coordinator does not know the transfer path {other:?} ({}); upgrade \
                     kvbridge on the prefill",
                    other.describe()
                )));
            }
        };
        let place = |regions: &[WireRegion]| {
            regions
                .iter()
                .map(|r| (RegionId(r.region), r.offset, r.len))
                .collect::<Vec<_>>()
        };
        let rows = |regions: Vec<(RegionId, u64, u64)>, lens: &[u64]| {
            regions
                .into_iter()
                .zip(lens)
                .map(|((id, off, len), &item)| (id, off, len, item))
                .collect::<Vec<_>>()
        };
        let src_aux_w: Vec<WireRegion> = my_memory.aux.iter().map(|e| e.to_wire()).collect();
        let src_kv_w: Vec<WireRegion> = my_memory.kv.iter().map(|e| e.to_wire()).collect();
        Ok(PeerPlan {
            producer,
            src,
            dst,
            pairs,
            src_kv: place(&src_kv_w),
            dst_kv: place(peer_kv),
            src_aux: rows(place(&src_aux_w), &me.aux_item_lens),
            dst_aux: rows(place(peer_aux), &peer.aux_item_lens),
            dst_dcp_size: u64::from(peer.dcp_size.max(1)),
            dst_dcp_rank: u64::from(peer.dcp_rank),
            src_dcp_size: u64::from(me.dcp_size.max(1)),
            src_dcp_rank: u64::from(me.dcp_rank),
        })
    }

    /// Decode virtual page size (`P_dst · d_dst`); prefixes must be multiples of it.
    pub(crate) fn virtual_page(&self) -> u64 {
        self.dst.page_size().saturating_mul(self.dst_dcp_size)
    }

    /// Checks a decode prefix against the virtual page, with the planner's error text.
    pub(crate) fn check_prefix(&self, decode_prefix_len: u64) -> Result<(), PlanError> {
        let v = self.virtual_page();
        if v == 0 || decode_prefix_len % v != 0 {
            return Err(PlanError(
                kvbridge_geometry::GeometryError::PrefixMisaligned {
                    virtual_page_size: v,
                    decode_prefix_len,
                }
                .to_string(),
            ));
        }
        Ok(())
    }

    /// The descriptors of one chunk. `page_offset` / `token_offset` = pages / tokens of the
    /// send range sent before it; `dst_pages` = the decode's ids of the send range (entry 0
    /// at `decode_prefix_len`, as its metadata carries them).
    pub(crate) fn chunk_ops(
        &self,
        chunk: &Chunk,
        page_offset: u64,
        token_offset: u64,
        dst_pages: &[u64],
        decode_prefix_len: u64,
    ) -> Result<Vec<TransferOp>, PlanError> {
        if chunk.pages.is_empty() || chunk.num_kv_tokens == 0 {
            return Ok(Vec::new());
        }
        let slice = || -> Result<&[u64], PlanError> {
            let start = usize::try_from(page_offset).unwrap_or(usize::MAX);
            let end = start.saturating_add(chunk.pages.len());
            dst_pages.get(start..end).ok_or_else(|| {
                PlanError(format!(
                    "the decode sent {} destination pages, but this chunk needs pages \
                     [{start}, {end}) of the send range; the decode must allocate one page per \
                     page of the send range",
                    dst_pages.len()
                ))
            })
        };
        let ranges: ByteRanges = match &self.producer {
            Producer::Pages => {
                page_path_ranges(&self.src, &self.dst, &self.pairs, &chunk.pages, slice()?)?
            }
            Producer::Heads(sharding, source) => sharding.page_ranges(
                *source,
                &self.src,
                &self.dst,
                &self.pairs,
                &chunk.pages,
                slice()?,
            )?,
            Producer::NoHeads => ByteRanges::new(),
            Producer::Dcp => DcpPlanInput {
                src_pages: &chunk.pages,
                dst_pages: SendPages::after_prefix(dst_pages),
                page_size: self.src.page_size(),
                dcp_size: self.dst_dcp_size,
                dcp_rank: self.dst_dcp_rank,
                chunk_start: token_offset,
                decode_prefix_len,
                num_kv_tokens: Some(chunk.num_kv_tokens),
            }
            .plan()?
            .byte_ranges(&self.src, &self.dst, &self.pairs)?,
            Producer::Reshard { heads } => {
                let plan = ReshardInput {
                    src_pages: &chunk.pages,
                    dst_pages: SendPages::after_prefix(dst_pages),
                    src_page_size: self.src.page_size(),
                    dst_page_size: self.dst.page_size(),
                    src_dcp_size: self.src_dcp_size,
                    src_dcp_rank: self.src_dcp_rank,
                    dst_dcp_size: self.dst_dcp_size,
                    dst_dcp_rank: self.dst_dcp_rank,
                    decode_prefix_len,
                    chunk_start: token_offset,
                    num_tokens: chunk.num_kv_tokens,
                }
                .plan()?;
                match heads {
                    None => plan.byte_ranges(&self.src, &self.dst, &self.pairs)?,
                    Some((sharding, source)) => {
                        plan.head_byte_ranges(&self.src, &self.dst, &self.pairs, sharding, *source)?
                    }
                }
            }
        };
        let mut ops = Vec::with_capacity(usize::try_from(ranges.row_count()).unwrap_or(0));
        // One transport op per row until the ops carry rows themselves.
        for r in ranges.iter().flat_map(ByteRange::rows) {
            let (sr, so, sl) = *self.src_kv.get(r.src_entry).ok_or_else(|| {
                PlanError(format!(
                    "planner addressed prefill entry {} which does not exist",
                    r.src_entry
                ))
            })?;
            let (dr, doff, dl) = *self.dst_kv.get(r.dst_entry).ok_or_else(|| {
                PlanError(format!(
                    "planner addressed decode entry {} which does not exist",
                    r.dst_entry
                ))
            })?;
            ops.push(TransferOp::new(
                sr,
                place(so, sl, r.src_offset, r.len, "prefill", r.src_entry)?,
                dr,
                place(doff, dl, r.dst_offset, r.len, "decode", r.dst_entry)?,
                r.len,
            ));
        }
        Ok(ops)
    }

    /// The descriptors of the aux rows (spec 03 §7): buffer `j < min(#src, #dst)`, the
    /// prefill's row length, each side's own row stride.
    pub(crate) fn aux_ops(
        &self,
        src_index: u64,
        dst_index: u64,
    ) -> Result<Vec<TransferOp>, PlanError> {
        let mut ops = Vec::new();
        for (j, (s, d)) in self.src_aux.iter().zip(&self.dst_aux).enumerate() {
            let (sr, so, sl, s_item) = *s;
            let (dr, doff, dl, d_item) = *d;
            if s_item > d_item {
                return Err(PlanError(format!(
                    "aux buffer {j}: prefill rows are {s_item} bytes but decode rows are \
                     {d_item}; both sides must register the same aux buffers"
                )));
            }
            let src_off = s_item
                .checked_mul(src_index)
                .ok_or_else(|| PlanError(format!("aux buffer {j}: row {src_index} overflows")))?;
            let dst_off = d_item
                .checked_mul(dst_index)
                .ok_or_else(|| PlanError(format!("aux buffer {j}: row {dst_index} overflows")))?;
            ops.push(TransferOp::new(
                sr,
                place(so, sl, src_off, s_item, "prefill aux", j)?,
                dr,
                place(doff, dl, dst_off, s_item, "decode aux", j)?,
                s_item,
            ));
        }
        Ok(ops)
    }
}

/// `base + offset`, refusing a range that leaves the entry `[base, base + entry_len)`.
fn place(
    base: u64,
    entry_len: u64,
    offset: u64,
    len: u64,
    side: &str,
    entry: usize,
) -> Result<u64, PlanError> {
    match offset.checked_add(len) {
        Some(end) if end <= entry_len => base
            .checked_add(offset)
            .ok_or_else(|| PlanError(format!("{side} entry {entry}: offset {offset} overflows"))),
        _ => Err(PlanError(format!(
            "{side} entry {entry} is {entry_len} bytes but a descriptor addresses [{offset}, \
             {offset}+{len}); the page or row index is outside what was registered"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn place_refuses_ranges_outside_the_entry() {
        assert_eq!(place(100, 50, 10, 40, "decode", 0), Ok(110));
        assert!(place(100, 50, 10, 41, "decode", 0).is_err());
        assert!(place(100, 50, u64::MAX, 2, "decode", 0).is_err());
    }
}
