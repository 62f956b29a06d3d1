//! Any-to-any DCP resharding: prefill DCP size `a` → decode DCP size `b`, any physical page
//! sizes on each side, chunked, with an aligned decode prefix.
//!
//! Owner rule on both sides: prefill rank `a_r` holds absolute position `p` iff
//! `p mod a == a_r`, at rank-local row `p div a`; decode rank `b_r` needs `p` iff
//! `p mod b == b_r`, at rank-local row `p div b`. A (prefill rank, decode rank) pair therefore
//! moves exactly the positions with `p ≡ a_r (mod a)` and `p ≡ b_r (mod b)`: none when
//! `a_r ≢ b_r (mod gcd(a, b))`, otherwise one position every `lcm(a, b)`, with source rows
//! stepping by `lcm/a` and destination rows by `lcm/b`.
//!
//! Page tables:
//! * decode: `dst_pages` are the decode's **virtual** page ids (`V2 = P2·b` tokens each) of the
//!   whole send range; `dst_pages[0]` starts at position `decode_prefix_len` (a multiple of
//!   `V2`), so rank `b_r`'s row for `p` is `D[x div P2]·P2 + x mod P2`, `x = (p − L) div b`;
//! * prefill: `src_pages` are the prefill rank's own page ids for this chunk (page size `P1`):
//!   `src_pages[0]` is the page holding the rank-local row `(L + chunk_start) div a`, so the
//!   row for `p` is `S[y div P1]·P1 + y mod P1` with `y = p div a − base` and `base` that
//!   page's first row. With `a = 1` and `P1 = P2` this is exactly SGLang's DCP token plan
//!   (target rows); with `a = b` and equal page sizes it moves the same rows as the page path.

use crate::bytes::{ByteRanges, EntryPair, RowCopy, pair_item_lens};
use crate::error::{GeometryError, Result, Side};
use crate::limits;
use crate::pages::SendPages;
use crate::pool::{EntryRole, PoolGeometry};
use crate::rows::{Fault, Progression};

fn gcd(mut x: u64, mut y: u64) -> u64 {
    while y != 0 {
        (x, y) = (y, x % y);
    }
    x
}

/// Prefill ranks (of `prefill_dcp`) that hold rows decode rank `decode_rank` (of `decode_dcp`)
/// needs: the `a / gcd(a, b)` ranks with `a_r ≡ b_r (mod gcd(a, b))`. This is how many
/// responses the decode rank waits for.
///
/// ```
/// use kvbridge_geometry::reshard_sources;
/// assert_eq!(reshard_sources(2, 4, 3).unwrap(), [1]);
/// assert_eq!(reshard_sources(4, 2, 1).unwrap(), [1, 3]);
/// assert_eq!(reshard_sources(4, 1, 0).unwrap(), [0, 1, 2, 3]);
/// ```
///
/// # Errors
/// [`GeometryError::ZeroDcpSize`], [`GeometryError::DcpRankOutOfRange`],
/// [`GeometryError::TooLarge`] (a size above [`crate::MAX_GROUP_SIZE`]).
pub fn reshard_sources(prefill_dcp: u64, decode_dcp: u64, decode_rank: u64) -> Result<Vec<u64>> {
    check_group(prefill_dcp, 0)?;
    check_group(decode_dcp, decode_rank)?;
    let g = gcd(prefill_dcp, decode_dcp);
    // Stepping by g visits only the ranks returned: work linear in the answer.
    Ok((decode_rank % g..prefill_dcp).step_by(step(g)).collect())
}

/// `g` as an iterator step (`g ≤ MAX_GROUP_SIZE`, checked by the callers).
fn step(g: u64) -> usize {
    usize::try_from(g).unwrap_or(usize::MAX)
}

/// Decode ranks (of `decode_dcp`) that prefill rank `prefill_rank` sends to: the
/// `b / gcd(a, b)` ranks with `b_r ≡ a_r (mod gcd(a, b))`.
///
/// # Errors
/// [`GeometryError::ZeroDcpSize`], [`GeometryError::DcpRankOutOfRange`],
/// [`GeometryError::TooLarge`] (a size above [`crate::MAX_GROUP_SIZE`]).
pub fn reshard_targets(prefill_dcp: u64, decode_dcp: u64, prefill_rank: u64) -> Result<Vec<u64>> {
    check_group(prefill_dcp, prefill_rank)?;
    check_group(decode_dcp, 0)?;
    let g = gcd(prefill_dcp, decode_dcp);
    Ok((prefill_rank % g..decode_dcp).step_by(step(g)).collect())
}

fn check_group(size: u64, rank: u64) -> Result<()> {
    if size == 0 {
        return Err(GeometryError::ZeroDcpSize { dcp_size: size });
    }
    // Before the rank loops of `reshard_sources` / `reshard_targets` and the plan's search.
    limits::group_size("dcp_size", size)?;
    if rank >= size {
        return Err(GeometryError::DcpRankOutOfRange {
            dcp_rank: rank,
            dcp_size: size,
        });
    }
    Ok(())
}

/// Inputs of one chunk's resharding plan for one (prefill rank, decode rank) pair. Build with
/// struct-update syntax from `ReshardInput::default()`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReshardInput<'a> {
    /// The prefill rank's page ids for this chunk (page size `src_page_size`); the first one
    /// holds rank-local row `(decode_prefix_len + chunk_start) div src_dcp_size`.
    pub src_pages: &'a [u64],
    /// The decode's virtual page ids of the whole send range (`dst_page_size · dst_dcp_size`
    /// tokens each), entry 0 at position `decode_prefix_len`; never sliced per chunk.
    pub dst_pages: SendPages<'a>,
    /// `P1`: prefill physical page size.
    pub src_page_size: u64,
    /// `P2`: decode physical page size.
    pub dst_page_size: u64,
    /// `a`: prefill DCP size (1 = no DCP on the prefill).
    pub src_dcp_size: u64,
    /// `a_r`: the sending prefill rank.
    pub src_dcp_rank: u64,
    /// `b`: decode DCP size.
    pub dst_dcp_size: u64,
    /// `b_r`: the receiving decode rank.
    pub dst_dcp_rank: u64,
    /// `L`: tokens the decode already holds; a multiple of `P2 · b`.
    pub decode_prefix_len: u64,
    /// Tokens of the send range sent before this chunk (the same unit and name as
    /// [`crate::DcpPlanInput::chunk_start`]; any value, chunks may start mid-page).
    pub chunk_start: u64,
    /// Tokens in this chunk.
    pub num_tokens: u64,
}

impl<'a> ReshardInput<'a> {
    /// Validates and returns the plan.
    ///
    /// # Errors
    /// [`GeometryError::ZeroPageSize`], [`GeometryError::ZeroDcpSize`],
    /// [`GeometryError::DcpRankOutOfRange`], [`GeometryError::PrefixMisaligned`] (the decode
    /// virtual page `P2·b`), [`GeometryError::ReshardPagesInsufficient`] (the prefill rank's
    /// pages must cover every row it owns in the chunk; the decode's pages must cover the
    /// send range up to the chunk's end), [`GeometryError::Overflow`],
    /// [`GeometryError::TooLarge`] (page sizes, DCP sizes or `num_tokens` above their maxima).
    pub fn plan(&self) -> Result<ReshardPlan<'a>> {
        let v2 = self.check_sizes()?;
        let (start, end, lcm) = self.chunk_bounds()?;
        let mut plan = ReshardPlan {
            input: *self,
            prog: Progression::empty(),
        };
        if self.num_tokens == 0 {
            return Ok(plan);
        }
        let first_a = self.check_coverage(start, end, v2)?;
        let Some(p0) = self.first_position(first_a, end) else {
            return Ok(plan);
        };
        let (a, b) = (self.src_dcp_size, self.dst_dcp_size);
        plan.prog = Progression {
            src_pages: self.src_pages,
            src_page_size: self.src_page_size,
            src_row0: p0 / a - self.src_base(start),
            src_step: lcm / a,
            dst_pages: self.dst_pages.as_slice(),
            dst_page_size: self.dst_page_size,
            dst_row0: p0 / b - self.decode_prefix_len / b,
            dst_step: lcm / b,
            count: (end - 1 - p0) / lcm + 1,
        };
        match plan.prog.check() {
            Ok(()) => Ok(plan),
            Err(Fault::SrcPages(required)) => Err(self.pages_insufficient(Side::Prefill, required)),
            Err(Fault::DstPages(required)) => Err(self.pages_insufficient(Side::Decode, required)),
            Err(Fault::Overflow) => Err(GeometryError::Overflow {
                what: "page id x page size",
            }),
        }
    }

    /// Page sizes, DCP groups and `num_tokens` against zero and their maxima, and the prefix
    /// alignment. Returns the decode's virtual page size `V2 = P2·b`.
    fn check_sizes(&self) -> Result<u64> {
        let (p1, p2) = (self.src_page_size, self.dst_page_size);
        for (field, p) in [("src_page_size", p1), ("dst_page_size", p2)] {
            if p == 0 {
                return Err(GeometryError::ZeroPageSize { page_size: p });
            }
            limits::page_size(field, p)?;
        }
        check_group(self.src_dcp_size, self.src_dcp_rank)?;
        check_group(self.dst_dcp_size, self.dst_dcp_rank)?;
        limits::chunk_tokens("num_tokens", self.num_tokens)?;
        let v2 = p2
            .checked_mul(self.dst_dcp_size)
            .ok_or(GeometryError::Overflow {
                what: "page_size x dcp_size",
            })?;
        let l = self.decode_prefix_len;
        if l % v2 != 0 {
            return Err(GeometryError::PrefixMisaligned {
                virtual_page_size: v2,
                decode_prefix_len: l,
            });
        }
        Ok(v2)
    }

    /// The chunk's absolute positions `[start, end)` and `lcm(a, b)`, the step between the
    /// positions one pair moves.
    fn chunk_bounds(&self) -> Result<(u64, u64, u64)> {
        let overflow = |what| GeometryError::Overflow { what };
        let start = self
            .decode_prefix_len
            .checked_add(self.chunk_start)
            .ok_or(overflow("chunk start"))?;
        let end = start
            .checked_add(self.num_tokens)
            .ok_or(overflow("chunk end"))?;
        let (a, b) = (self.src_dcp_size, self.dst_dcp_size);
        let lcm = (a / gcd(a, b))
            .checked_mul(b)
            .ok_or(overflow("lcm of DCP sizes"))?;
        Ok((start, end, lcm))
    }

    /// The prefill rank's local row at the first page of its `src_pages`.
    fn src_base(&self, start: u64) -> u64 {
        let p1 = self.src_page_size;
        (start / self.src_dcp_size) / p1 * p1
    }

    /// The prefill rank's pages cover every row it owns in the chunk, and the decode's pages the
    /// send range up to the end of the chunk. Returns the first position the prefill rank owns.
    fn check_coverage(&self, start: u64, end: u64, v2: u64) -> Result<u64> {
        let (a, ar) = (self.src_dcp_size, self.src_dcp_rank);
        let first_a = start + (ar + a - start % a) % a;
        if first_a < end {
            let last_a = end - 1 - (end - 1 - first_a) % a;
            let required = (last_a / a - self.src_base(start)) / self.src_page_size + 1;
            if (self.src_pages.len() as u64) < required {
                return Err(self.pages_insufficient(Side::Prefill, required));
            }
        }
        let required = (end - self.decode_prefix_len).div_ceil(v2);
        if (self.dst_pages.len() as u64) < required {
            return Err(self.pages_insufficient(Side::Decode, required));
        }
        Ok(first_a)
    }

    /// The first position before `end` that the prefill rank holds and the decode rank needs:
    /// the smallest `p ≥ first_a` with `p ≡ a_r (mod a)` and `p ≡ b_r (mod b)`, found in at most
    /// `lcm/a ≤ b` steps. `None` when the pair moves nothing in this chunk.
    fn first_position(&self, first_a: u64, end: u64) -> Option<u64> {
        let (a, ar, b, br) = (
            self.src_dcp_size,
            self.src_dcp_rank,
            self.dst_dcp_size,
            self.dst_dcp_rank,
        );
        let g = gcd(a, b);
        if ar % g != br % g || first_a >= end {
            return None;
        }
        let mut p0 = first_a;
        while p0 % b != br {
            p0 += a;
        }
        (p0 < end).then_some(p0)
    }

    fn pages_insufficient(&self, side: Side, required: u64) -> GeometryError {
        let (rank, provided) = match side {
            Side::Prefill => (self.src_dcp_rank, self.src_pages.len()),
            Side::Decode => (self.dst_dcp_rank, self.dst_pages.len()),
        };
        GeometryError::ReshardPagesInsufficient {
            side,
            rank,
            required,
            provided: provided as u64,
        }
    }
}

/// The validated rows one (prefill rank, decode rank) pair moves in one chunk, generated on
/// demand (nothing per token is stored).
#[derive(Debug, Clone, Copy)]
pub struct ReshardPlan<'a> {
    input: ReshardInput<'a>,
    prog: Progression<'a>,
}

impl<'a> ReshardPlan<'a> {
    /// The inputs.
    #[must_use]
    pub fn input(&self) -> &ReshardInput<'a> {
        &self.input
    }

    /// Rows moved by this pair.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.prog.count
    }

    /// Whether the pair moves nothing in this chunk.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.prog.count == 0
    }

    /// Coalesced runs `(src_row, dst_row, len)` (`group_concurrent_contiguous` semantics).
    #[must_use]
    pub fn runs(&self) -> crate::PlanRuns<'a> {
        self.prog.runs()
    }

    /// [`ReshardPlan::runs`] collected into a vector (through internal iteration).
    #[must_use]
    pub fn runs_vec(&self) -> Vec<crate::Run> {
        let mut out = Vec::new();
        self.runs().for_each(|r| out.push(r));
        out
    }

    /// `(src_row, dst_row)` pairs in ascending position order.
    pub fn pairs(&self) -> impl Iterator<Item = (u64, u64)> + 'a {
        self.prog.runs().flat_map(crate::Run::pairs)
    }

    /// Absolute sequence positions moved, ascending (for checks and diagnostics).
    pub fn positions(&self) -> impl Iterator<Item = u64> + 'a {
        let i = self.input;
        let (a, b) = (i.src_dcp_size, i.dst_dcp_size);
        let lcm = a / gcd(a, b) * b;
        let p0 = self.prog.dst_row0 * b + i.decode_prefix_len + i.dst_dcp_rank;
        (0..self.prog.count).map(move |j| p0 + j * lcm)
    }

    /// The per-row arrays `(src_rows, dst_rows)`.
    #[must_use]
    pub fn arrays(&self) -> (Vec<u64>, Vec<u64>) {
        let (mut s, mut d) = (Vec::new(), Vec::new());
        self.prog.extend_arrays(&mut s, &mut d);
        (s, d)
    }

    /// Byte ranges for target entries: for every entry pair (entry-major) and every run,
    /// `(s0·w, d0·w, len·w)` with `w` the token width, which must be equal on both sides
    /// (`src item_len / P1 == dst item_len / P2`).
    ///
    /// # Errors
    /// [`GeometryError::InvalidGeometry`] for page sizes differing from the plan's or a draft
    /// entry in `pairs` (draft KV is not resharded; use [`crate::DcpPlan`] for prefill DCP 1);
    /// [`GeometryError::EntryOutOfRange`], [`GeometryError::WidthMismatch`],
    /// [`GeometryError::PageOutOfRange`].
    pub fn byte_ranges(
        &self,
        src: &PoolGeometry,
        dst: &PoolGeometry,
        pairs: &[EntryPair],
    ) -> Result<ByteRanges> {
        self.ranges(src, dst, pairs, |pair, sw, dw| {
            if sw != dw {
                return Err(GeometryError::WidthMismatch {
                    src_entry: pair.src,
                    dst_entry: pair.dst,
                    src_bytes: sw,
                    dst_bytes: dw,
                    unit: "token",
                });
            }
            Ok(RowCopy::whole(pair, sw))
        })
    }

    /// Byte ranges of one head slice (MHA/GQA with different attention TP sizes, see
    /// [`crate::HeadSharding::sources_for`]) over this plan's rows; head bytes
    /// `hb = dst token width / heads per decode rank` must also equal
    /// `src token width / heads per prefill rank`.
    ///
    /// # Errors
    /// As [`ReshardPlan::byte_ranges`], plus [`GeometryError::HeadSliceTooWide`].
    pub fn head_byte_ranges(
        &self,
        src: &PoolGeometry,
        dst: &PoolGeometry,
        pairs: &[EntryPair],
        sharding: &crate::HeadSharding,
        source: crate::HeadSource,
    ) -> Result<ByteRanges> {
        self.ranges(src, dst, pairs, |pair, sw, dw| {
            let hb = dw / sharding.heads_per_dst_rank();
            let hs = sw / sharding.heads_per_src_rank();
            if hb != hs {
                return Err(GeometryError::WidthMismatch {
                    src_entry: pair.src,
                    dst_entry: pair.dst,
                    src_bytes: hs,
                    dst_bytes: hb,
                    unit: "head per token",
                });
            }
            crate::heads::head_copy(pair, sw, dw, source.slice, hb)
        })
    }

    fn ranges(
        &self,
        src: &PoolGeometry,
        dst: &PoolGeometry,
        pairs: &[EntryPair],
        copy: impl Fn(EntryPair, u64, u64) -> Result<RowCopy>,
    ) -> Result<ByteRanges> {
        let i = &self.input;
        for (pool, want, side) in [
            (src, i.src_page_size, "prefill"),
            (dst, i.dst_page_size, "decode"),
        ] {
            if pool.page_size() != want {
                return Err(GeometryError::InvalidGeometry {
                    reason: format!(
                        "the {side} pool has page_size={} but the plan uses {want}; plan with the \
                         pools' physical page sizes",
                        pool.page_size()
                    ),
                });
            }
        }
        let mut copies = Vec::with_capacity(pairs.len());
        for &pair in pairs {
            let (s_len, d_len) = pair_item_lens(src, dst, pair)?;
            if src.entries()[pair.src].role == EntryRole::Draft
                || dst.entries()[pair.dst].role == EntryRole::Draft
            {
                return Err(GeometryError::InvalidGeometry {
                    reason: format!(
                        "entry pair {}->{} involves a draft entry; resharding moves target KV \
                         only (plan draft KV with DcpPlan when the prefill has no DCP)",
                        pair.src, pair.dst
                    ),
                });
            }
            copies.push(copy(
                pair,
                s_len / i.src_page_size,
                d_len / i.dst_page_size,
            )?);
        }
        let mut out = ByteRanges::new();
        if self.is_empty() {
            return Ok(out);
        }
        let (last_s, last_d) = self.prog.last_rows().unwrap_or((0, 0));
        let first_s = (self.prog.src_row0 / i.src_page_size) as usize;
        let first_d = (self.prog.dst_row0 / i.dst_page_size) as usize;
        let used_s = (last_s / i.src_page_size + 1) as usize;
        let used_d = (last_d / i.dst_page_size + 1) as usize;
        src.check_pages(Side::Prefill, &i.src_pages[first_s..used_s])?;
        dst.check_pages(Side::Decode, &i.dst_pages.as_slice()[first_d..used_d])?;
        for c in &copies {
            c.push_segments(&mut out, self.prog.segments());
        }
        Ok(out)
    }
}
