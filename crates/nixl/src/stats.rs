//! Process-wide counts of what the NIXL transports of this process handed to NIXL: how many
//! batches went as stride descriptors or as per-row descriptors, the descriptors in their
//! lists, and the batches that fell back from the stride form. Read with [`stats`]; the bench
//! prints them per request.

use std::sync::atomic::{AtomicU64, Ordering};

/// Totals since the process started, over every `NixlTransport` in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NixlStats {
    /// Batches posted as stride descriptors.
    pub stride_batches: u64,
    /// Entries of their local lists (one per run of rows).
    pub stride_local_descriptors: u64,
    /// Entries of their remote lists.
    pub stride_remote_descriptors: u64,
    /// Blocks (rows) those runs cover.
    pub stride_blocks: u64,
    /// Batches posted as one descriptor per row (or per gathered run of rows).
    pub row_batches: u64,
    /// Descriptors of those batches (each one local and one remote entry).
    pub row_descriptors: u64,
    /// Strided batches that went as per-row descriptors because the stride form was not
    /// available or NIXL refused it (the first is also a warning in the log).
    pub stride_fallbacks: u64,
    /// Nanoseconds spent making requests: building and preparing the descriptor lists and
    /// NIXL's makeXferReq or createXferReq (both forms).
    pub make_ns: u64,
    /// Nanoseconds spent inside NIXL's postXferReq (with UCX's cma lane, the bytes are copied
    /// there, one UCX operation per block).
    pub post_ns: u64,
}

impl NixlStats {
    /// The sum of two sets of counts (saturating).
    #[must_use]
    pub fn plus(&self, other: &NixlStats) -> NixlStats {
        NixlStats {
            stride_batches: self.stride_batches.saturating_add(other.stride_batches),
            stride_local_descriptors: self
                .stride_local_descriptors
                .saturating_add(other.stride_local_descriptors),
            stride_remote_descriptors: self
                .stride_remote_descriptors
                .saturating_add(other.stride_remote_descriptors),
            stride_blocks: self.stride_blocks.saturating_add(other.stride_blocks),
            row_batches: self.row_batches.saturating_add(other.row_batches),
            row_descriptors: self.row_descriptors.saturating_add(other.row_descriptors),
            stride_fallbacks: self.stride_fallbacks.saturating_add(other.stride_fallbacks),
            make_ns: self.make_ns.saturating_add(other.make_ns),
            post_ns: self.post_ns.saturating_add(other.post_ns),
        }
    }

    /// The counts since `earlier` (a snapshot taken before).
    #[must_use]
    pub fn since(&self, earlier: &NixlStats) -> NixlStats {
        NixlStats {
            stride_batches: self.stride_batches - earlier.stride_batches,
            stride_local_descriptors: self.stride_local_descriptors
                - earlier.stride_local_descriptors,
            stride_remote_descriptors: self.stride_remote_descriptors
                - earlier.stride_remote_descriptors,
            stride_blocks: self.stride_blocks - earlier.stride_blocks,
            row_batches: self.row_batches - earlier.row_batches,
            row_descriptors: self.row_descriptors - earlier.row_descriptors,
            stride_fallbacks: self.stride_fallbacks - earlier.stride_fallbacks,
            make_ns: self.make_ns - earlier.make_ns,
            post_ns: self.post_ns - earlier.post_ns,
        }
    }
}

pub(crate) static STRIDE_BATCHES: AtomicU64 = AtomicU64::new(0);
pub(crate) static STRIDE_LOCAL: AtomicU64 = AtomicU64::new(0);
pub(crate) static STRIDE_REMOTE: AtomicU64 = AtomicU64::new(0);
pub(crate) static STRIDE_BLOCKS: AtomicU64 = AtomicU64::new(0);
pub(crate) static ROW_BATCHES: AtomicU64 = AtomicU64::new(0);
pub(crate) static ROW_DESCRIPTORS: AtomicU64 = AtomicU64::new(0);
pub(crate) static STRIDE_FALLBACKS: AtomicU64 = AtomicU64::new(0);
pub(crate) static MAKE_NS: AtomicU64 = AtomicU64::new(0);
pub(crate) static POST_NS: AtomicU64 = AtomicU64::new(0);

/// Adds the time since `since` to `counter`.
pub(crate) fn time(counter: &AtomicU64, since: std::time::Instant) {
    counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

/// The counts so far (all zero in a build without feature `nixl`).
#[must_use]
pub fn stats() -> NixlStats {
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    NixlStats {
        stride_batches: get(&STRIDE_BATCHES),
        stride_local_descriptors: get(&STRIDE_LOCAL),
        stride_remote_descriptors: get(&STRIDE_REMOTE),
        stride_blocks: get(&STRIDE_BLOCKS),
        row_batches: get(&ROW_BATCHES),
        row_descriptors: get(&ROW_DESCRIPTORS),
        stride_fallbacks: get(&STRIDE_FALLBACKS),
        make_ns: get(&MAKE_NS),
        post_ns: get(&POST_NS),
    }
}
