//! The crate's single error type.

/// Which side of a transfer a value belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The sender (prefill).
    Prefill,
    /// The receiver (decode).
    Decode,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        })
    }
}

/// Everything the planner can refuse.
///
/// Messages say what was wrong, the values seen and how to fix it. Texts SGLang 0.5.23 defines
/// (`PD DCP transfer requires decode_prefix_len to align …`,
/// `Insufficient destination DCP pages: …`, …) appear word for word at the start of the
/// message; a remedy may follow after `; `.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GeometryError {
    /// A page size of zero.
    #[error(
        "page_size must be positive, got {page_size}; pass the KV pool's tokens per page (KVB-E021)"
    )]
    ZeroPageSize {
        /// The page size seen.
        page_size: u64,
    },
    /// A DCP (or prefill DCP) size of zero.
    #[error(
        "dcp_size must be positive, got {dcp_size}; use 1 when context parallelism is off (KVB-E021)"
    )]
    ZeroDcpSize {
        /// The DCP size seen.
        dcp_size: u64,
    },
    /// A DCP rank outside `0..dcp_size`.
    #[error(
        "dcp_rank must be below dcp_size, got dcp_rank={dcp_rank} with dcp_size={dcp_size}; \
         pass the destination's rank inside its DCP group (KVB-E022)"
    )]
    DcpRankOutOfRange {
        /// The rank seen.
        dcp_rank: u64,
        /// The group size seen.
        dcp_size: u64,
    },
    //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan test: every_case_matches_arrays_or_error_text
    //# "PD DCP transfer requires decode_prefix_len to align to the virtual "
    //# f"DCP page size ({virtual_page_size}), got {decode_prefix_len}"
    /// `decode_prefix_len` is not a multiple of the virtual page (SGLang's text, verbatim).
    #[error(
        "PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size \
         ({virtual_page_size}), got {decode_prefix_len}; round the decode prefix down with \
         align_prefix_down before planning (KVB-E040)"
    )]
    PrefixMisaligned {
        /// `page_size · dcp_size`.
        virtual_page_size: u64,
        /// The prefix seen.
        decode_prefix_len: u64,
    },
    /// More tokens than the source pages hold (seed text, verbatim).
    #[error(
        "num_kv_tokens must fit in the provided source pages, got tokens={tokens}, \
         capacity={capacity}; pass every source page of the chunk or lower num_kv_tokens (KVB-E041)"
    )]
    SrcCapacity {
        /// Tokens requested.
        tokens: u64,
        /// `|src_pages| · page_size`.
        capacity: u64,
    },
    /// Too few destination pages (seed text, verbatim; `required` is the 0.5.23 requirement).
    #[error(
        "Insufficient destination DCP pages: required={required}, provided={provided}, \
         src_page_offset={src_page_offset}, dcp_rank={dcp_rank}; the decode must send one \
         virtual page id per virtual page of the whole send range (KVB-E041)"
    )]
    DstInsufficient {
        /// Destination pages needed.
        required: u64,
        /// Destination pages given.
        provided: u64,
        /// Pages of the send range sent before this chunk.
        src_page_offset: u64,
        /// Destination DCP rank.
        dcp_rank: u64,
    },
    //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py group_concurrent_contiguous test: group_concurrent_contiguous_example_and_edges
    //# "group_concurrent_contiguous requires equal-length src/dst index arrays, "
    //# f"got {src_indices.size} and {dst_indices.size}"
    /// Run coalescing got arrays of different lengths (SGLang's text, verbatim).
    #[error(
        "group_concurrent_contiguous requires equal-length src/dst index arrays, got {len_src} \
         and {len_dst}; pair every source index with one destination index (KVB-E042)"
    )]
    UnequalIndexArrays {
        /// Source length.
        len_src: usize,
        /// Destination length.
        len_dst: usize,
    },
    /// A pool entry whose `item_len` is zero or not a multiple of the page size.
    #[error(
        "entry {entry} has item_len={item_len}, which is not a positive multiple of \
         page_size={page_size}; item_len is the bytes of one page of one entry \
         (page_size · token bytes) (KVB-E027)"
    )]
    BadItemLen {
        /// Entry index.
        entry: usize,
        /// Its `item_len`.
        item_len: u64,
        /// The pool's page size.
        page_size: u64,
    },
    /// A pool description that is inconsistent in itself.
    #[error("invalid pool geometry: {reason} (KVB-E042)")]
    InvalidGeometry {
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// A page id beyond the pool.
    #[error(
        "{side} page id {page} is outside the pool of {num_pages} pages; page ids must come \
         from the {side} allocator of this pool (KVB-E041)"
    )]
    PageOutOfRange {
        /// Side of the page list.
        side: Side,
        /// The page id seen.
        page: u64,
        /// Pages in the pool.
        num_pages: u64,
    },
    /// An entry index beyond a pool.
    #[error(
        "{side} entry index {entry} is outside the pool's {num_entries} entries; pair entries that exist (KVB-E042)"
    )]
    EntryOutOfRange {
        /// Side of the entry.
        side: Side,
        /// The entry index seen.
        entry: usize,
        /// Entries in the pool.
        num_entries: usize,
    },
    /// Paired entries whose per-row byte widths differ where they must be equal.
    #[error(
        "paired entries have different widths: src entry {src_entry} has {src_bytes} bytes per \
         {unit}, dst entry {dst_entry} has {dst_bytes}; both peers must register the same \
         per-{unit} layout (same page size, dtype and heads per rank) (KVB-E031)"
    )]
    WidthMismatch {
        /// Source entry.
        src_entry: usize,
        /// Destination entry.
        dst_entry: usize,
        /// Source bytes per unit.
        src_bytes: u64,
        /// Destination bytes per unit.
        dst_bytes: u64,
        /// `"page"` or `"token"`.
        unit: &'static str,
    },
    /// Arithmetic on the given ids and sizes would overflow `u64`.
    #[error(
        "{what} overflows u64; page ids, page sizes or item lengths are implausibly large (KVB-E033)"
    )]
    Overflow {
        /// The quantity that overflowed.
        what: &'static str,
    },
    //= sglang 0.5.23 sglang/srt/disaggregation/utils.py build_transfer_entry_pairs test: layer_id_pairing_and_its_errors
    //# "Layer metadata must be provided by both PD peers or neither"
    /// Layer ids published by only one peer (SGLang's text, verbatim).
    #[error(
        "Layer metadata must be provided by both PD peers or neither; publish kv_layer_ids on \
         both sides or on none (KVB-E042)"
    )]
    LayerMetadataOneSided,
    //= sglang 0.5.23 sglang/srt/disaggregation/utils.py build_transfer_entry_pairs test: layer_id_pairing_and_its_errors
    //# "Layer metadata length must match transfer entries: "
    //# f"src metadata={len(src_layer_ids)} entries={n_src}, "
    //# f"dst metadata={len(dst_layer_ids)} entries={n_dst}"
    /// Layer id list lengths that do not match the entry counts (SGLang's text, verbatim).
    #[error(
        "Layer metadata length must match transfer entries: src metadata={src_ids} \
         entries={n_src}, dst metadata={dst_ids} entries={n_dst} (KVB-E042)"
    )]
    LayerMetadataLength {
        /// Source layer ids given.
        src_ids: usize,
        /// Source entries.
        n_src: usize,
        /// Destination layer ids given.
        dst_ids: usize,
        /// Destination entries.
        n_dst: usize,
    },
    //= sglang 0.5.23 sglang/srt/disaggregation/utils.py build_transfer_entry_pairs test: layer_id_pairing_and_its_errors
    //# f"Decode peer is missing a transfer entry for model layer {lid}"
    /// A source layer with no matching destination entry (SGLang's text, verbatim).
    #[error(
        "Decode peer is missing a transfer entry for model layer {layer_id}; the decode must \
         register every layer the prefill sends (KVB-E042)"
    )]
    MissingLayer {
        /// The layer id.
        layer_id: u64,
    },
    //= sglang 0.5.23 sglang/srt/disaggregation/utils.py build_transfer_entry_pairs test: pp_entry_pairing_examples
    //# "PP-heterogeneous transfer requires layer ids on "
    //# f"both peers; got src={n_src} dst={n_dst} entries"
    /// Different entry counts without layer ids (SGLang's text, verbatim).
    #[error(
        "PP-heterogeneous transfer requires layer ids on both peers; got src={n_src} \
         dst={n_dst} entries (KVB-E030)"
    )]
    PpNeedsLayerIds {
        /// Source entries.
        n_src: usize,
        /// Destination entries.
        n_dst: usize,
    },
    //= sglang 0.5.23 sglang/srt/disaggregation/mooncake/conn.py MooncakeKVManager.send_kvcache_slice test: head_slice_wider_than_the_slot_is_refused
    //# f"[{mooncake_session_id}] slice size ({heads_bytes_per_token_to_send}) exceeds "
    //# f"target token slot size ({dst_kv_item_len // page_size})"
    /// A head slice wider than the destination token slot (SGLang's log text).
    #[error(
        "slice size ({slice_bytes}) exceeds target token slot size ({slot_bytes}); check \
         total_kv_heads and both attention TP sizes (KVB-E026)"
    )]
    HeadSliceTooWide {
        /// `num_heads · head bytes`.
        slice_bytes: u64,
        /// Destination bytes per token.
        slot_bytes: u64,
    },
    /// Head counts and TP sizes that do not split evenly.
    #[error(
        "KV heads do not split: total_kv_heads={total_kv_heads}, prefill attn TP={tp_src}, \
         decode attn TP={tp_dst}; each TP size must divide the head count or be a multiple of it (KVB-E026)"
    )]
    HeadsDoNotSplit {
        /// Total KV heads of the model.
        total_kv_heads: u64,
        /// Prefill attention TP size.
        tp_src: u64,
        /// Decode attention TP size.
        tp_dst: u64,
    },
    /// A TP rank outside its group.
    #[error("{side} attention TP rank {rank} is outside a TP group of {size} (KVB-E022)")]
    TpRankOutOfRange {
        /// Side.
        side: Side,
        /// Rank seen.
        rank: u64,
        /// Group size.
        size: u64,
    },
    //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.prepare_dcp_token_item_lens test: e015_dcp_entry_count
    //# "PD DCP requires the decode to register one KV entry per "
    //# f"prefill entry: src={num_entries} (draft={num_draft}), "
    //# f"dst={len(dst_page_item_lens)}"
    /// Decode registered a different number of entries (SGLang's text, verbatim).
    #[error(
        "PD DCP requires the decode to register one KV entry per prefill entry: src={n_src} \
         (draft={n_draft}), dst={n_dst} (KVB-E015)"
    )]
    DcpEntryCount {
        /// Prefill entries.
        n_src: usize,
        /// Prefill draft entries.
        n_draft: usize,
        /// Decode entries.
        n_dst: usize,
    },
    //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.prepare_dcp_token_item_lens test: e016_dcp_geometry_sglang_example
    //# "PD DCP source/destination KV geometry differs at entry "
    //# f"{i}: src token bytes={src_token_lens[i]}, "
    //# f"dst token bytes={dst_item_len // dst_page_scale} "
    //# f"(dst item_len={dst_item_len}, page scale={dst_page_scale})"
    /// Per-entry token widths differ between peers (SGLang's text, verbatim).
    #[error(
        "PD DCP source/destination KV geometry differs at entry {entry}: src token \
         bytes={src_token_bytes}, dst token bytes={dst_token_bytes} (dst item_len={dst_item_len}, \
         page scale={page_scale}) (KVB-E016)"
    )]
    DcpGeometryDiffers {
        /// Entry index.
        entry: usize,
        /// `src_item_len div P`.
        src_token_bytes: u64,
        /// `dst_item_len div scale`.
        dst_token_bytes: u64,
        /// Decode item length.
        dst_item_len: u64,
        /// `P` for target entries, `P · d` for draft entries.
        page_scale: u64,
    },
    //= sglang 0.5.23 sglang/srt/disaggregation/common/dcp_pack.py dcp_pack_buffer_bytes test: pack_buffer_sizing_examples
    //# "PD DCP pack requires each kv_item_len to span at least one page, "
    //# f"got {list(kv_item_lens)} with page_size={page_size}"
    /// Pack sizing with an item length below one page (SGLang's text, verbatim).
    #[error(
        "PD DCP pack requires each kv_item_len to span at least one page, got {item_lens:?} \
         with page_size={page_size} (KVB-E027)"
    )]
    PackItemLenTooSmall {
        /// The item lengths seen.
        item_lens: Vec<u64>,
        /// Page size.
        page_size: u64,
    },
    //= sglang 0.5.23 sglang/srt/disaggregation/common/dcp_pack.py dcp_pack_buffer_bytes test: pack_buffer_sizing_examples
    //# "PD DCP pack requires page-aligned kv_item_lens, "
    /// Pack sizing with an item length that is not page aligned (SGLang's text, verbatim).
    #[error(
        "PD DCP pack requires page-aligned kv_item_lens, got {item_lens:?} with page_size={page_size} (KVB-E027)"
    )]
    PackItemLenUnaligned {
        /// The item lengths seen.
        item_lens: Vec<u64>,
        /// Page size.
        page_size: u64,
    },
    /// A size or count above its maximum ([`crate::MAX_PAGE_SIZE`], [`crate::MAX_GROUP_SIZE`],
    /// [`crate::MAX_KV_HEADS`], [`crate::MAX_ENTRIES`], [`crate::MAX_CHUNK_TOKENS`]), refused
    /// before any work.
    #[error(
        "{field}={value} is above the maximum of {max}; {remedy} (every limit is far above any \
         real deployment: docs/planning.md, \"Limits\") (KVB-E033)"
    )]
    TooLarge {
        /// The input field, e.g. `page_size`.
        field: &'static str,
        /// The value seen.
        value: u64,
        /// The largest value accepted.
        max: u64,
        /// How to fix it.
        remedy: &'static str,
    },
    /// Too few pages for the rows a resharding plan addresses.
    #[error(
        "{side} rank {rank} needs at least {required} pages for this chunk, got {provided}; pass \
         the rank's page ids covering every row of the chunk (KVB-E041)"
    )]
    ReshardPagesInsufficient {
        /// Side.
        side: Side,
        /// Rank on that side.
        rank: u64,
        /// Pages needed.
        required: u64,
        /// Pages given.
        provided: u64,
    },
    /// A request's page table (from position 0) shorter than its cached prefix.
    #[error(
        "the page table has {table_len} virtual pages but the cached prefix fills \
         {prefix_pages} pages of {virtual_page_size} tokens; pass the request's whole page \
         table from position 0, or ids that already start at the prefix with \
         SendPages::after_prefix (KVB-E041)"
    )]
    PageTableTooShort {
        /// Entries in the table.
        table_len: u64,
        /// `decode_prefix_len / virtual_page_size`.
        prefix_pages: u64,
        /// `page_size · dcp_size`.
        virtual_page_size: u64,
    },
    /// A DCP chunk that does not start on a page boundary of the send range.
    #[error(
        "chunk_start={chunk_start} tokens is not a multiple of page_size={page_size}; the DCP \
         plan sends whole source pages, so every chunk but the last must hold whole pages \
         (chunk_start = pages sent before the chunk x page_size) (KVB-E042)"
    )]
    ChunkStartMisaligned {
        /// Tokens of the send range sent before the chunk.
        chunk_start: u64,
        /// The physical page size.
        page_size: u64,
    },
}

impl GeometryError {
    /// Every problem code a planner error can carry (entries of `kvbridge explain`).
    pub const PROBLEM_CODES: &'static [&'static str] = &[
        "KVB-E015", "KVB-E016", "KVB-E021", "KVB-E022", "KVB-E026", "KVB-E027", "KVB-E030",
        "KVB-E031", "KVB-E033", "KVB-E040", "KVB-E041", "KVB-E042",
    ];

    /// The problem code of this error (`kvbridge explain CODE` explains it); the message ends
    /// with it in parentheses, so it can be found from the text alone.
    #[must_use]
    pub fn code(&self) -> &'static str {
        match self {
            Self::ZeroPageSize { .. } => "KVB-E021",
            Self::ZeroDcpSize { .. } => "KVB-E021",
            Self::DcpRankOutOfRange { .. } => "KVB-E022",
            Self::PrefixMisaligned { .. } => "KVB-E040",
            Self::SrcCapacity { .. } => "KVB-E041",
            Self::DstInsufficient { .. } => "KVB-E041",
            Self::UnequalIndexArrays { .. } => "KVB-E042",
            Self::BadItemLen { .. } => "KVB-E027",
            Self::InvalidGeometry { .. } => "KVB-E042",
            Self::PageOutOfRange { .. } => "KVB-E041",
            Self::EntryOutOfRange { .. } => "KVB-E042",
            Self::WidthMismatch { .. } => "KVB-E031",
            Self::Overflow { .. } => "KVB-E033",
            Self::LayerMetadataOneSided => "KVB-E042",
            Self::LayerMetadataLength { .. } => "KVB-E042",
            Self::MissingLayer { .. } => "KVB-E042",
            Self::PpNeedsLayerIds { .. } => "KVB-E030",
            Self::HeadSliceTooWide { .. } => "KVB-E026",
            Self::HeadsDoNotSplit { .. } => "KVB-E026",
            Self::TpRankOutOfRange { .. } => "KVB-E022",
            Self::DcpEntryCount { .. } => "KVB-E015",
            Self::DcpGeometryDiffers { .. } => "KVB-E016",
            Self::PackItemLenTooSmall { .. } => "KVB-E027",
            Self::PackItemLenUnaligned { .. } => "KVB-E027",
            Self::TooLarge { .. } => "KVB-E033",
            Self::ReshardPagesInsufficient { .. } => "KVB-E041",
            Self::PageTableTooShort { .. } => "KVB-E041",
            Self::ChunkStartMisaligned { .. } => "KVB-E042",
        }
    }
}

/// `Result` with [`GeometryError`] as the default error.
pub type Result<T, E = GeometryError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::{GeometryError as E, Side};

    /// One value of every variant.
    fn every_variant() -> Vec<E> {
        vec![
            E::ZeroPageSize { page_size: 0 },
            E::ZeroDcpSize { dcp_size: 0 },
            E::DcpRankOutOfRange {
                dcp_rank: 4,
                dcp_size: 4,
            },
            E::PrefixMisaligned {
                virtual_page_size: 64,
                decode_prefix_len: 100,
            },
            E::SrcCapacity {
                tokens: 9,
                capacity: 8,
            },
            E::DstInsufficient {
                required: 2,
                provided: 1,
                src_page_offset: 0,
                dcp_rank: 0,
            },
            E::UnequalIndexArrays {
                len_src: 1,
                len_dst: 2,
            },
            E::BadItemLen {
                entry: 0,
                item_len: 3,
                page_size: 2,
            },
            E::InvalidGeometry { reason: "r".into() },
            E::PageOutOfRange {
                side: Side::Decode,
                page: 9,
                num_pages: 4,
            },
            E::EntryOutOfRange {
                side: Side::Prefill,
                entry: 3,
                num_entries: 2,
            },
            E::WidthMismatch {
                src_entry: 0,
                dst_entry: 0,
                src_bytes: 1,
                dst_bytes: 2,
                unit: "page",
            },
            E::Overflow { what: "x" },
            E::LayerMetadataOneSided,
            E::LayerMetadataLength {
                src_ids: 1,
                n_src: 2,
                dst_ids: 1,
                n_dst: 2,
            },
            E::MissingLayer { layer_id: 3 },
            E::PpNeedsLayerIds { n_src: 2, n_dst: 1 },
            E::HeadSliceTooWide {
                slice_bytes: 2,
                slot_bytes: 1,
            },
            E::HeadsDoNotSplit {
                total_kv_heads: 3,
                tp_src: 2,
                tp_dst: 4,
            },
            E::TpRankOutOfRange {
                side: Side::Decode,
                rank: 2,
                size: 2,
            },
            E::DcpEntryCount {
                n_src: 2,
                n_draft: 0,
                n_dst: 1,
            },
            E::DcpGeometryDiffers {
                entry: 0,
                src_token_bytes: 1,
                dst_token_bytes: 2,
                dst_item_len: 4,
                page_scale: 2,
            },
            E::PackItemLenTooSmall {
                item_lens: vec![1],
                page_size: 2,
            },
            E::PackItemLenUnaligned {
                item_lens: vec![3],
                page_size: 2,
            },
            E::TooLarge {
                field: "page_size",
                value: 1 << 40,
                max: 1 << 20,
                remedy: "r",
            },
            E::ReshardPagesInsufficient {
                side: Side::Prefill,
                rank: 0,
                required: 2,
                provided: 1,
            },
            E::PageTableTooShort {
                table_len: 1,
                prefix_pages: 2,
                virtual_page_size: 8,
            },
            E::ChunkStartMisaligned {
                chunk_start: 3,
                page_size: 2,
            },
        ]
    }

    #[test]
    fn every_message_ends_with_its_listed_problem_code() {
        let all = every_variant();
        for e in &all {
            let code = e.code();
            assert!(E::PROBLEM_CODES.contains(&code), "{e:?}: {code} not listed");
            assert!(e.to_string().ends_with(&format!(" ({code})")), "{e}");
        }
        for listed in E::PROBLEM_CODES {
            assert!(all.iter().any(|e| e.code() == *listed), "{listed} unused");
        }
    }
}
