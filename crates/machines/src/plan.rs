//! From a chunk to transport descriptors, for one (prefill rank, decode rank) pair.
//!
//! All planning logic lives in `kvbridge-geometry` (page runs, the DCP token plan, head
//! slicing) and `kvbridge-handshake` (which path a pair uses). This module only builds the two
//! pools' geometry from the descriptors and registered memory, calls the planner, and places
//! the entry-relative byte ranges into the two sides' registered regions, checking every
//! descriptor against the entry it addresses (a decode's page ids never make the prefill
//! write outside the decode's advertised entry).

use std::borrow::Cow;

use kvbridge_geometry::{
    ByteRanges, DcpPlanInput, EntryPair, HeadMajorPages, HeadSharding, HeadSource, PoolFormat,
    PoolGeometry, ReshardInput, SendPages, identity_pairs, page_path_ranges,
};
use kvbridge_handshake::{HEAD_MAJOR_KV_LAYOUT, PeerDescriptor, TransferPath};
use kvbridge_transport::memory::checked_rows;
use kvbridge_transport::{RegionId, TransferOp};

use kvbridge_control::WireRegion;

/// One chunk of a room's send range, as the prefill scheduler hands it over (docs/lifecycle.md, "Chunks").
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
    /// Only these KV entries (layers) of the chunk's pages, when the chunk is sent layer by
    /// layer (`None`: every entry). The parts of a chunk are handed over in order with the
    /// same pages and tokens (docs/lifecycle.md, "Layer by layer").
    pub layers: Option<std::ops::Range<usize>>,
}

impl Chunk {
    /// A non-last chunk of whole pages.
    pub fn new(pages: Vec<u64>, num_kv_tokens: u64) -> Self {
        Self {
            pages,
            num_kv_tokens,
            is_last: false,
            aux_index: None,
            layers: None,
        }
    }

    /// The last chunk, with the prefill's aux row (may be `None` when there are no aux buffers).
    pub fn last(pages: Vec<u64>, num_kv_tokens: u64, aux_index: Option<u64>) -> Self {
        Self {
            pages,
            num_kv_tokens,
            is_last: true,
            aux_index,
            layers: None,
        }
    }

    /// The same chunk, for KV entries `layers` only (one part of it sent layer by layer).
    #[must_use]
    pub fn for_layers(mut self, layers: std::ops::Range<usize>) -> Self {
        self.layers = Some(layers);
        self
    }
}

/// A planning failure, with the text to record as the room's reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanError(pub String);

impl From<kvbridge_geometry::GeometryError> for PlanError {
    fn from(e: kvbridge_geometry::GeometryError) -> Self {
        PlanError(e.to_string())
    }
}

fn format_of(d: &PeerDescriptor) -> PoolFormat {
    let (total_kv_heads, head_dim) = (d.total_kv_heads.unwrap_or(0), d.head_dim.unwrap_or(0));
    match d.kv_pool {
        kvbridge_geometry::PoolKind::Mha if d.is_head_major() => PoolFormat::MhaHeadMajor {
            total_kv_heads,
            head_dim,
        },
        kvbridge_geometry::PoolKind::Mha => PoolFormat::Mha {
            total_kv_heads,
            head_dim,
        },
        kvbridge_geometry::PoolKind::Mla => PoolFormat::Mla,
        kvbridge_geometry::PoolKind::HybridMla => PoolFormat::HybridMla,
    }
}

/// The pool geometry of a side, given how many pages its registered entries hold.
pub fn pool_geometry(d: &PeerDescriptor, num_pages: u64) -> Result<PoolGeometry, PlanError> {
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
    /// Head slices of head-major pages (both sides `kv_layout` [`HEAD_MAJOR_KV_LAYOUT`]).
    HeadMajor(HeadSharding, HeadSource),
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

/// Which producer a pair uses on `path`. Head-major pages (both sides
/// [`HEAD_MAJOR_KV_LAYOUT`]) are sliced by their own planner; only the paths that keep pages
/// whole or slice them by heads are planned for them.
fn producer_of(
    path: TransferPath,
    me: &PeerDescriptor,
    peer: &PeerDescriptor,
) -> Result<Producer, PlanError> {
    let head_major = match (me.is_head_major(), peer.is_head_major()) {
        (false, false) => false,
        (true, true) => true,
        // The handshake refuses two different layout names; a layout named on one side only
        // still lays bytes out differently, so it is refused here.
        (mine, _) => {
            let (named, other) = if mine {
                ("prefill", peer)
            } else {
                ("decode", me)
            };
            return Err(PlanError(format!(
                "the {named} pages are head-major (kv_layout {HEAD_MAJOR_KV_LAYOUT}) but the {} \
                 pages are not (kv_layout {}); both servers must use the same KV layout",
                if mine { "decode" } else { "prefill" },
                other.kv_layout.as_deref().unwrap_or("not set"),
            )));
        }
    };
    Ok(match path {
        TransferPath::Pages => Producer::Pages,
        TransferPath::HeadSlices => match head_source(me, peer)? {
            Some((sharding, source)) if head_major => Producer::HeadMajor(sharding, source),
            Some((sharding, source)) => Producer::Heads(sharding, source),
            None => Producer::NoHeads,
        },
        TransferPath::DcpTokenPlan | TransferPath::Rows { .. } if head_major => {
            return Err(PlanError(format!(
                "head-major pages (kv_layout {HEAD_MAJOR_KV_LAYOUT}) are planned with equal page \
                 sizes and no DCP only, but this pair needs {}; run both servers with the same \
                 block size and DCP size 1",
                path.describe()
            )));
        }
        TransferPath::DcpTokenPlan => Producer::Dcp,
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
    })
}

/// Everything needed to turn chunks into descriptors for one decode peer; built once at
/// registration.
#[derive(Debug, Clone)]
pub struct PeerPlan {
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
    /// The plan of the pair (`path` from the handshake's check) from both sides' descriptors
    /// and registered regions (one per KV entry and per aux buffer, in entry order).
    ///
    /// # Errors
    /// The regions do not match the descriptors, or the path is not one this release plans.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        path: TransferPath,
        me: &PeerDescriptor,
        my_kv: &[WireRegion],
        my_aux: &[WireRegion],
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
        let src = pool_geometry(me, pages_of(my_kv, &me.kv_item_lens))?;
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
        let producer = producer_of(path, me, peer)?;
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
        Ok(PeerPlan {
            producer,
            src,
            dst,
            pairs,
            src_kv: place(my_kv),
            dst_kv: place(peer_kv),
            src_aux: rows(place(my_aux), &me.aux_item_lens),
            dst_aux: rows(place(peer_aux), &peer.aux_item_lens),
            dst_dcp_size: u64::from(peer.dcp_size.max(1)),
            dst_dcp_rank: u64::from(peer.dcp_rank),
            src_dcp_size: u64::from(me.dcp_size.max(1)),
            src_dcp_rank: u64::from(me.dcp_rank),
        })
    }

    /// Decode virtual page size (`P_dst · d_dst`); prefixes must be multiples of it.
    pub fn virtual_page(&self) -> u64 {
        self.dst.page_size().saturating_mul(self.dst_dcp_size)
    }

    /// Checks a decode prefix against the virtual page, with the planner's error text.
    pub fn check_prefix(&self, decode_prefix_len: u64) -> Result<(), PlanError> {
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

    /// The entry pairs a chunk (or a part of it, `layers`) moves.
    fn entry_pairs(&self, layers: Option<&std::ops::Range<usize>>) -> Cow<'_, [EntryPair]> {
        match layers {
            Some(layers) => self
                .pairs
                .iter()
                .filter(|p| layers.contains(&p.src))
                .copied()
                .collect(),
            None => Cow::Borrowed(&self.pairs),
        }
    }

    /// The descriptors of one chunk. `page_offset` / `token_offset` = pages / tokens of the
    /// send range sent before it; `dst_pages` = the decode's ids of the send range (entry 0
    /// at `decode_prefix_len`, as its metadata carries them).
    pub fn chunk_ops(
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
        let pairs = &*self.entry_pairs(chunk.layers.as_ref());
        let ranges: ByteRanges = match &self.producer {
            Producer::Pages => {
                page_path_ranges(&self.src, &self.dst, pairs, &chunk.pages, slice()?)?
            }
            Producer::Heads(sharding, source) => sharding.page_ranges(
                *source,
                &self.src,
                &self.dst,
                pairs,
                &chunk.pages,
                slice()?,
            )?,
            Producer::HeadMajor(sharding, source) => sharding.head_major_page_ranges(
                *source,
                &self.src,
                &self.dst,
                pairs,
                HeadMajorPages {
                    src_pages: &chunk.pages,
                    dst_pages: slice()?,
                    num_tokens: chunk.num_kv_tokens,
                },
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
            .byte_ranges(&self.src, &self.dst, pairs)?,
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
                    None => plan.byte_ranges(&self.src, &self.dst, pairs)?,
                    Some((sharding, source)) => {
                        plan.head_byte_ranges(&self.src, &self.dst, pairs, sharding, *source)?
                    }
                }
            }
        };
        self.ops_of(&ranges)
    }

    /// One strided transport op per planned range.
    fn ops_of(&self, ranges: &ByteRanges) -> Result<Vec<TransferOp>, PlanError> {
        let mut ops = Vec::with_capacity(ranges.len());
        for r in ranges.iter() {
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
            let rows = Rows {
                len: r.len,
                count: r.count,
            };
            let local = place(
                so,
                sl,
                r.src_offset,
                r.src_stride,
                rows,
                "prefill",
                r.src_entry,
            )?;
            let remote = place(
                doff,
                dl,
                r.dst_offset,
                r.dst_stride,
                rows,
                "decode",
                r.dst_entry,
            )?;
            let op = TransferOp::new(sr, local, dr, remote, r.len);
            ops.push(if r.count == 1 {
                op
            } else {
                op.with_rows(r.count, r.src_stride, r.dst_stride)
            });
        }
        Ok(ops)
    }

    /// The descriptors of the aux rows (docs/lifecycle.md, "Aux rows"): buffer `j < min(#src, #dst)`, the
    /// prefill's row length, each side's own row stride.
    pub fn aux_ops(&self, src_index: u64, dst_index: u64) -> Result<Vec<TransferOp>, PlanError> {
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
            let row = Rows::one(s_item);
            ops.push(TransferOp::new(
                sr,
                place(so, sl, src_off, 0, row, "prefill aux", j)?,
                dr,
                place(doff, dl, dst_off, 0, row, "decode aux", j)?,
                s_item,
            ));
        }
        Ok(ops)
    }
}

/// `count` rows of `len` bytes (one side's stride is passed next to it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rows {
    len: u64,
    count: u64,
}

impl Rows {
    const fn one(len: u64) -> Self {
        Self { len, count: 1 }
    }
}

/// `base + offset`, refusing rows (`offset + i·stride`, `len` bytes each) that leave the entry
/// `[base, base + entry_len)`.
fn place(
    base: u64,
    entry_len: u64,
    offset: u64,
    stride: u64,
    rows: Rows,
    side: &str,
    entry: usize,
) -> Result<u64, PlanError> {
    let Rows { len, count } = rows;
    let within = usize::try_from(entry_len).unwrap_or(usize::MAX);
    match checked_rows(within, offset, stride, len, count) {
        Ok(_) => base
            .checked_add(offset)
            .ok_or_else(|| PlanError(format!("{side} entry {entry}: offset {offset} overflows"))),
        Err(_) => Err(PlanError(format!(
            "{side} entry {entry} is {entry_len} bytes but a descriptor addresses {count} rows \
             of {len} bytes from offset {offset} every {stride} bytes; the page or row index \
             is outside what was registered"
        ))),
    }
}

/// Whether an op's source rows are strided (several rows, not back to back): what the pack
/// path gathers.
pub fn is_strided_source(op: &TransferOp) -> bool {
    op.count > 1 && op.len > 0 && op.local_stride != op.len
}

/// A batch rewritten for a pack buffer: the ops to post, and the gathers that fill the buffer
/// first (each a strided op from a KV region into the buffer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedOps {
    /// The ops to post, reading the pack buffer.
    pub ops: Vec<TransferOp>,
    /// The copies that fill the pack buffer first.
    pub gathers: Vec<TransferOp>,
    /// Bytes gathered into the buffer.
    pub bytes: u64,
}

/// Rewrites a batch for the pack buffer `pack` of `capacity` bytes: every op with strided
/// source rows is gathered into the buffer, laid out in destination order, and posted from it;
/// ops that land back to back in one destination region are merged, so a chunk whose
/// destination pages are adjacent posts one range per layer. Other ops are kept as they are.
pub fn pack_ops(
    ops: Vec<TransferOp>,
    pack: RegionId,
    capacity: u64,
) -> Result<PackedOps, PlanError> {
    let (mut strided, mut out): (Vec<TransferOp>, Vec<TransferOp>) =
        ops.into_iter().partition(is_strided_source);
    // Destination order, so adjacent destination rows become one range.
    strided.sort_by_key(|o| (o.remote_region.0, o.remote_offset));
    let mut gathers = Vec::with_capacity(strided.len());
    let mut packed: Vec<TransferOp> = Vec::new();
    let mut cursor = 0u64;
    for o in strided {
        let bytes = o.len.checked_mul(o.count);
        let end = bytes.and_then(|b| cursor.checked_add(b));
        let (Some(bytes), Some(end)) = (bytes, end.filter(|&e| e <= capacity)) else {
            return Err(PlanError(format!(
                "the batch gathers more than a pack buffer holds ({capacity} bytes; {} rows of \
                 {} bytes do not fit after {cursor}); size PackBuffers for the smallest decode \
                 DCP size and the longest chunk sent",
                o.count, o.len
            )));
        };
        gathers.push(
            TransferOp::new(o.local_region, o.local_offset, pack, cursor, o.len).with_rows(
                o.count,
                o.local_stride,
                o.len,
            ),
        );
        let op = if o.remote_stride == o.len {
            TransferOp::new(pack, cursor, o.remote_region, o.remote_offset, bytes)
        } else {
            TransferOp::new(pack, cursor, o.remote_region, o.remote_offset, o.len).with_rows(
                o.count,
                o.len,
                o.remote_stride,
            )
        };
        match packed.last_mut() {
            Some(last)
                if last.count == 1
                    && op.count == 1
                    && last.remote_region == op.remote_region
                    && last.local_offset + last.len == op.local_offset
                    && last.remote_offset.checked_add(last.len) == Some(op.remote_offset) =>
            {
                *last = TransferOp::new(
                    last.local_region,
                    last.local_offset,
                    last.remote_region,
                    last.remote_offset,
                    last.len + op.len,
                );
            }
            _ => packed.push(op),
        }
        cursor = end;
    }
    out.extend(packed);
    Ok(PackedOps {
        ops: out,
        gathers,
        bytes: cursor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn place_refuses_ranges_outside_the_entry() {
        let one = Rows::one;
        assert_eq!(place(100, 50, 10, 0, one(40), "decode", 0), Ok(110));
        assert!(place(100, 50, 10, 0, one(41), "decode", 0).is_err());
        assert!(place(100, 50, u64::MAX, 0, one(2), "decode", 0).is_err());
    }

    #[test]
    fn place_checks_every_row_of_a_strided_descriptor() {
        let rows = Rows { len: 4, count: 3 };
        // Rows at 10, 20, 30 (+4): the last ends at 34.
        assert_eq!(place(100, 34, 10, 10, rows, "decode", 0), Ok(110));
        assert!(place(100, 33, 10, 10, rows, "decode", 0).is_err());
        assert!(place(0, u64::MAX, 0, u64::MAX, rows, "decode", 0).is_err());
        assert_eq!(
            place(0, 10, 10, 7, Rows { len: 0, count: 0 }, "decode", 0),
            Ok(10)
        );
    }

    fn strided(local: u64, remote: u64, rows: u64) -> TransferOp {
        // `rows` rows of 8 bytes, every 32 bytes on the source, back to back on the
        // destination (a DCP 1 -> 4 page-layer).
        TransferOp::new(RegionId(1), local, RegionId(2), remote, 8).with_rows(rows, 32, 8)
    }

    #[test]
    fn pack_ops_gathers_strided_sources_in_destination_order_and_merges() {
        let plain = TransferOp::new(RegionId(1), 0, RegionId(3), 0, 100);
        // Two page-layers whose destinations are adjacent, listed in reverse order.
        let ops = vec![strided(1000, 64, 8), plain, strided(0, 0, 8)];
        let p = pack_ops(ops, RegionId(9), 128).unwrap();
        assert_eq!(p.bytes, 128);
        assert_eq!(
            p.ops,
            vec![plain, TransferOp::new(RegionId(9), 0, RegionId(2), 0, 128)]
        );
        assert_eq!(
            p.gathers,
            vec![
                TransferOp::new(RegionId(1), 0, RegionId(9), 0, 8).with_rows(8, 32, 8),
                TransferOp::new(RegionId(1), 1000, RegionId(9), 64, 8).with_rows(8, 32, 8),
            ]
        );
    }

    #[test]
    fn pack_ops_keeps_strided_destinations_and_refuses_what_does_not_fit() {
        let both = TransferOp::new(RegionId(1), 0, RegionId(2), 0, 8).with_rows(4, 16, 24);
        let p = pack_ops(vec![both], RegionId(9), 32).unwrap();
        assert_eq!(
            p.ops,
            vec![TransferOp::new(RegionId(9), 0, RegionId(2), 0, 8).with_rows(4, 8, 24)]
        );
        assert!(pack_ops(vec![both], RegionId(9), 31).is_err());
        // Nothing strided on the source: nothing to gather.
        let contiguous = TransferOp::new(RegionId(1), 0, RegionId(2), 0, 8).with_rows(4, 8, 24);
        let p = pack_ops(vec![contiguous], RegionId(9), 0).unwrap();
        assert_eq!((p.ops, p.gathers.len(), p.bytes), (vec![contiguous], 0, 0));
    }
}
