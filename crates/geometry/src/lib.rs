//! kvbridge-geometry: sans-IO KV pool geometry and transfer planning.
//!
//! Decides which KV rows leave which prefill page and land in which decode row, and turns
//! that into byte-range copy descriptors. No I/O, no clocks, no async runtime, no `unsafe`;
//! nothing is allocated per token unless a caller asks for per-token arrays.
//!
//! * [`PoolGeometry`] — a side's pool: page size, ordered entries (`item_len` = bytes per
//!   page), target vs draft entries, [`PoolFormat`] (MHA/GQA heads, MLA, hybrid MLA), dtype.
//! * [`DcpPlanInput::plan`] — SGLang 0.5.23's DCP token plan (prefill DCP 1 → decode DCP `d`),
//!   target and draft rows, as arrays ([`DcpPlan::to_token_plan`]), coalesced runs
//!   ([`DcpPlan::target_runs`]) or byte ranges ([`DcpPlan::byte_ranges`]).
//! * [`ReshardPlan`] — any prefill DCP size `a` to any decode DCP size `b`, any page sizes.
//! * [`SendPages`] — the decode's page ids as both plans take them: entry 0 at the cached
//!   prefix, made from ids that start there or from a page table that starts at position 0;
//!   offsets and lengths in plan inputs count tokens.
//! * Every [`GeometryError`] names its problem code ([`GeometryError::code`], `KVB-E0nn` at the
//!   end of the message) for `kvbridge explain`.
//! * [`group_concurrent_contiguous`], [`coalesce_pairs`], [`coalesce_runs`] — run coalescing.
//! * [`page_path_ranges`], [`head_slice_ranges`], [`HeadSharding`] — non-DCP byte ranges,
//!   MHA head slicing of token-major pages; [`HeadSharding::head_major_page_ranges`] with
//!   [`HeadMajorPages`] — head slicing of head-major pages (vLLM's CPU layout).
//! * [`ByteRange`], [`ByteRanges`] — what every byte-range builder returns: strided copies
//!   (`count` rows of `len` bytes with a source and a destination stride), rows folded into
//!   progressions as they are pushed; [`ByteRanges::len`] counts ranges,
//!   [`ByteRanges::row_count`] the rows they cover.
//! * [`pair_entries_by_layer_ids`], [`pair_entries_flat_pp`], [`pair_entries_mha_pp`] —
//!   entry pairing and PP slicing.
//! * [`prepare_dcp_token_item_lens`], [`dcp_pack_buffer_bytes`] — DCP geometry check and
//!   pack-buffer sizing; [`align_prefix_down`] / [`align_prefix_up`] — prefix alignment.
//! * [`MAX_PAGE_SIZE`], [`MAX_GROUP_SIZE`], [`MAX_KV_HEADS`], [`MAX_ENTRIES`],
//!   [`MAX_CHUNK_TOKENS`] — the bounds every plan input is checked against before any work
//!   ([`GeometryError::TooLarge`]).
//!
//! ```
//! use kvbridge_geometry::{DcpPlanInput, Run, SendPages};
//! // Example A of docs/planning.md, rank 2: tokens 2 and 6 of the chunk.
//! let plan = DcpPlanInput {
//!     src_pages: &[5, 2, 11, 4],
//!     dst_pages: SendPages::after_prefix(&[7]),
//!     page_size: 2,
//!     dcp_size: 4,
//!     dcp_rank: 2,
//!     ..DcpPlanInput::default()
//! }
//! .plan()?;
//! let runs: Vec<Run> = plan.target_runs().collect();
//! assert_eq!(runs, [Run::new(4, 14, 1), Run::new(8, 15, 1)]);
//! # Ok::<(), kvbridge_geometry::GeometryError>(())
//! ```

#![forbid(unsafe_code)]

mod align;
mod bytes;
mod chunks;
mod dcp;
mod error;
mod head_major;
mod heads;
mod limits;
mod pack;
mod pages;
mod pairs;
mod pool;
mod reshard;
mod rows;
mod runs;

pub use align::{align_prefix_down, align_prefix_up, virtual_page_size};
pub use bytes::{ByteRange, ByteRanges, EntryPair, RegionRange, identity_pairs, page_path_ranges};
pub use chunks::chunk_plan;
pub use dcp::{DcpPlan, DcpPlanInput, DcpTokenPlan, PlanRuns, build_dcp_token_transfer_plan};
pub use error::{GeometryError, Result, Side};
pub use head_major::HeadMajorPages;
pub use heads::{
    HeadSharding, HeadSlice, HeadSource, compute_head_slice_params, head_slice_ranges,
};
pub use limits::{MAX_CHUNK_TOKENS, MAX_ENTRIES, MAX_GROUP_SIZE, MAX_KV_HEADS, MAX_PAGE_SIZE};
pub use pack::{dcp_pack_buffer_bytes, dcp_token_item_lens, prepare_dcp_token_item_lens};
pub use pages::SendPages;
pub use pairs::{pair_entries_by_layer_ids, pair_entries_flat_pp, pair_entries_mha_pp};
pub use pool::{Entry, EntryRole, PoolFormat, PoolGeometry, PoolGeometryBuilder, PoolKind};
pub use reshard::{ReshardInput, ReshardPlan, reshard_sources, reshard_targets};
pub use rows::SegmentRuns;
pub use runs::{
    Coalesce, PairRuns, Run, coalesce_pairs, coalesce_runs, group_concurrent_contiguous,
};
