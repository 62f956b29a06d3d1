//! The DCP token transfer plan (prefill DCP 1 → decode DCP `d`) with SGLang 0.5.23 semantics.

use crate::error::{GeometryError, Result};
use crate::limits;
use crate::pages::SendPages;
use crate::rows::{Fault, Progression, SegmentRuns};
use crate::runs::Run;

/// Inputs of one chunk's DCP token plan. Build with struct-update syntax; every offset and
/// length counts **tokens** (as in [`crate::ReshardInput`]), and the decode's page ids say where
/// they start ([`SendPages`]):
///
/// ```
/// use kvbridge_geometry::{DcpPlanInput, SendPages};
/// let plan = DcpPlanInput {
///     src_pages: &[5, 2, 11, 4],
///     dst_pages: SendPages::after_prefix(&[7]),
///     page_size: 2,
///     dcp_size: 4,
///     dcp_rank: 1,
///     ..DcpPlanInput::default()
/// }
/// .plan()
/// .unwrap();
/// let tokens = plan.to_token_plan();
/// assert_eq!(tokens.target_src, [11, 23]);
/// assert_eq!(tokens.target_dst, [14, 15]);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DcpPlanInput<'a> {
    /// `S`: prefill page ids of this chunk (page size `page_size`).
    pub src_pages: &'a [u64],
    /// `D`: decode **virtual** page ids of the whole send range (one per `page_size · dcp_size`
    /// tokens), entry 0 at position `decode_prefix_len`; never sliced per chunk.
    pub dst_pages: SendPages<'a>,
    /// `P`: physical page size, equal on both sides.
    pub page_size: u64,
    /// `d`: decode DCP size.
    pub dcp_size: u64,
    /// `r`: the destination's DCP rank.
    pub dcp_rank: u64,
    /// Tokens of the send range sent before this chunk; a multiple of `P` (SGLang's
    /// `src_page_offset` is `chunk_start / P`).
    pub chunk_start: u64,
    /// `L`: tokens the decode already holds; must be a multiple of `P · d`.
    pub decode_prefix_len: u64,
    /// `n`: tokens in this chunk; `None` means `|S| · P`.
    pub num_kv_tokens: Option<u64>,
}

impl<'a> DcpPlanInput<'a> {
    /// Validates the inputs (the contract in docs/planning.md, "Prefill DCP 1 → decode DCP d")
    /// and returns the plan.
    ///
    /// Order: `P = 0`, `d = 0`, `r ≥ d`, `P` and `d` above their maxima up front; then (1)
    /// prefix alignment (0.5.23 text), `chunk_start` a multiple of `P`; (2) `n == 0` → empty
    /// plan, no further checks;
    /// (3) `n > |S|·P` (seed capacity text), `n >` [`crate::MAX_CHUNK_TOKENS`];
    /// (4) `|D| < ceil((chunk_start + n) / V)` (`Insufficient destination DCP pages`, with the 0.5.23
    /// requirement, which covers the draft rows).
    ///
    /// # Errors
    /// [`GeometryError::ZeroPageSize`], [`GeometryError::ZeroDcpSize`],
    /// [`GeometryError::DcpRankOutOfRange`], [`GeometryError::PrefixMisaligned`],
    /// [`GeometryError::ChunkStartMisaligned`],
    /// [`GeometryError::SrcCapacity`], [`GeometryError::DstInsufficient`],
    /// [`GeometryError::Overflow`], [`GeometryError::TooLarge`].
    pub fn plan(&self) -> Result<DcpPlan<'a>> {
        let v = self.virtual_page_and_alignment()?;
        let capacity = (self.src_pages.len() as u64)
            .checked_mul(self.page_size)
            .ok_or(GeometryError::Overflow {
                what: "|src_pages| x page_size",
            })?;
        //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan test: test_plan_matches_sglang_on_random_inputs
        //# if num_kv_tokens is None:
        //# num_kv_tokens = src_pages.size * physical_page_size
        let n = self.num_kv_tokens.unwrap_or(capacity);
        let empty = DcpPlan {
            input: *self,
            num_tokens: 0,
            target: Progression::empty(),
            draft: Progression::empty(),
        };
        //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan test: every_case_matches_arrays_or_error_text
        //# if num_kv_tokens == 0:
        if n == 0 {
            return Ok(empty);
        }
        self.check_chunk(n, capacity, v)?;
        let (target, draft) = self.progressions(n, v);
        for prog in [&target, &draft] {
            // Unreachable after the checks above; kept as errors, never panics.
            prog.check()
                .map_err(|fault| self.fault_error(fault, n, capacity))?;
        }
        Ok(DcpPlan {
            num_tokens: n,
            target,
            draft,
            ..empty
        })
    }

    /// The checks made up front and step (1): sizes, the rank, the maxima, prefix and chunk
    /// start alignment. Returns the virtual page size `V = P·d`.
    fn virtual_page_and_alignment(&self) -> Result<u64> {
        let (p, d, r) = (self.page_size, self.dcp_size, self.dcp_rank);
        if p == 0 {
            return Err(GeometryError::ZeroPageSize { page_size: p });
        }
        if d == 0 {
            return Err(GeometryError::ZeroDcpSize { dcp_size: d });
        }
        if r >= d {
            return Err(GeometryError::DcpRankOutOfRange {
                dcp_rank: r,
                dcp_size: d,
            });
        }
        limits::page_size("page_size", p)?;
        limits::group_size("dcp_size", d)?;
        //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan test: worked_example_b_second_chunk_with_prefix
        //# virtual_page_size = physical_page_size * dcp_size
        let v = p.checked_mul(d).ok_or(GeometryError::Overflow {
            what: "page_size x dcp_size",
        })?;
        let l = self.decode_prefix_len;
        //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan test: error_examples_d_and_up_front_rejections, every_case_matches_arrays_or_error_text
        //# if decode_prefix_len % virtual_page_size != 0:
        if l % v != 0 {
            return Err(GeometryError::PrefixMisaligned {
                virtual_page_size: v,
                decode_prefix_len: l,
            });
        }
        if self.chunk_start % p != 0 {
            return Err(GeometryError::ChunkStartMisaligned {
                chunk_start: self.chunk_start,
                page_size: p,
            });
        }
        Ok(v)
    }

    /// Steps (3) and (4) for a chunk of `n > 0` tokens: the source pages hold it, the decode
    /// has the virtual pages it ends in.
    fn check_chunk(&self, n: u64, capacity: u64, v: u64) -> Result<()> {
        if n > capacity {
            return Err(GeometryError::SrcCapacity {
                tokens: n,
                capacity,
            });
        }
        limits::chunk_tokens("num_kv_tokens", n)?;
        let rel_end = self
            .chunk_start
            .checked_add(n)
            .ok_or(GeometryError::Overflow {
                what: "send range end",
            })?;
        let required = rel_end.div_ceil(v);
        if (self.dst_pages.as_slice().len() as u64) < required {
            return Err(self.dst_insufficient(required));
        }
        Ok(())
    }

    fn dst_insufficient(&self, required: u64) -> GeometryError {
        GeometryError::DstInsufficient {
            required,
            provided: self.dst_pages.as_slice().len() as u64,
            src_page_offset: self.chunk_start / self.page_size,
            dcp_rank: self.dcp_rank,
        }
    }

    /// The rows of a validated chunk of `n > 0` tokens: this rank's target rows (every `d`-th
    /// chunk token it owns, to consecutive local rows) and every draft row.
    fn progressions(&self, n: u64, v: u64) -> (Progression<'a>, Progression<'a>) {
        let (p, d, r) = (self.page_size, self.dcp_size, self.dcp_rank);
        let (l, sent) = (self.decode_prefix_len, self.chunk_start);
        let dst_pages = self.dst_pages.as_slice();
        let chunk_start = (l % d + sent % d) % d;
        //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan test: target_rows_of_all_ranks_partition_the_chunk, test_plan_matches_sglang_on_random_inputs
        //# chunk_start = decode_prefix_len + src_page_offset * physical_page_size
        //# target_offsets = np.arange(
        //# (dcp_rank - chunk_start) % dcp_size,
        let first = (r + d - chunk_start) % d;
        let target_count = if first < n {
            (n - first - 1) / d + 1
        } else {
            0
        };
        let target = Progression {
            src_pages: self.src_pages,
            src_page_size: p,
            src_row0: first,
            src_step: d,
            dst_pages,
            dst_page_size: p,
            //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan test: worked_example_b_second_chunk_with_prefix
            //# target_local = (src_page_offset * physical_page_size + target_offsets) // dcp_size
            dst_row0: (sent + first) / d,
            dst_step: 1,
            count: target_count,
        };
        let draft = Progression {
            src_pages: self.src_pages,
            src_page_size: p,
            src_row0: 0,
            src_step: 1,
            dst_pages,
            //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan test: worked_example_c_last_chunk_mid_page_and_chunk_invariance
            //# draft_src, draft_dst = rows(draft_offsets, virtual_page_size, draft_local)
            dst_page_size: v,
            //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan test: worked_example_c_last_chunk_mid_page_and_chunk_invariance
            //# draft_local = src_page_offset * physical_page_size + draft_offsets
            dst_row0: sent,
            dst_step: 1,
            count: n,
        };
        (target, draft)
    }

    fn fault_error(&self, fault: Fault, n: u64, capacity: u64) -> GeometryError {
        match fault {
            Fault::SrcPages(_) => GeometryError::SrcCapacity {
                tokens: n,
                capacity,
            },
            Fault::DstPages(required) => self.dst_insufficient(required),
            Fault::Overflow => GeometryError::Overflow {
                what: "page id x page size",
            },
        }
    }
}

/// A validated DCP token plan for one chunk and one destination rank.
///
/// Nothing per token is stored: rows are generated on demand, page by page. Use
/// [`DcpPlan::target_runs`] / [`DcpPlan::draft_runs`] for coalesced runs without per-token
/// arrays, [`DcpPlan::to_token_plan`] for SGLang's four arrays.
#[derive(Debug, Clone, Copy)]
pub struct DcpPlan<'a> {
    input: DcpPlanInput<'a>,
    num_tokens: u64,
    target: Progression<'a>,
    draft: Progression<'a>,
}

/// Iterator of coalesced runs of a plan.
pub type PlanRuns<'a> = SegmentRuns<'a>;

impl<'a> DcpPlan<'a> {
    /// The inputs the plan was built from.
    #[must_use]
    pub fn input(&self) -> &DcpPlanInput<'a> {
        &self.input
    }

    /// Tokens in the chunk (`n`).
    #[must_use]
    pub fn num_tokens(&self) -> u64 {
        self.num_tokens
    }

    /// Target rows owned by the destination rank in this chunk.
    #[must_use]
    pub fn target_len(&self) -> u64 {
        self.target.count
    }

    /// Draft rows (every token of the chunk).
    #[must_use]
    pub fn draft_len(&self) -> u64 {
        self.draft.count
    }

    /// Whether the plan moves nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.num_tokens == 0
    }

    /// Coalesced target runs `(src_row, dst_row, len)`, identical to
    /// `group_concurrent_contiguous(target_src, target_dst)`; no per-token allocation.
    #[must_use]
    pub fn target_runs(&self) -> PlanRuns<'a> {
        self.target.runs()
    }

    /// [`DcpPlan::target_runs`] collected into a vector (through internal iteration, which is
    /// several times faster than `collect()` on strided plans).
    #[must_use]
    pub fn target_runs_vec(&self) -> Vec<Run> {
        let mut out = Vec::new();
        self.target_runs().for_each(|r| out.push(r));
        out
    }

    /// Coalesced draft runs (draft destination rows use page size `P · d`).
    #[must_use]
    pub fn draft_runs(&self) -> PlanRuns<'a> {
        self.draft.runs()
    }

    /// Target `(src_row, dst_row)` pairs in ascending chunk order.
    pub fn target_pairs(&self) -> impl Iterator<Item = (u64, u64)> + 'a {
        let runs = self.target.runs();
        runs.flat_map(Run::pairs)
    }

    /// Draft `(src_row, dst_row)` pairs in ascending chunk order.
    pub fn draft_pairs(&self) -> impl Iterator<Item = (u64, u64)> + 'a {
        let runs = self.draft.runs();
        runs.flat_map(Run::pairs)
    }

    /// The target arrays `(target_src, target_dst)`.
    #[must_use]
    pub fn target_arrays(&self) -> (Vec<u64>, Vec<u64>) {
        let (mut s, mut d) = (Vec::new(), Vec::new());
        self.target.extend_arrays(&mut s, &mut d);
        (s, d)
    }

    /// The draft arrays `(draft_src, draft_dst)`.
    #[must_use]
    pub fn draft_arrays(&self) -> (Vec<u64>, Vec<u64>) {
        let (mut s, mut d) = (Vec::new(), Vec::new());
        self.draft.extend_arrays(&mut s, &mut d);
        (s, d)
    }

    /// Writes SGLang's four arrays into `out`, reusing its capacity (clears it first), so a
    /// caller planning many chunks allocates once.
    pub fn fill_token_plan(&self, out: &mut DcpTokenPlan) {
        out.target_src.clear();
        out.target_dst.clear();
        out.draft_src.clear();
        out.draft_dst.clear();
        self.target
            .extend_arrays(&mut out.target_src, &mut out.target_dst);
        self.draft
            .extend_arrays(&mut out.draft_src, &mut out.draft_dst);
    }

    /// SGLang's four arrays.
    #[must_use]
    pub fn to_token_plan(&self) -> DcpTokenPlan {
        let (target_src, target_dst) = self.target_arrays();
        let (draft_src, draft_dst) = self.draft_arrays();
        DcpTokenPlan {
            target_src,
            target_dst,
            draft_src,
            draft_dst,
        }
    }
}

/// The materialised per-token plan: SGLang's `DCPTokenTransferPlan`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct DcpTokenPlan {
    /// Prefill token rows of the target KV owned by the destination rank.
    pub target_src: Vec<u64>,
    /// Rows in the destination rank's target pool (page size `P`).
    pub target_dst: Vec<u64>,
    /// Prefill token rows of the draft KV (every token of the chunk).
    pub draft_src: Vec<u64>,
    /// Rows in the destination's draft pool (page size `P · d`).
    pub draft_dst: Vec<u64>,
}

/// `build_dcp_token_transfer_plan`: validates and materialises the four arrays.
///
/// # Errors
/// As [`DcpPlanInput::plan`].
pub fn build_dcp_token_transfer_plan(input: &DcpPlanInput<'_>) -> Result<DcpTokenPlan> {
    Ok(input.plan()?.to_token_plan())
}

impl DcpPlan<'_> {
    /// Byte ranges of this plan (docs/planning.md, "Prefill DCP 1 → decode DCP d"): for every entry pair whose source is a target
    /// entry, the coalesced target runs at `row · token_bytes`; for every pair whose source is
    /// a draft entry, the draft runs. Pairs are walked in the given order (entry-major), and
    /// the empty plan posts nothing.
    ///
    /// `src` is the prefill pool (page size `P`); `dst` the decode pool: target entries of
    /// page size `P`, draft entries holding `P · d` rows per page (`item_len = P·d·token_bytes`).
    ///
    /// # Errors
    /// [`GeometryError::InvalidGeometry`] when a pool's page size is not the plan's `P`;
    /// [`GeometryError::EntryOutOfRange`]; [`GeometryError::WidthMismatch`] when paired token
    /// widths differ (the per-pair form of the DCP geometry check); [`GeometryError::PageOutOfRange`].
    pub fn byte_ranges(
        &self,
        src: &crate::PoolGeometry,
        dst: &crate::PoolGeometry,
        pairs: &[crate::EntryPair],
    ) -> Result<crate::ByteRanges> {
        use crate::bytes::{RowCopy, pair_item_lens};
        use crate::pool::EntryRole;
        let p = self.input.page_size;
        let d = self.input.dcp_size;
        for (pool, side) in [(src, "prefill"), (dst, "decode")] {
            if pool.page_size() != p {
                return Err(GeometryError::InvalidGeometry {
                    reason: format!(
                        "the {side} pool has page_size={} but the DCP plan uses page_size={p}; \
                         both peers must use the plan's physical page size",
                        pool.page_size()
                    ),
                });
            }
        }
        let mut out = crate::ByteRanges::new();
        if self.is_empty() {
            return Ok(out);
        }
        let used_src = self.num_tokens.div_ceil(p) as usize;
        src.check_pages(crate::Side::Prefill, &self.input.src_pages[..used_src])?;
        let (_, last_dst) = self.draft.last_rows().unwrap_or((0, 0));
        let used_dst = (last_dst / (p * d) + 1) as usize;
        dst.check_pages(
            crate::Side::Decode,
            &self.input.dst_pages.as_slice()[..used_dst],
        )?;
        for &pair in pairs {
            let (s_len, d_len) = pair_item_lens(src, dst, pair)?;
            let draft = src.entries()[pair.src].role == EntryRole::Draft;
            let src_w = s_len / p;
            let dst_w = if draft { d_len / (p * d) } else { d_len / p };
            if src_w != dst_w || (draft && d_len % (p * d) != 0) {
                return Err(GeometryError::WidthMismatch {
                    src_entry: pair.src,
                    dst_entry: pair.dst,
                    src_bytes: src_w,
                    dst_bytes: dst_w,
                    unit: "token",
                });
            }
            let copy = RowCopy::whole(pair, src_w);
            let rows = if draft { &self.draft } else { &self.target };
            copy.push_segments(&mut out, rows.segments());
        }
        Ok(out)
    }
}
