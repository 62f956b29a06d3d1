//! MHA/GQA head slicing when prefill and decode attention TP sizes differ (docs/planning.md, "MHA/GQA head slicing"), and an
//! exact head plan in which every decode rank receives each of its heads exactly once.

use std::ops::Range;

use crate::bytes::{ByteRanges, EntryPair, RowCopy, pair_item_lens};
use crate::error::{GeometryError, Result, Side};
use crate::limits::{self, MAX_KV_HEADS};
use crate::pool::PoolGeometry;
use crate::runs::{Run, group_concurrent_contiguous};

/// Which heads of a source token row go where in a destination token row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadSlice {
    /// First head, counted inside the source rank's heads.
    pub src_head_start: u64,
    /// Heads copied.
    pub num_heads: u64,
    /// First head, counted inside the destination rank's heads.
    pub dst_head_start: u64,
}

/// SGLang's `compute_head_slice_params`, for one (prefill rank, decode rank) pair.
///
/// With `h_src = max(1, H div tp_src)` and `h_dst = max(1, H div tp_dst)`:
/// * `tp_src > tp_dst`: `(0, h_src, (uniq·h_src) mod h_dst)` with
///   `uniq = (src_rank mod tp_src) div max(1, tp_src div H)`;
/// * else `((uniq·h_dst) mod h_src, h_dst, 0)` with
///   `uniq = (dst_rank mod tp_dst) div max(1, tp_dst div H)`.
///
/// When the prefill replicates KV heads (`tp_src > H`), several prefill ranks get the same
/// slice for one decode rank; [`HeadSharding::sources_for`] picks one of them.
///
/// # Errors
/// [`GeometryError::HeadsDoNotSplit`] when a TP size or the head count is zero.
pub fn compute_head_slice_params(
    tp_src: u64,
    tp_dst: u64,
    src_rank: u64,
    dst_rank: u64,
    total_kv_heads: u64,
) -> Result<HeadSlice> {
    let h = total_kv_heads;
    if tp_src == 0 || tp_dst == 0 || h == 0 {
        return Err(GeometryError::HeadsDoNotSplit {
            total_kv_heads: h,
            tp_src,
            tp_dst,
        });
    }
    //= sglang 0.5.23 sglang/srt/disaggregation/common/staging_buffer.py compute_head_slice_params test: head_slice_params_examples
    //# src_heads_per_rank = max(1, total_kv_heads // src_attn_tp_size)
    //# dst_heads_per_rank = max(1, total_kv_heads // dst_attn_tp_size)
    let h_src = (h / tp_src).max(1);
    let h_dst = (h / tp_dst).max(1);
    Ok(if tp_src > tp_dst {
        //= sglang 0.5.23 sglang/srt/disaggregation/common/staging_buffer.py compute_head_slice_params test: head_slice_params_examples, agrees_with_sglang_without_prefill_replication
        //# src_replication = max(1, src_attn_tp_size // total_kv_heads)
        //# unique_head_idx = local_tp_rank // src_replication
        //# dst_head_start = (unique_head_idx * src_heads_per_rank) % dst_heads_per_rank
        let uniq = (src_rank % tp_src) / (tp_src / h).max(1);
        HeadSlice {
            src_head_start: 0,
            num_heads: h_src,
            dst_head_start: (uniq * h_src) % h_dst,
        }
    } else {
        //= sglang 0.5.23 sglang/srt/disaggregation/common/staging_buffer.py compute_head_slice_params test: head_slice_params_examples, agrees_with_sglang_without_prefill_replication
        //# dst_replication = max(1, dst_attn_tp_size // total_kv_heads)
        //# unique_dst_head_idx = dst_tp_rank_in_group // dst_replication
        //# src_head_start = (unique_dst_head_idx * dst_heads_per_rank) % src_heads_per_rank
        let uniq = (dst_rank % tp_dst) / (tp_dst / h).max(1);
        HeadSlice {
            src_head_start: (uniq * h_dst) % h_src,
            num_heads: h_dst,
            dst_head_start: 0,
        }
    })
}

/// Mooncake's head-sliced page path (docs/planning.md, "MHA/GQA head slicing"): for every entry pair, page pair `(ps, pd)`
/// and token slot `t`, copy `slice.num_heads · hb` bytes from
/// `ps·src_item_len + t·src_tok + src_head_start·hb` to
/// `pd·dst_item_len + t·dst_tok + dst_head_start·hb`, with `hb = dst_item_len / P / h_dst`.
/// Token slots whose slices are contiguous on both sides are merged.
///
/// # Errors
/// [`GeometryError::InvalidGeometry`] (different page sizes, `heads_per_dst_rank = 0`),
/// [`GeometryError::HeadSliceTooWide`] (SGLang's text), [`GeometryError::EntryOutOfRange`],
/// [`GeometryError::UnequalIndexArrays`], [`GeometryError::PageOutOfRange`].
pub fn head_slice_ranges(
    src: &PoolGeometry,
    dst: &PoolGeometry,
    pairs: &[EntryPair],
    slice: HeadSlice,
    heads_per_dst_rank: u64,
    src_pages: &[u64],
    dst_pages: &[u64],
) -> Result<ByteRanges> {
    let p = src.page_size();
    if dst.page_size() != p {
        return Err(GeometryError::InvalidGeometry {
            reason: format!(
                "head slicing on the page path needs equal page sizes, got prefill {p} and decode \
                 {}; use the resharding plan for different page sizes",
                dst.page_size()
            ),
        });
    }
    if heads_per_dst_rank == 0 {
        return Err(GeometryError::InvalidGeometry {
            reason: "heads_per_dst_rank must be positive".to_owned(),
        });
    }
    let src_pages = &src_pages[..src_pages.len().min(dst_pages.len())];
    let page_runs = group_concurrent_contiguous(src_pages, dst_pages)?;
    src.check_pages(Side::Prefill, src_pages)?;
    dst.check_pages(Side::Decode, dst_pages)?;
    let row_runs = || {
        page_runs
            .iter()
            .map(move |r| Run::new(r.src_start * p, r.dst_start * p, r.len * p))
    };
    let mut out = ByteRanges::new();
    for &pair in pairs {
        let (s_len, d_len) = pair_item_lens(src, dst, pair)?;
        let (src_tok, dst_tok) = (s_len / p, d_len / p);
        let hb = dst_tok / heads_per_dst_rank;
        let copy = head_copy(pair, src_tok, dst_tok, slice, hb)?;
        copy.push_runs(&mut out, row_runs());
    }
    Ok(out)
}

/// Builds the row copy of a head slice, refusing slices that leave either token row.
pub(crate) fn head_copy(
    pair: EntryPair,
    src_tok: u64,
    dst_tok: u64,
    slice: HeadSlice,
    hb: u64,
) -> Result<RowCopy> {
    let width = slice.num_heads.saturating_mul(hb);
    let dst_end = slice
        .dst_head_start
        .saturating_mul(hb)
        .saturating_add(width);
    //= sglang 0.5.23 sglang/srt/disaggregation/mooncake/conn.py MooncakeKVManager.send_kvcache_slice test: head_slice_wider_than_the_slot_is_refused
    //# if heads_bytes_per_token_to_send > (dst_kv_item_len // page_size):
    if width > dst_tok || dst_end > dst_tok {
        return Err(GeometryError::HeadSliceTooWide {
            slice_bytes: width,
            slot_bytes: dst_tok,
        });
    }
    let src_end = slice
        .src_head_start
        .saturating_mul(hb)
        .saturating_add(width);
    if src_end > src_tok {
        return Err(GeometryError::HeadSliceTooWide {
            slice_bytes: src_end,
            slot_bytes: src_tok,
        });
    }
    Ok(RowCopy {
        pair,
        src_width: src_tok,
        dst_width: dst_tok,
        src_col: slice.src_head_start * hb,
        dst_col: slice.dst_head_start * hb,
        width,
    })
}

/// One prefill rank's contribution to a decode rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadSource {
    /// Prefill attention-TP rank to read from.
    pub src_rank: u64,
    /// Heads it sends and where they land.
    pub slice: HeadSlice,
}

/// How `total_kv_heads` KV heads are spread over a prefill and a decode attention-TP group.
///
/// A group of size `T` holds heads as SGLang does: `T ≤ H` → rank `t` holds
/// `[t·H/T, (t+1)·H/T)`; `T > H` (replicated KV heads) → rank `t` holds head `t div (T/H)`.
/// Each size must divide `H` or be a multiple of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadSharding {
    total_kv_heads: u64,
    tp_src: u64,
    tp_dst: u64,
}

impl HeadSharding {
    /// Validates the split.
    ///
    /// # Errors
    /// [`GeometryError::HeadsDoNotSplit`]; [`GeometryError::TooLarge`] for more than
    /// [`crate::MAX_KV_HEADS`] heads or a TP size above [`crate::MAX_GROUP_SIZE`].
    pub fn new(total_kv_heads: u64, tp_src: u64, tp_dst: u64) -> Result<Self> {
        // Before `sources_for` / `targets_of` loop over heads and ranks.
        limits::at_most(
            "total_kv_heads",
            total_kv_heads,
            MAX_KV_HEADS,
            "pass the model's num_key_value_heads",
        )?;
        limits::group_size("prefill attn_tp_size", tp_src)?;
        limits::group_size("decode attn_tp_size", tp_dst)?;
        let splits = |t: u64| t > 0 && (total_kv_heads % t == 0 || t % total_kv_heads == 0);
        if total_kv_heads == 0 || !splits(tp_src) || !splits(tp_dst) {
            return Err(GeometryError::HeadsDoNotSplit {
                total_kv_heads,
                tp_src,
                tp_dst,
            });
        }
        Ok(Self {
            total_kv_heads,
            tp_src,
            tp_dst,
        })
    }

    fn heads(&self, tp: u64, rank: u64) -> Range<u64> {
        let h = self.total_kv_heads;
        if tp <= h {
            let per = h / tp;
            rank * per..(rank + 1) * per
        } else {
            let head = rank / (tp / h);
            head..head + 1
        }
    }

    fn check_rank(side: Side, rank: u64, size: u64) -> Result<()> {
        if rank >= size {
            return Err(GeometryError::TpRankOutOfRange { side, rank, size });
        }
        Ok(())
    }

    /// Heads held by each prefill rank.
    #[must_use]
    pub fn heads_per_src_rank(&self) -> u64 {
        (self.total_kv_heads / self.tp_src).max(1)
    }

    /// Heads held by each decode rank.
    #[must_use]
    pub fn heads_per_dst_rank(&self) -> u64 {
        (self.total_kv_heads / self.tp_dst).max(1)
    }

    /// Global head ids held by prefill rank `rank`.
    ///
    /// # Errors
    /// [`GeometryError::TpRankOutOfRange`].
    pub fn src_heads(&self, rank: u64) -> Result<Range<u64>> {
        Self::check_rank(Side::Prefill, rank, self.tp_src)?;
        Ok(self.heads(self.tp_src, rank))
    }

    /// Global head ids held by decode rank `rank`.
    ///
    /// # Errors
    /// [`GeometryError::TpRankOutOfRange`].
    pub fn dst_heads(&self, rank: u64) -> Result<Range<u64>> {
        Self::check_rank(Side::Decode, rank, self.tp_dst)?;
        Ok(self.heads(self.tp_dst, rank))
    }

    /// The prefill ranks decode rank `dst_rank` reads from, each with the heads it sends, so
    /// that every head of the decode rank arrives exactly once. Where the prefill replicates a
    /// head over several ranks, replica `dst_rank mod replicas` is chosen (spreading load).
    ///
    /// # Errors
    /// [`GeometryError::TpRankOutOfRange`].
    pub fn sources_for(&self, dst_rank: u64) -> Result<Vec<HeadSource>> {
        let need = self.dst_heads(dst_rank)?;
        let h = self.total_kv_heads;
        let owner = |head: u64| {
            if self.tp_src <= h {
                head / (h / self.tp_src)
            } else {
                let rep = self.tp_src / h;
                head * rep + dst_rank % rep
            }
        };
        let mut out: Vec<HeadSource> = Vec::new();
        for head in need.clone() {
            let src_rank = owner(head);
            match out.last_mut() {
                Some(last) if last.src_rank == src_rank => last.slice.num_heads += 1,
                _ => {
                    let src_first = self.heads(self.tp_src, src_rank).start;
                    out.push(HeadSource {
                        src_rank,
                        slice: HeadSlice {
                            src_head_start: head - src_first,
                            num_heads: 1,
                            dst_head_start: head - need.start,
                        },
                    });
                }
            }
        }
        Ok(out)
    }

    /// The decode ranks prefill rank `src_rank` sends to under [`HeadSharding::sources_for`],
    /// with the slice for each.
    ///
    /// # Errors
    /// [`GeometryError::TpRankOutOfRange`].
    pub fn targets_of(&self, src_rank: u64) -> Result<Vec<(u64, HeadSlice)>> {
        Self::check_rank(Side::Prefill, src_rank, self.tp_src)?;
        // Only the decode ranks holding one of this rank's heads can read from it: work linear
        // in them, not in the decode TP size.
        let held = self.heads(self.tp_src, src_rank);
        let h = self.total_kv_heads;
        let candidates = if self.tp_dst <= h {
            let per = h / self.tp_dst;
            held.start / per..(held.end - 1) / per + 1
        } else {
            let rep = self.tp_dst / h;
            held.start * rep..held.end * rep
        };
        let mut out = Vec::new();
        for dst_rank in candidates {
            for s in self.sources_for(dst_rank)? {
                if s.src_rank == src_rank {
                    out.push((dst_rank, s.slice));
                }
            }
        }
        Ok(out)
    }

    /// Byte ranges of one exact head transfer on the page path (equal page sizes): like
    /// [`head_slice_ranges`] with `hb = dst token bytes / heads_per_dst_rank`, also checking
    /// that the source rows have `heads_per_src_rank · hb` bytes.
    ///
    /// # Errors
    /// As [`head_slice_ranges`], plus [`GeometryError::WidthMismatch`] when head widths differ.
    pub fn page_ranges(
        &self,
        source: HeadSource,
        src: &PoolGeometry,
        dst: &PoolGeometry,
        pairs: &[EntryPair],
        src_pages: &[u64],
        dst_pages: &[u64],
    ) -> Result<ByteRanges> {
        for &pair in pairs {
            let (s_len, d_len) = pair_item_lens(src, dst, pair)?;
            let (hs, hd) = (
                s_len / src.page_size() / self.heads_per_src_rank(),
                d_len / dst.page_size() / self.heads_per_dst_rank(),
            );
            if hs != hd {
                return Err(GeometryError::WidthMismatch {
                    src_entry: pair.src,
                    dst_entry: pair.dst,
                    src_bytes: hs,
                    dst_bytes: hd,
                    unit: "head per token",
                });
            }
        }
        head_slice_ranges(
            src,
            dst,
            pairs,
            source.slice,
            self.heads_per_dst_rank(),
            src_pages,
            dst_pages,
        )
    }
}
