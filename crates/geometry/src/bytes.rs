//! Byte-range copy descriptors: `(src_entry, src_offset, dst_entry, dst_offset, len)`.
//!
//! Offsets are relative to the start of an entry (a registered KV region of `num_pages`
//! pages); a caller adds its entry base addresses, or uses
//! [`ByteRanges::to_region_ranges`] when all entries live in one registered region.

use crate::error::{GeometryError, Result, Side};
use crate::pool::PoolGeometry;
use crate::runs::{Run, group_concurrent_contiguous};

/// One copy descriptor from a source entry to a destination entry: `count` rows of `len`
/// bytes, row `i` at `src_offset + i·src_stride` → `dst_offset + i·dst_stride` (the rows of
/// a transport's strided op). Build with [`ByteRange::new`] (one row) and
/// [`ByteRange::with_rows`].
///
/// Ranges produced by this crate have `count ≥ 1`, strides 0 when `count == 1`, destination
/// rows that never overlap (`dst_stride ≥ len` when `count > 1`), and every row inside its
/// entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ByteRange {
    /// Source entry index (in the prefill pool's entry order).
    pub src_entry: usize,
    /// Byte offset of the first row inside the source entry.
    pub src_offset: u64,
    /// Destination entry index (in the decode pool's entry order).
    pub dst_entry: usize,
    /// Byte offset of the first row inside the destination entry.
    pub dst_offset: u64,
    /// Bytes per row.
    pub len: u64,
    /// Rows (1 for a contiguous copy).
    pub count: u64,
    /// Bytes from one source row to the next.
    pub src_stride: u64,
    /// Bytes from one destination row to the next.
    pub dst_stride: u64,
}

impl ByteRange {
    /// One contiguous copy of `len` bytes (`count` 1, strides 0).
    #[must_use]
    pub const fn new(
        src_entry: usize,
        src_offset: u64,
        dst_entry: usize,
        dst_offset: u64,
        len: u64,
    ) -> Self {
        Self {
            src_entry,
            src_offset,
            dst_entry,
            dst_offset,
            len,
            count: 1,
            src_stride: 0,
            dst_stride: 0,
        }
    }

    /// The same first row repeated `count` times with the given strides.
    #[must_use]
    pub const fn with_rows(self, count: u64, src_stride: u64, dst_stride: u64) -> Self {
        Self {
            count,
            src_stride,
            dst_stride,
            ..self
        }
    }

    /// The rows as `count` one-row ranges, in order.
    pub fn rows(&self) -> impl ExactSizeIterator<Item = ByteRange> + use<> {
        let r = *self;
        let count = usize::try_from(r.count).unwrap_or(usize::MAX);
        (0..count).map(move |i| {
            let i = i as u64;
            ByteRange::new(
                r.src_entry,
                r.src_offset.saturating_add(i.saturating_mul(r.src_stride)),
                r.dst_entry,
                r.dst_offset.saturating_add(i.saturating_mul(r.dst_stride)),
                r.len,
            )
        })
    }

    /// Bytes moved by all rows (`len · count`).
    #[must_use]
    pub const fn total_bytes(&self) -> u64 {
        self.len.saturating_mul(self.count)
    }
}

/// A copy between two offsets of single registered regions (entries already placed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionRange {
    /// Byte offset in the source region.
    pub src_offset: u64,
    /// Byte offset in the destination region.
    pub dst_offset: u64,
    /// Bytes to copy.
    pub len: u64,
}

/// Which source entry is copied into which destination entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EntryPair {
    /// Source entry index.
    pub src: usize,
    /// Destination entry index.
    pub dst: usize,
}

impl EntryPair {
    /// A pair.
    #[must_use]
    pub const fn new(src: usize, dst: usize) -> Self {
        Self { src, dst }
    }
}

/// Pairs `i ↔ i` for `i in 0..n` (peers with identical entry lists).
#[must_use]
pub fn identity_pairs(n: usize) -> Vec<EntryPair> {
    (0..n).map(|i| EntryPair::new(i, i)).collect()
}

/// The descriptors a plan posts, in posting order (entry-major: every run of the first pair,
/// then the next pair, …). Consecutive descriptors that continue each other in the same
/// entries are merged as they are pushed, so [`ByteRanges::len`] is the number of byte
/// ranges a transport is asked to move.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ByteRanges {
    ranges: Vec<ByteRange>,
}

impl ByteRanges {
    /// No descriptors.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a descriptor, merging it into the previous one when both entries match and
    /// both sides continue contiguously. Zero-length descriptors are dropped.
    pub fn push(&mut self, r: ByteRange) {
        if r.len == 0 || r.count == 0 {
            return;
        }
        if let Some(last) = self.ranges.last_mut() {
            if last.count == 1
                && r.count == 1
                && last.src_entry == r.src_entry
                && last.dst_entry == r.dst_entry
                && last.src_offset + last.len == r.src_offset
                && last.dst_offset + last.len == r.dst_offset
            {
                last.len += r.len;
                return;
            }
        }
        self.ranges.push(r);
    }

    /// Number of descriptors posted (strided ranges; [`ByteRanges::row_count`] counts the
    /// rows they cover).
    #[must_use]
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Rows covered by all descriptors (the sum of their `count`s): the number of
    /// descriptors a transport without strided ops posts.
    #[must_use]
    pub fn row_count(&self) -> u64 {
        self.ranges.iter().map(|r| r.count).sum()
    }

    /// Whether nothing is posted.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Sum of all lengths.
    #[must_use]
    pub fn total_bytes(&self) -> u64 {
        self.ranges.iter().map(ByteRange::total_bytes).sum()
    }

    /// The descriptors.
    #[must_use]
    pub fn as_slice(&self) -> &[ByteRange] {
        &self.ranges
    }

    /// Iterates the descriptors.
    pub fn iter(&self) -> std::slice::Iter<'_, ByteRange> {
        self.ranges.iter()
    }

    /// The descriptors, owned.
    #[must_use]
    pub fn into_vec(self) -> Vec<ByteRange> {
        self.ranges
    }

    /// Places entries in one source and one destination region (`src_entry_offsets[i]` =
    /// where entry `i` starts) and merges consecutive descriptors that are contiguous there,
    /// e.g. the last rows of layer `i` and the first rows of layer `i + 1` when the layers
    /// are laid out back to back.
    ///
    /// # Errors
    /// [`GeometryError::EntryOutOfRange`] for an entry without an offset;
    /// [`GeometryError::Overflow`] if an address does not fit `u64`.
    pub fn to_region_ranges(
        &self,
        src_entry_offsets: &[u64],
        dst_entry_offsets: &[u64],
    ) -> Result<Vec<RegionRange>> {
        let mut out: Vec<RegionRange> = Vec::with_capacity(self.ranges.len());
        for r in self.ranges.iter().flat_map(ByteRange::rows) {
            let base = |offsets: &[u64], entry: usize, side| {
                offsets
                    .get(entry)
                    .copied()
                    .ok_or(GeometryError::EntryOutOfRange {
                        side,
                        entry,
                        num_entries: offsets.len(),
                    })
            };
            let overflow = GeometryError::Overflow {
                what: "region offset",
            };
            let s = base(src_entry_offsets, r.src_entry, Side::Prefill)?
                .checked_add(r.src_offset)
                .ok_or(overflow.clone())?;
            let d = base(dst_entry_offsets, r.dst_entry, Side::Decode)?
                .checked_add(r.dst_offset)
                .ok_or(overflow)?;
            match out.last_mut() {
                Some(last)
                    if last.src_offset + last.len == s && last.dst_offset + last.len == d =>
                {
                    last.len += r.len;
                }
                _ => out.push(RegionRange {
                    src_offset: s,
                    dst_offset: d,
                    len: r.len,
                }),
            }
        }
        Ok(out)
    }
}

impl<'a> IntoIterator for &'a ByteRanges {
    type Item = &'a ByteRange;
    type IntoIter = std::slice::Iter<'a, ByteRange>;

    fn into_iter(self) -> Self::IntoIter {
        self.ranges.iter()
    }
}

/// How rows of one source entry land in one destination entry: row `s` of the source is
/// bytes `[s·src_width + src_col, +width)`, row `d` of the destination is
/// `[d·dst_width + dst_col, +width)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowCopy {
    pub(crate) pair: EntryPair,
    pub(crate) src_width: u64,
    pub(crate) dst_width: u64,
    pub(crate) src_col: u64,
    pub(crate) dst_col: u64,
    pub(crate) width: u64,
}

impl RowCopy {
    /// A whole-row copy (equal widths on both sides).
    pub(crate) fn whole(pair: EntryPair, width: u64) -> Self {
        RowCopy {
            pair,
            src_width: width,
            dst_width: width,
            src_col: 0,
            dst_col: 0,
            width,
        }
    }

    /// Pushes the descriptors of `runs` (row indices). Callers guarantee rows lie inside
    /// their entries, so nothing overflows.
    pub(crate) fn push_runs(&self, out: &mut ByteRanges, runs: impl Iterator<Item = Run>) {
        let whole = self.src_col == 0
            && self.dst_col == 0
            && self.width == self.src_width
            && self.width == self.dst_width;
        runs.for_each(|run| {
            if whole {
                out.push(ByteRange::new(
                    self.pair.src,
                    run.src_start * self.src_width,
                    self.pair.dst,
                    run.dst_start * self.dst_width,
                    run.len * self.width,
                ));
            } else {
                for (s, d) in run.pairs() {
                    out.push(ByteRange::new(
                        self.pair.src,
                        s * self.src_width + self.src_col,
                        self.pair.dst,
                        d * self.dst_width + self.dst_col,
                        self.width,
                    ));
                }
            }
        });
    }
}

/// Looks up both entries of a pair, or fails with [`GeometryError::EntryOutOfRange`].
pub(crate) fn pair_item_lens(
    src: &PoolGeometry,
    dst: &PoolGeometry,
    pair: EntryPair,
) -> Result<(u64, u64)> {
    let item_len = |pool: &PoolGeometry, entry: usize, side| {
        pool.entries()
            .get(entry)
            .map(|e| e.item_len)
            .ok_or(GeometryError::EntryOutOfRange {
                side,
                entry,
                num_entries: pool.entries().len(),
            })
    };
    Ok((
        item_len(src, pair.src, Side::Prefill)?,
        item_len(dst, pair.dst, Side::Decode)?,
    ))
}

/// Non-DCP page path (spec §3): coalesce `(src_pages, dst_pages)` into page runs and emit,
/// for every entry pair and every run, `(s0·item_len, d0·item_len, len·item_len)`.
///
/// `dst_pages` is the chunk's slice of the decode page list (`dst_all[index_slice]`). As in
/// SGLang, if it is shorter than `src_pages` the source is truncated to its length. Unlike
/// SGLang (which silently uses the source `item_len` as the destination stride), paired
/// entries must have equal `item_len`.
///
/// # Errors
/// [`GeometryError::EntryOutOfRange`], [`GeometryError::WidthMismatch`],
/// [`GeometryError::UnequalIndexArrays`] (more destination than source pages),
/// [`GeometryError::PageOutOfRange`].
pub fn page_path_ranges(
    src: &PoolGeometry,
    dst: &PoolGeometry,
    pairs: &[EntryPair],
    src_pages: &[u64],
    dst_pages: &[u64],
) -> Result<ByteRanges> {
    let src_pages = &src_pages[..src_pages.len().min(dst_pages.len())];
    let runs = group_concurrent_contiguous(src_pages, dst_pages)?;
    let copies = page_copies(src, dst, pairs)?;
    src.check_pages(Side::Prefill, src_pages)?;
    dst.check_pages(Side::Decode, dst_pages)?;
    let mut out = ByteRanges::new();
    for copy in &copies {
        copy.push_runs(&mut out, runs.iter().copied());
    }
    Ok(out)
}

fn page_copies(
    src: &PoolGeometry,
    dst: &PoolGeometry,
    pairs: &[EntryPair],
) -> Result<Vec<RowCopy>> {
    pairs
        .iter()
        .map(|&pair| {
            let (s, d) = pair_item_lens(src, dst, pair)?;
            if s != d {
                return Err(GeometryError::WidthMismatch {
                    src_entry: pair.src,
                    dst_entry: pair.dst,
                    src_bytes: s,
                    dst_bytes: d,
                    unit: "page",
                });
            }
            Ok(RowCopy::whole(pair, s))
        })
        .collect()
}
