//! Byte-range copy descriptors: `count` rows of `len` bytes from `(src_entry, src_offset)`
//! every `src_stride` bytes to `(dst_entry, dst_offset)` every `dst_stride` bytes.
//!
//! Offsets are relative to the start of an entry (a registered KV region of `num_pages`
//! pages); a caller adds its entry base addresses, or uses
//! [`ByteRanges::to_region_ranges`] when all entries live in one registered region.

use crate::error::{GeometryError, Result, Side};
use crate::pool::PoolGeometry;
use crate::rows::Segment;
use crate::runs::{Run, group_concurrent_contiguous};

/// One copy descriptor from a source entry to a destination entry: `count` rows of `len`
/// bytes, row `i` at `src_offset + i·src_stride` → `dst_offset + i·dst_stride` (the rows of
/// a transport's strided op). Build with [`ByteRange::new`] (one row) and
/// [`ByteRange::with_rows`].
///
/// Ranges produced by this crate have `count ≥ 1`, strides `len` when `count == 1` (as
/// `kvbridge_transport::TransferOp::new` makes them), destination
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
    /// One contiguous copy of `len` bytes (`count` 1, both strides `len`).
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
            src_stride: len,
            dst_stride: len,
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

    /// The first row alone.
    const fn first_row(&self) -> Self {
        Self::new(
            self.src_entry,
            self.src_offset,
            self.dst_entry,
            self.dst_offset,
            self.len,
        )
    }

    /// Bytes moved by all rows (`len · count`).
    #[must_use]
    pub const fn total_bytes(&self) -> u64 {
        self.len.saturating_mul(self.count)
    }
}

/// A copy between two offsets of single registered regions (entries already placed): `count`
/// rows of `len` bytes, row `i` at `src_offset + i·src_stride` → `dst_offset + i·dst_stride`,
/// as in [`ByteRange`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct RegionRange {
    /// Byte offset of the first row in the source region.
    pub src_offset: u64,
    /// Byte offset of the first row in the destination region.
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
/// then the next pair, …). Rows are folded into strided ranges as they are pushed
/// ([`ByteRanges::push`]): contiguous continuations extend a range, rows continuing a
/// progression extend its `count`. [`ByteRanges::len`] is the number of strided descriptors
/// a transport is asked to move, [`ByteRanges::row_count`] the number of rows they cover.
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

    /// Appends a descriptor, folding it into the previous one where the rows allow. Rows
    /// pushed one at a time expand ([`ByteRange::rows`]) to exactly the ranges a list that
    /// only merges contiguous continuations would hold:
    ///
    /// * a row that continues the last row of the previous range on both sides extends it
    ///   (its `len` when that range has one row; otherwise that last row leaves the
    ///   progression and becomes one range with the new row);
    /// * a row with the same entries and `len` that continues the previous range's
    ///   progression (`offset + count·stride` on both sides; the strides are fixed by its
    ///   first two rows) increments its `count`, provided destination rows stay apart
    ///   (`dst_stride ≥ len`) and no offset overflows.
    ///
    /// A range of several rows is pushed as its first row, then the rest folds into the
    /// previous range as a whole when it continues it with the same strides, or is appended
    /// as given (a range whose second row's offset overflows is appended as given).
    /// Zero-length and zero-count descriptors are dropped.
    ///
    /// ```
    /// use kvbridge_geometry::{ByteRange, ByteRanges};
    /// let mut r = ByteRanges::new();
    /// // Every 4th 1152-byte row of the source onto consecutive destination rows.
    /// for i in 0..16 {
    ///     r.push(ByteRange::new(0, i * 4 * 1152, 0, i * 1152, 1152));
    /// }
    /// let op = ByteRange::new(0, 0, 0, 0, 1152).with_rows(16, 4 * 1152, 1152);
    /// assert_eq!(r.as_slice(), [op]);
    /// assert_eq!((r.len(), r.row_count()), (1, 16));
    /// ```
    pub fn push(&mut self, r: ByteRange) {
        if r.len == 0 || r.count == 0 {
            return;
        }
        if r.count == 1 {
            self.push_row(r.first_row());
            return;
        }
        let (Some(src_offset), Some(dst_offset)) = (
            r.src_offset.checked_add(r.src_stride),
            r.dst_offset.checked_add(r.dst_stride),
        ) else {
            self.ranges.push(r);
            return;
        };
        self.push_row(r.first_row());
        let rest = ByteRange {
            src_offset,
            dst_offset,
            count: r.count - 1,
            ..r
        };
        if !self.extend_progression(&rest) {
            self.ranges.push(if rest.count == 1 {
                rest.first_row()
            } else {
                rest
            });
        }
    }

    /// Pushes one row (`count == 1`, strides `len`).
    fn push_row(&mut self, row: ByteRange) {
        if let Some(last) = self.ranges.last_mut() {
            if last.src_entry == row.src_entry && last.dst_entry == row.dst_entry {
                let (fs, fd) = last_row(last);
                if fs.checked_add(last.len) == Some(row.src_offset)
                    && fd.checked_add(last.len) == Some(row.dst_offset)
                {
                    let Some(len) = last.len.checked_add(row.len) else {
                        self.ranges.push(row);
                        return;
                    };
                    if last.count == 1 {
                        (last.len, last.src_stride, last.dst_stride) = (len, len, len);
                    } else {
                        last.count -= 1;
                        if last.count == 1 {
                            *last = last.first_row();
                        }
                        let merged = ByteRange::new(row.src_entry, fs, row.dst_entry, fd, len);
                        self.ranges.push(merged);
                    }
                    return;
                }
            }
        }
        if !self.extend_progression(&row) {
            self.ranges.push(row);
        }
    }

    /// Adds the rows of `next` to the last range's progression if they continue it.
    fn extend_progression(&mut self, next: &ByteRange) -> bool {
        let Some(last) = self.ranges.last_mut() else {
            return false;
        };
        if last.src_entry != next.src_entry
            || last.dst_entry != next.dst_entry
            || last.len != next.len
        {
            return false;
        }
        let (ss, ds) = if last.count == 1 {
            match (
                next.src_offset.checked_sub(last.src_offset),
                next.dst_offset.checked_sub(last.dst_offset),
            ) {
                (Some(ss), Some(ds)) => (ss, ds),
                _ => return false,
            }
        } else {
            let at = |offset: u64, stride: u64| {
                last.count
                    .checked_mul(stride)
                    .and_then(|v| v.checked_add(offset))
            };
            if at(last.src_offset, last.src_stride) != Some(next.src_offset)
                || at(last.dst_offset, last.dst_stride) != Some(next.dst_offset)
            {
                return false;
            }
            (last.src_stride, last.dst_stride)
        };
        if ds < last.len || (next.count > 1 && (next.src_stride, next.dst_stride) != (ss, ds)) {
            return false;
        }
        let Some(count) = last.count.checked_add(next.count) else {
            return false;
        };
        // The last row of the grown progression must stay addressable.
        let (Some(_), Some(_)) = (
            (count - 1)
                .checked_mul(ss)
                .and_then(|v| v.checked_add(last.src_offset)),
            (count - 1)
                .checked_mul(ds)
                .and_then(|v| v.checked_add(last.dst_offset)),
        ) else {
            return false;
        };
        (last.count, last.src_stride, last.dst_stride) = (count, ss, ds);
        true
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
    /// where entry `i` starts) and folds consecutive descriptors that continue each other
    /// there as [`ByteRanges::push`] does, e.g. the last rows of layer `i` and the first rows
    /// of layer `i + 1` when the layers are laid out back to back.
    ///
    /// # Errors
    /// [`GeometryError::EntryOutOfRange`] for an entry without an offset;
    /// [`GeometryError::Overflow`] if an address does not fit `u64`.
    pub fn to_region_ranges(
        &self,
        src_entry_offsets: &[u64],
        dst_entry_offsets: &[u64],
    ) -> Result<Vec<RegionRange>> {
        let mut placed = ByteRanges {
            ranges: Vec::with_capacity(self.ranges.len()),
        };
        for r in &self.ranges {
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
            // Every byte of the last row must be addressable in the region.
            let rows_end = |start: u64, stride: u64| {
                r.count
                    .saturating_sub(1)
                    .checked_mul(stride)
                    .and_then(|v| v.checked_add(start))
                    .and_then(|v| v.checked_add(r.len))
            };
            let s = base(src_entry_offsets, r.src_entry, Side::Prefill)?
                .checked_add(r.src_offset)
                .ok_or(overflow.clone())?;
            let d = base(dst_entry_offsets, r.dst_entry, Side::Decode)?
                .checked_add(r.dst_offset)
                .ok_or(overflow.clone())?;
            if rows_end(s, r.src_stride).is_none() || rows_end(d, r.dst_stride).is_none() {
                return Err(overflow);
            }
            placed.push(ByteRange {
                src_entry: 0,
                src_offset: s,
                dst_entry: 0,
                dst_offset: d,
                ..*r
            });
        }
        Ok(placed
            .ranges
            .into_iter()
            .map(|r| RegionRange {
                src_offset: r.src_offset,
                dst_offset: r.dst_offset,
                len: r.len,
                count: r.count,
                src_stride: r.src_stride,
                dst_stride: r.dst_stride,
            })
            .collect())
    }
}

/// Offsets of the last row of `r` (saturating: only a range pushed as given can overflow, and
/// nothing continues a saturated offset).
fn last_row(r: &ByteRange) -> (u64, u64) {
    let k = r.count.saturating_sub(1);
    (
        r.src_offset.saturating_add(k.saturating_mul(r.src_stride)),
        r.dst_offset.saturating_add(k.saturating_mul(r.dst_stride)),
    )
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

    /// Pushes the descriptors of `segments` (row indices, see [`Segment`]): one range per
    /// segment, whose rows [`ByteRanges::push`] folds into the previous range where they
    /// continue it. Callers guarantee rows lie inside their entries, so nothing overflows.
    pub(crate) fn push_segments(
        &self,
        out: &mut ByteRanges,
        segments: impl Iterator<Item = Segment>,
    ) {
        let whole = self.src_col == 0
            && self.dst_col == 0
            && self.width == self.src_width
            && self.width == self.dst_width;
        let (sw, dw) = (self.src_width, self.dst_width);
        segments.for_each(|seg| {
            let first = |len| {
                ByteRange::new(
                    self.pair.src,
                    seg.src * sw + self.src_col,
                    self.pair.dst,
                    seg.dst * dw + self.dst_col,
                    len,
                )
            };
            out.push(if whole && seg.src_step == 1 && seg.dst_step == 1 {
                // Consecutive whole rows on both sides: one contiguous block.
                first(seg.len * self.width)
            } else {
                first(self.width).with_rows(seg.len, seg.src_step * sw, seg.dst_step * dw)
            });
        });
    }

    /// [`RowCopy::push_segments`] for runs of consecutive rows on both sides.
    pub(crate) fn push_runs(&self, out: &mut ByteRanges, runs: impl Iterator<Item = Run>) {
        self.push_segments(out, runs.map(Segment::from));
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

/// Non-DCP page path (docs/planning.md, "The page path"): coalesce `(src_pages, dst_pages)` into page runs and emit,
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
    //= sglang 0.5.23 sglang/srt/disaggregation/mooncake/conn.py MooncakeKVManager._send_kvcache_generic test: page_path_mla_example, page_path_mha_example
    //# prefill_kv_blocks, dst_kv_blocks = group_concurrent_contiguous(
    //# prefill_data_indices, dst_data_indices
    let runs = group_concurrent_contiguous(src_pages, dst_pages)?;
    let copies = page_copies(src, dst, pairs)?;
    src.check_pages(Side::Prefill, src_pages)?;
    dst.check_pages(Side::Decode, dst_pages)?;
    let mut out = ByteRanges::new();
    for copy in &copies {
        //= sglang 0.5.23 sglang/srt/disaggregation/mooncake/conn.py MooncakeKVManager._send_kvcache_generic test: page_path_mla_example, page_path_mha_example
        //# src_addr = src_ptr + int(prefill_index[0]) * item_len
        //# dst_addr = dst_ptr + int(decode_index[0]) * item_len
        //# length = item_len * len(prefill_index)
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
