//! Maxima on the sizes and counts a plan input may claim.
//!
//! Page sizes, group sizes and head counts reach the planner from peer descriptors, and token
//! counts from requests; all are checked against these bounds before anything is computed or
//! allocated, so that a hostile or corrupt value is refused with
//! [`GeometryError::TooLarge`] instead of an allocation of its size or a loop over it. Each
//! bound is far above any real deployment (`docs/planning.md`, "Limits").

use crate::error::{GeometryError, Result};

/// Largest physical page size, in tokens (real pools use 1 to 256).
pub const MAX_PAGE_SIZE: u64 = 1 << 20;

/// Largest parallel group: attention TP, attention CP, PP or DCP size, in ranks.
pub const MAX_GROUP_SIZE: u64 = 1024;

/// Largest KV head count of a model (`total_kv_heads`).
pub const MAX_KV_HEADS: u64 = 1 << 16;

/// Largest number of KV entries of one pool (layers x K/V, draft layers included), and the
/// largest layer index an entry pairing may start at.
pub const MAX_ENTRIES: u64 = 4096;

/// Largest number of tokens one chunk's plan may cover (per-token arrays hold this many rows).
pub const MAX_CHUNK_TOKENS: u64 = 1 << 22;

/// Refuses `value > max` for the named input field, with `remedy` saying how to fix it.
pub(crate) fn at_most(
    field: &'static str,
    value: u64,
    max: u64,
    remedy: &'static str,
) -> Result<()> {
    if value > max {
        return Err(GeometryError::TooLarge {
            field,
            value,
            max,
            remedy,
        });
    }
    Ok(())
}

/// [`at_most`] for a physical page size.
pub(crate) fn page_size(field: &'static str, value: u64) -> Result<()> {
    at_most(
        field,
        value,
        MAX_PAGE_SIZE,
        "pass the KV pool's tokens per page",
    )
}

/// [`at_most`] for a parallel group size.
pub(crate) fn group_size(field: &'static str, value: u64) -> Result<()> {
    at_most(
        field,
        value,
        MAX_GROUP_SIZE,
        "pass the group's size in ranks",
    )
}

/// [`at_most`] for an entry count or an entry index.
pub(crate) fn entries(field: &'static str, value: usize) -> Result<()> {
    at_most(
        field,
        u64::try_from(value).unwrap_or(u64::MAX),
        MAX_ENTRIES,
        "pass the pool's registered entry count",
    )
}

/// [`at_most`] for the tokens of one chunk.
pub(crate) fn chunk_tokens(field: &'static str, value: u64) -> Result<()> {
    at_most(
        field,
        value,
        MAX_CHUNK_TOKENS,
        "plan a longer send range as several chunks",
    )
}
