//! Head slicing of head-major pages (docs/planning.md, "Head-major pages"): a page of one
//! entry holds, head by head, that head's K and V rows of the page's tokens (vLLM's CPU KV
//! cache, `[num_blocks, kv_heads, block_size, 2·head_size]`; within one head of one block the
//! rows are in an order of vLLM's kernel, one for each instruction set). Heads `[h0, h1)` of
//! a page are then one contiguous run of `(h1 − h0)·P·hb` bytes (`hb` = a token's K and V of
//! one head), so a page pair needs one descriptor per head slice instead of one row per
//! token, and every page goes whole.

use crate::bytes::{ByteRange, ByteRanges, EntryPair, pair_item_lens};
use crate::error::{GeometryError, Result, Side};
use crate::heads::{HeadSharding, HeadSlice, HeadSource};
use crate::pool::PoolGeometry;

/// The pages of one chunk and the tokens they hold, for
/// [`HeadSharding::head_major_page_ranges`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadMajorPages<'a> {
    /// Prefill page ids, in send order.
    pub src_pages: &'a [u64],
    /// Decode page ids, one per prefill page.
    pub dst_pages: &'a [u64],
    /// Tokens the pages hold from the first slot of the first page: every page but the last
    /// is full (checked; a partial last page is sent whole all the same).
    pub num_tokens: u64,
}

impl HeadSharding {
    /// Byte ranges of one exact head transfer between head-major pages of equal page size:
    /// for every entry pair and page pair `(ps, pd)`, the `slice.num_heads · P · hb` bytes
    /// from `ps·src_item_len + src_head_start·P·hb` to `pd·dst_item_len +
    /// dst_head_start·P·hb` (`hb` = bytes of one head of one token), a partial last page
    /// whole. Pushed a page at a time, so adjacent pages fold into one strided range.
    ///
    /// # Errors
    /// [`GeometryError::InvalidGeometry`] (different page sizes, a token count the pages do
    /// not hold, a page that is not `heads · P · hb` bytes),
    /// [`GeometryError::UnequalIndexArrays`], [`GeometryError::WidthMismatch`] (head widths
    /// differ), [`GeometryError::HeadSliceTooWide`], [`GeometryError::EntryOutOfRange`],
    /// [`GeometryError::PageOutOfRange`].
    pub fn head_major_page_ranges(
        &self,
        source: HeadSource,
        src: &PoolGeometry,
        dst: &PoolGeometry,
        pairs: &[EntryPair],
        pages: HeadMajorPages<'_>,
    ) -> Result<ByteRanges> {
        let p = src.page_size();
        if dst.page_size() != p {
            return Err(GeometryError::InvalidGeometry {
                reason: format!(
                    "head slicing of head-major pages needs equal page sizes, got prefill {p} \
                     and decode {}; run both servers with the same block size",
                    dst.page_size()
                ),
            });
        }
        let HeadMajorPages {
            src_pages,
            dst_pages,
            num_tokens,
        } = pages;
        if src_pages.len() != dst_pages.len() {
            return Err(GeometryError::UnequalIndexArrays {
                len_src: src_pages.len(),
                len_dst: dst_pages.len(),
            });
        }
        // Every page is sent whole (`PageCopy::push_page`); the count is checked all the same.
        last_page_tokens(src_pages.len() as u64, p, num_tokens)?;
        src.check_pages(Side::Prefill, src_pages)?;
        dst.check_pages(Side::Decode, dst_pages)?;
        let mut out = ByteRanges::new();
        for &pair in pairs {
            let copy = self.page_copy(src, dst, pair, source.slice)?;
            for (&ps, &pd) in src_pages.iter().zip(dst_pages) {
                copy.push_page(&mut out, ps, pd, p);
            }
        }
        Ok(out)
    }

    /// The copy of `slice` between two head-major pages of `pair`, after checking that each
    /// page is its rank's heads × `P` token rows of one width and the slice stays inside both.
    fn page_copy(
        &self,
        src: &PoolGeometry,
        dst: &PoolGeometry,
        pair: EntryPair,
        slice: HeadSlice,
    ) -> Result<PageCopy> {
        let p = src.page_size();
        let (s_len, d_len) = pair_item_lens(src, dst, pair)?;
        let (hs, hd) = (self.heads_per_src_rank(), self.heads_per_dst_rank());
        let (bs, bd) = (s_len / p / hs, d_len / p / hd);
        if bs != bd {
            return Err(GeometryError::WidthMismatch {
                src_entry: pair.src,
                dst_entry: pair.dst,
                src_bytes: bs,
                dst_bytes: bd,
                unit: "head per token",
            });
        }
        let hb = bd;
        for (side, entry, len, heads) in [
            (Side::Prefill, pair.src, s_len, hs),
            (Side::Decode, pair.dst, d_len, hd),
        ] {
            if hb == 0 || heads * p * hb != len {
                return Err(GeometryError::InvalidGeometry {
                    reason: format!(
                        "{side} entry {entry}: a head-major page of {len} bytes is not {heads} \
                         heads x {p} tokens x whole head rows ({hb} bytes); register \
                         [blocks, heads of the rank, block size, head row] tensors"
                    ),
                });
            }
        }
        let run = p * hb;
        // Checked per token, as the token-major path reports it: heads `[start, start + n)`
        // of the slice against the heads of the rank's page.
        for (start, heads) in [(slice.dst_head_start, hd), (slice.src_head_start, hs)] {
            let end = start.saturating_add(slice.num_heads);
            if end > heads {
                return Err(GeometryError::HeadSliceTooWide {
                    slice_bytes: end.saturating_mul(hb),
                    slot_bytes: heads * hb,
                });
            }
        }
        Ok(PageCopy {
            pair,
            src_item: s_len,
            dst_item: d_len,
            src_col: slice.src_head_start * run,
            dst_col: slice.dst_head_start * run,
            num_heads: slice.num_heads,
            head_bytes: hb,
        })
    }
}

/// Tokens of the last of `n` pages of `p` tokens holding `num_tokens`, refusing counts the
/// pages do not hold (more tokens than slots, or a page left empty).
fn last_page_tokens(n: u64, p: u64, num_tokens: u64) -> Result<u64> {
    let full = n.saturating_mul(p);
    if n == 0 && num_tokens == 0 {
        return Ok(0);
    }
    if n == 0 || num_tokens > full || num_tokens <= full - p {
        return Err(GeometryError::InvalidGeometry {
            reason: format!(
                "{num_tokens} tokens do not fill {n} pages of {p} tokens: every page but the \
                 last must be full and the last must hold at least one token, so {n} pages \
                 hold {} to {full} tokens; pass the chunk's pages and its token count",
                full.saturating_add(1).saturating_sub(p)
            ),
        });
    }
    Ok(num_tokens - (full - p))
}

/// One head slice between two head-major pages of an entry pair.
#[derive(Debug, Clone, Copy)]
struct PageCopy {
    pair: EntryPair,
    src_item: u64,
    dst_item: u64,
    /// Byte of the slice's first head inside a source page.
    src_col: u64,
    /// Byte of the slice's first head inside a destination page.
    dst_col: u64,
    num_heads: u64,
    /// Bytes of one head of one token.
    head_bytes: u64,
}

impl PageCopy {
    /// Pushes the slice of page `ps` → `pd`: its heads' whole runs, a partial last page too.
    /// vLLM lays out the K and V rows of one head of one block in an order of its kernel's
    /// own (one for each instruction set), so only whole (block, head) runs have a layout
    /// kvbridge can name; the slots past the tokens sent are the decode request's own, which
    /// it writes before it reads them.
    fn push_page(&self, out: &mut ByteRanges, ps: u64, pd: u64, p: u64) {
        let run = p * self.head_bytes;
        let (so, doff) = (
            ps * self.src_item + self.src_col,
            pd * self.dst_item + self.dst_col,
        );
        out.push(ByteRange::new(
            self.pair.src,
            so,
            self.pair.dst,
            doff,
            self.num_heads * run,
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolFormat;

    const HB: u64 = 8; // bytes of one head of one token (K and V)

    /// A head-major pool of `entries` entries: `heads` heads per rank, pages of `p` tokens.
    fn pool(p: u64, heads: u64, entries: usize, pages: u64) -> PoolGeometry {
        PoolGeometry::builder(p)
            .num_pages(pages)
            .target_entries(&vec![heads * p * HB; entries])
            .format(PoolFormat::Mha {
                total_kv_heads: 4,
                head_dim: 4,
            })
            .build()
            .unwrap()
    }

    /// Every (src byte, dst byte) pair the ranges copy, row by row.
    fn bytes(r: &ByteRanges) -> Vec<(usize, u64, usize, u64)> {
        r.iter()
            .flat_map(|x| x.rows())
            .flat_map(|x| {
                (0..x.len)
                    .map(move |i| (x.src_entry, x.src_offset + i, x.dst_entry, x.dst_offset + i))
            })
            .collect()
    }

    /// The copies an element-by-element model of the head-major layout expects: for each
    /// global head the decode rank gets from `src_rank`, each token, each byte.
    #[allow(clippy::too_many_arguments)]
    fn expected(
        s: &HeadSharding,
        src_rank: u64,
        dst_rank: u64,
        p: u64,
        src_pages: &[u64],
        dst_pages: &[u64],
        entries: usize,
    ) -> Vec<(usize, u64, usize, u64)> {
        let (hs, hd) = (s.heads_per_src_rank(), s.heads_per_dst_rank());
        let (src_heads, dst_heads) = (
            s.src_heads(src_rank).unwrap(),
            s.dst_heads(dst_rank).unwrap(),
        );
        let mut out = Vec::new();
        for e in 0..entries {
            for g in dst_heads.clone().filter(|g| src_heads.contains(g)) {
                let (ls, ld) = (g - src_heads.start, g - dst_heads.start);
                for (&ps, &pd) in src_pages.iter().zip(dst_pages) {
                    // Every slot of every page, a partial last page's too: one head's
                    // `P · HB` bytes of a page in whatever order the engine keeps them.
                    for b in 0..p * HB {
                        out.push((
                            e,
                            (ps * hs + ls) * p * HB + b,
                            e,
                            (pd * hd + ld) * p * HB + b,
                        ));
                    }
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// Plans every decode rank of `tp_src → tp_dst` (4 KV heads) and checks the bytes each
    /// source moves against the model; returns the descriptors (ranges) per decode rank.
    fn check(tp_src: u64, tp_dst: u64, p: u64, num_tokens: u64) {
        let s = HeadSharding::new(4, tp_src, tp_dst).unwrap();
        let (src_pages, dst_pages) = ([5u64, 2, 3, 9], [1u64, 7, 8, 0]);
        let n = num_tokens.div_ceil(p) as usize;
        let (src_pages, dst_pages) = (&src_pages[..n], &dst_pages[..n]);
        let src = pool(p, s.heads_per_src_rank(), 2, 10);
        let dst = pool(p, s.heads_per_dst_rank(), 2, 10);
        let pairs = crate::identity_pairs(2);
        for dst_rank in 0..tp_dst {
            let mut got_all = Vec::new();
            let mut want_all = Vec::new();
            for source in s.sources_for(dst_rank).unwrap() {
                let pages = HeadMajorPages {
                    src_pages,
                    dst_pages,
                    num_tokens,
                };
                let r = s
                    .head_major_page_ranges(source, &src, &dst, &pairs, pages)
                    .unwrap();
                let mut got = bytes(&r);
                got.sort_unstable();
                let want = expected(&s, source.src_rank, dst_rank, p, src_pages, dst_pages, 2);
                assert_eq!(
                    got, want,
                    "tp {tp_src}->{tp_dst}, decode rank {dst_rank}, source {source:?}"
                );
                got_all.extend(got);
                want_all.extend(want);
            }
            // Every head of the decode rank, every slot of the pages sent, exactly once.
            let hd = s.heads_per_dst_rank();
            let slots_sent = n as u64 * p;
            assert_eq!(got_all.len() as u64, 2 * hd * slots_sent * HB);
            assert_eq!(got_all, want_all);
        }
    }

    #[test]
    fn tp_1_to_2_and_2_to_1_move_each_head_of_each_page_once() {
        check(1, 2, 4, 16);
        check(2, 1, 4, 16);
    }

    #[test]
    fn tp_2_to_4_and_4_to_2() {
        check(2, 4, 4, 16);
        check(4, 2, 4, 16);
        check(1, 4, 2, 8);
        check(4, 1, 2, 8);
    }

    #[test]
    fn gqa_replication_on_either_side() {
        // 4 KV heads over 8 ranks: each rank holds one head, replicated twice.
        check(8, 2, 4, 16);
        check(2, 8, 4, 16);
        check(8, 8, 4, 16);
        check(1, 8, 4, 13);
        check(8, 1, 4, 13);
    }

    #[test]
    fn a_partial_last_page_goes_whole() {
        // 14 tokens in 4 pages of 4: the last page holds 2 and is sent whole (vLLM's kernels
        // order a head's rows of a block their own way, one for each instruction set).
        for (a, b) in [(1, 2), (2, 1), (2, 4), (4, 2)] {
            check(a, b, 4, 14);
        }
        // 1 -> 2, one decode rank: the 4 pages fold into one strided range per entry.
        let s = HeadSharding::new(4, 1, 2).unwrap();
        let src = pool(4, 4, 2, 10);
        let dst = pool(4, 2, 2, 10);
        let source = s.sources_for(1).unwrap()[0];
        let pages = HeadMajorPages {
            src_pages: &[0, 1, 2, 3],
            dst_pages: &[4, 5, 6, 7],
            num_tokens: 14,
        };
        let r = s
            .head_major_page_ranges(source, &src, &dst, &crate::identity_pairs(1), pages)
            .unwrap();
        let run = 4 * HB;
        assert_eq!(
            r.as_slice(),
            [ByteRange::new(0, 2 * run, 0, 4 * 2 * run, 2 * run).with_rows(4, 4 * run, 2 * run),]
        );
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let s = HeadSharding::new(4, 1, 2).unwrap();
        let source = s.sources_for(0).unwrap()[0];
        let src = pool(4, 4, 2, 10);
        let dst = pool(4, 2, 2, 10);
        let pairs = crate::identity_pairs(2);
        let plan = |src: &PoolGeometry, dst: &PoolGeometry, sp: &[u64], dp: &[u64], t| {
            let pages = HeadMajorPages {
                src_pages: sp,
                dst_pages: dp,
                num_tokens: t,
            };
            s.head_major_page_ranges(source, src, dst, &pairs, pages)
                .unwrap_err()
                .to_string()
        };
        let e = plan(&src, &dst, &[0, 1], &[0, 1], 9);
        assert!(
            e.contains("9 tokens do not fill 2 pages of 4 tokens") && e.contains("5 to 8"),
            "{e}"
        );
        let e = plan(&src, &dst, &[0, 1], &[0, 1], 4);
        assert!(e.contains("hold 5 to 8 tokens"), "{e}");
        let e = plan(&src, &dst, &[0, 1], &[0], 8);
        assert!(e.contains("index arrays"), "{e}");
        let e = plan(&src, &dst, &[0, 10], &[0, 1], 8);
        assert!(e.contains("page id 10"), "{e}");
        let e = plan(&src, &pool(2, 2, 2, 10), &[0], &[0], 2);
        assert!(
            e.contains("equal page sizes, got prefill 4 and decode 2"),
            "{e}"
        );
        // Decode heads twice as wide as the prefill's.
        let wide = PoolGeometry::builder(4)
            .num_pages(10)
            .target_entries(&[2 * 4 * 2 * HB; 2])
            .build()
            .unwrap();
        let e = plan(&src, &wide, &[0], &[0], 4);
        assert!(e.contains("different widths"), "{e}");
        // A slice past the decode rank's 2 heads (8 bytes a head and token).
        let wide_slice = HeadSource {
            slice: HeadSlice {
                dst_head_start: 1,
                ..source.slice
            },
            ..source
        };
        let pages = HeadMajorPages {
            src_pages: &[0],
            dst_pages: &[0],
            num_tokens: 4,
        };
        let e = s
            .head_major_page_ranges(wide_slice, &src, &dst, &pairs, pages)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("slice size (24) exceeds target token slot size (16)"),
            "{e}"
        );
        let e = plan(&src, &dst, &[], &[], 3);
        assert!(e.contains("3 tokens do not fill 0 pages"), "{e}");
        let none = HeadMajorPages {
            src_pages: &[],
            dst_pages: &[],
            num_tokens: 0,
        };
        assert!(
            s.head_major_page_ranges(source, &src, &dst, &pairs, none)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn one_descriptor_row_per_page_where_token_major_needs_one_per_token() {
        // TP 1 -> 2, 4 KV heads, pages of 16 tokens, 4 scattered pages, 2 entries.
        let s = HeadSharding::new(4, 1, 2).unwrap();
        let (src, dst) = (pool(16, 4, 2, 10), pool(16, 2, 2, 10));
        let pairs = crate::identity_pairs(2);
        let (sp, dp) = ([5, 2, 3, 9], [1, 7, 8, 0]);
        let source = s.sources_for(1).unwrap()[0];
        let pages = HeadMajorPages {
            src_pages: &sp,
            dst_pages: &dp,
            num_tokens: 64,
        };
        let hm = s
            .head_major_page_ranges(source, &src, &dst, &pairs, pages)
            .unwrap();
        let tm = s.page_ranges(source, &src, &dst, &pairs, &sp, &dp).unwrap();
        assert_eq!((hm.len(), hm.row_count()), (6, 8));
        // Token-major folds its rows into as many strided ranges, but each row is one token.
        assert_eq!((tm.len(), tm.row_count()), (6, 2 * 4 * 16));
        // Adjacent pages on both sides fold into one strided range per entry.
        let pages = HeadMajorPages {
            src_pages: &[0, 1, 2, 3],
            dst_pages: &[4, 5, 6, 7],
            num_tokens: 64,
        };
        let hm = s
            .head_major_page_ranges(source, &src, &dst, &pairs, pages)
            .unwrap();
        assert_eq!((hm.len(), hm.row_count()), (2, 8));
    }
}
