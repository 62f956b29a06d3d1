//! Fill and verify KV memory with bytes derived from (entry, absolute token position), so a
//! row that lands in the wrong place — wrong page, wrong DCP rank, wrong head slice, wrong
//! layer — is detected. Used by the coordinator's tests and by `kvbridge demo`.
//!
//! Every byte of a token's *full* row (all KV heads of the model, for MHA/GQA) is a pure
//! function of `(entry, position, byte offset in the full row)`: [`kv_byte`]. A rank that
//! holds a head slice holds the corresponding sub-range of the full row, so the same function
//! describes what every rank must hold, whatever the TP layout. The owner rule decides which
//! positions a rank holds: position `p` lives on DCP rank `p mod d` at local row `p div d`,
//! in page `page_table[p div (P·d)]`.
//!
//! ```
//! use kvbridge_coordinator::testing::{kv_byte, TokenLayout};
//! // One rank of a DCP-4 group, page size 2 (virtual page 8): position 13 is on rank 1.
//! let layout = TokenLayout {
//!     page_size: 2,
//!     dcp_size: 4,
//!     dcp_rank: 1,
//!     page_table: vec![7, 3],
//!     token_bytes: vec![16],
//!     row_offset: vec![0],
//! };
//! assert_eq!(layout.row_of(13), Some(3 * 2 + 1)); // page_table[13 / 8] = 3, local row 13 / 4 = 3 -> slot 1
//! assert_eq!(layout.row_of(12), None);
//! assert_ne!(kv_byte(0, 13, 0), kv_byte(0, 12, 0));
//! ```

use std::fmt;
use std::ops::Range;

use kvbridge_geometry::{HeadSharding, PoolKind};
use kvbridge_handshake::PeerDescriptor;
use kvbridge_transport::MemoryRegion;

use crate::memory::{AllocatedMemory, EntryRegion};

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn word(entry: usize, pos: u64, word: u64) -> u64 {
    mix(mix((entry as u64) << 48 ^ pos) ^ word.wrapping_mul(0xD6E8_FEB8_6659_FD93))
}

/// Byte `offset` of the full token row of absolute position `pos` in KV entry `entry`.
pub fn kv_byte(entry: usize, pos: u64, offset: u64) -> u8 {
    (word(entry, pos, offset / 8) >> (8 * (offset % 8))) as u8
}

/// Byte `offset` of the aux row of `room` in aux buffer `buffer`.
pub fn aux_byte(buffer: usize, room: u64, offset: u64) -> u8 {
    kv_byte(usize::MAX - buffer, room ^ 0xA5A5_A5A5_A5A5_A5A5, offset)
}

/// Writes `len` bytes of the full row of `(entry, pos)` starting at full-row byte `from` into
/// `out`.
fn row_bytes(entry: usize, pos: u64, from: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = kv_byte(entry, pos, from + i as u64);
    }
}

/// How one rank stores a request's tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenLayout {
    /// Physical page size of the rank's pool.
    pub page_size: u64,
    /// DCP group size of the rank (1 without DCP).
    pub dcp_size: u64,
    /// The rank's DCP rank.
    pub dcp_rank: u64,
    /// The request's page ids from position 0 (virtual pages of `page_size · dcp_size`
    /// tokens).
    pub page_table: Vec<u64>,
    /// Bytes of one token row in each entry of this rank's pool (`item_len / page_size`).
    pub token_bytes: Vec<u64>,
    /// Where this rank's row starts inside the full token row, per entry (non-zero for MHA
    /// ranks holding a head slice other than the first).
    pub row_offset: Vec<u64>,
}

impl TokenLayout {
    /// The layout of the rank `descriptor` describes (TP head slice from `attn_tp_rank`, DCP
    /// rank from `dcp_rank`), for a request with `page_table`.
    ///
    /// # Errors
    /// A message when the descriptor's head geometry does not split (MHA) or a size is zero.
    pub fn for_rank(descriptor: &PeerDescriptor, page_table: Vec<u64>) -> Result<Self, String> {
        let p = descriptor.page_size;
        if p == 0 || descriptor.dcp_size == 0 {
            return Err("page_size and dcp_size must be positive".to_owned());
        }
        let token_bytes: Vec<u64> = descriptor.kv_item_lens.iter().map(|l| l / p).collect();
        let row_offset = match descriptor.kv_pool {
            PoolKind::Mha => {
                let h = u64::from(descriptor.total_kv_heads.unwrap_or(0));
                let tp = u64::from(descriptor.attn_tp_size);
                let sharding = HeadSharding::new(h, tp, tp).map_err(|e| e.to_string())?;
                let heads = sharding
                    .src_heads(u64::from(descriptor.attn_tp_rank))
                    .map_err(|e| e.to_string())?;
                let per_rank = heads.end - heads.start;
                token_bytes
                    .iter()
                    .map(|&t| heads.start * (t / per_rank.max(1)))
                    .collect()
            }
            _ => vec![0; token_bytes.len()],
        };
        Ok(Self {
            page_size: p,
            dcp_size: u64::from(descriptor.dcp_size),
            dcp_rank: u64::from(descriptor.dcp_rank),
            page_table,
            token_bytes,
            row_offset,
        })
    }

    /// Tokens per page of the page table (`page_size · dcp_size`).
    pub fn virtual_page(&self) -> u64 {
        self.page_size * self.dcp_size
    }

    /// The physical row holding position `pos`, if this rank owns it and the page table
    /// covers it.
    pub fn row_of(&self, pos: u64) -> Option<u64> {
        if pos % self.dcp_size != self.dcp_rank {
            return None;
        }
        let page = *self
            .page_table
            .get(usize::try_from(pos / self.virtual_page()).ok()?)?;
        let local = pos / self.dcp_size;
        Some(page * self.page_size + local % self.page_size)
    }
}

/// One entry's memory: `len` bytes at `offset` of `region`.
#[derive(Debug, Clone)]
pub struct EntryView {
    /// The region.
    pub region: MemoryRegion,
    /// Where the entry starts in it.
    pub offset: u64,
    /// Bytes of the entry.
    pub len: u64,
}

impl AllocatedMemory {
    /// Views of the KV entries (for [`fill_rows`] / [`verify_rows`]).
    pub fn kv_views(&self) -> Vec<EntryView> {
        views(&self.kv_regions, &self.memory.kv)
    }

    /// Views of the aux buffers (for [`fill_aux`] / [`verify_aux`]).
    pub fn aux_views(&self) -> Vec<EntryView> {
        views(&self.aux_regions, &self.memory.aux)
    }
}

fn views(regions: &[MemoryRegion], entries: &[EntryRegion]) -> Vec<EntryView> {
    regions
        .iter()
        .zip(entries)
        .map(|(r, e)| EntryView {
            region: r.clone(),
            offset: e.offset,
            len: e.len,
        })
        .collect()
}

/// A byte that does not hold what the owner rule says it must.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// KV entry (or aux buffer) index.
    pub entry: usize,
    /// Absolute token position (or the room, for aux).
    pub position: u64,
    /// Physical row in the entry (or aux row).
    pub row: u64,
    /// Byte inside the row.
    pub byte: u64,
    /// What it must hold.
    pub expected: u8,
    /// What it holds.
    pub found: u8,
    /// `"kv"`, `"aux"` or `"untouched"`.
    pub what: &'static str,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} entry {} row {} (position {}) byte {}: expected {:#04x}, found {:#04x}; the row \
             landed in the wrong place, was not written, or was overwritten",
            self.what, self.entry, self.row, self.position, self.byte, self.expected, self.found
        )
    }
}

impl std::error::Error for Mismatch {}

fn read(view: &EntryView, at: u64, buf: &mut [u8]) -> Result<(), String> {
    if at + buf.len() as u64 > view.len {
        return Err(format!(
            "row at byte {at} (+{}) is outside the entry of {} bytes",
            buf.len(),
            view.len
        ));
    }
    view.region
        .read_at(view.offset + at, buf)
        .map_err(|e| e.to_string())
}

/// Writes every row of `positions` this rank owns with its expected bytes. Returns the bytes
/// written.
///
/// # Errors
/// A message when a row is outside an entry.
pub fn fill_rows(
    entries: &[EntryView],
    layout: &TokenLayout,
    positions: Range<u64>,
) -> Result<u64, String> {
    let mut written = 0;
    let mut buf = Vec::new();
    for (e, view) in entries.iter().enumerate() {
        let width = layout.token_bytes[e];
        buf.resize(width as usize, 0);
        for pos in positions.clone() {
            let Some(row) = layout.row_of(pos) else {
                continue;
            };
            row_bytes(e, pos, layout.row_offset[e], &mut buf);
            let at = row * width;
            if at + width > view.len {
                return Err(format!(
                    "entry {e}: row {row} of position {pos} is outside the entry of {} bytes",
                    view.len
                ));
            }
            view.region
                .write_at(view.offset + at, &buf)
                .map_err(|err| err.to_string())?;
            written += width;
        }
    }
    Ok(written)
}

/// Checks every row of `positions` this rank owns holds its expected bytes. Returns the bytes
/// verified.
///
/// # Errors
/// [`VerifyError::Mismatch`] for the first wrong byte; [`VerifyError::Layout`] when a row is
/// outside an entry.
pub fn verify_rows(
    entries: &[EntryView],
    layout: &TokenLayout,
    positions: Range<u64>,
) -> Result<u64, VerifyError> {
    let mut verified = 0;
    let mut buf = Vec::new();
    let mut want = Vec::new();
    for (e, view) in entries.iter().enumerate() {
        let width = layout.token_bytes[e];
        buf.resize(width as usize, 0);
        want.resize(width as usize, 0);
        for pos in positions.clone() {
            let Some(row) = layout.row_of(pos) else {
                continue;
            };
            read(view, row * width, &mut buf).map_err(VerifyError::Layout)?;
            row_bytes(e, pos, layout.row_offset[e], &mut want);
            if let Some(i) = (0..buf.len()).find(|&i| buf[i] != want[i]) {
                return Err(VerifyError::Mismatch(Mismatch {
                    entry: e,
                    position: pos,
                    row,
                    byte: i as u64,
                    expected: want[i],
                    found: buf[i],
                    what: "kv",
                }));
            }
            verified += width;
        }
    }
    Ok(verified)
}

/// Checks every byte of the entries that is **not** a row of `positions` owned by this rank
/// is still zero (nothing was written where it does not belong). Call on freshly allocated
/// (zeroed) memory. Returns the bytes checked.
///
/// # Errors
/// The first non-zero byte as a [`Mismatch`] with `what = "untouched"`.
pub fn verify_untouched(
    entries: &[EntryView],
    layout: &TokenLayout,
    positions: Range<u64>,
) -> Result<u64, VerifyError> {
    let mut checked = 0;
    for (e, view) in entries.iter().enumerate() {
        let width = layout.token_bytes[e].max(1);
        let mut owned = std::collections::HashSet::new();
        for pos in positions.clone() {
            if let Some(row) = layout.row_of(pos) {
                owned.insert(row);
            }
        }
        let rows = view.len / width;
        let mut buf = vec![0u8; width as usize];
        for row in (0..rows).filter(|r| !owned.contains(r)) {
            read(view, row * width, &mut buf).map_err(VerifyError::Layout)?;
            if let Some(i) = buf.iter().position(|&b| b != 0) {
                return Err(VerifyError::Mismatch(Mismatch {
                    entry: e,
                    position: u64::MAX,
                    row,
                    byte: i as u64,
                    expected: 0,
                    found: buf[i],
                    what: "untouched",
                }));
            }
            checked += width;
        }
    }
    Ok(checked)
}

/// Writes the aux row `row` of every buffer with the expected bytes of `room`.
///
/// # Errors
/// A message when the row is outside a buffer.
pub fn fill_aux(
    buffers: &[EntryView],
    item_lens: &[u64],
    row: u64,
    room: u64,
) -> Result<(), String> {
    for (j, (view, &len)) in buffers.iter().zip(item_lens).enumerate() {
        let bytes: Vec<u8> = (0..len).map(|i| aux_byte(j, room, i)).collect();
        if (row + 1) * len > view.len {
            return Err(format!(
                "aux buffer {j}: row {row} is outside {} bytes",
                view.len
            ));
        }
        view.region
            .write_at(view.offset + row * len, &bytes)
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Checks the aux row `row` of every buffer holds the expected bytes of `room` (the first
/// `src_item_lens[j]` bytes, which is what the prefill sends).
///
/// # Errors
/// The first [`Mismatch`] with `what = "aux"`.
pub fn verify_aux(
    buffers: &[EntryView],
    item_lens: &[u64],
    src_item_lens: &[u64],
    row: u64,
    room: u64,
) -> Result<(), VerifyError> {
    for (j, ((view, &len), &src_len)) in
        buffers.iter().zip(item_lens).zip(src_item_lens).enumerate()
    {
        let mut buf = vec![0u8; src_len.min(len) as usize];
        read(view, row * len, &mut buf).map_err(VerifyError::Layout)?;
        if let Some(i) = (0..buf.len()).find(|&i| buf[i] != aux_byte(j, room, i as u64)) {
            return Err(VerifyError::Mismatch(Mismatch {
                entry: j,
                position: room,
                row,
                byte: i as u64,
                expected: aux_byte(j, room, i as u64),
                found: buf[i],
                what: "aux",
            }));
        }
    }
    Ok(())
}

/// A failed verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerifyError {
    /// A byte differs from what the owner rule says.
    Mismatch(Mismatch),
    /// The layout addresses memory outside an entry.
    Layout(String),
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VerifyError::Mismatch(m) => m.fmt(f),
            VerifyError::Layout(s) => write!(f, "layout does not fit the memory: {s}"),
        }
    }
}

impl std::error::Error for VerifyError {}

/// Splits the send range `[start, end)` into chunks the way a prefill scheduler does: at most
/// `max_pages` pages of `page_tokens` tokens each, every chunk but the last ending on a page
/// boundary (the first may start mid-page). Returns `(page indices into the request's page
/// table, num_kv_tokens)` per chunk; an empty range gives one empty (last) chunk.
///
/// ```
/// use kvbridge_coordinator::testing::chunk_plan;
/// // Tokens 20..70 in pages of 16, two pages per chunk: pages 1-2 (tokens 20..48), 3-4 (48..70).
/// assert_eq!(chunk_plan(20, 70, 16, 2), vec![(1..3, 28), (3..5, 22)]);
/// ```
pub fn chunk_plan(
    start: u64,
    end: u64,
    page_tokens: u64,
    max_pages: u64,
) -> Vec<(Range<u64>, u64)> {
    let v = page_tokens.max(1);
    let first = start / v;
    if end <= start {
        return vec![(first..first, 0)];
    }
    let last = end.div_ceil(v);
    let mut out = Vec::new();
    let mut page = first;
    while page < last {
        let stop = page.saturating_add(max_pages.max(1)).min(last);
        let tokens = end.min(stop * v) - start.max(page * v);
        out.push((page..stop, tokens));
        page = stop;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_depend_on_entry_position_and_offset() {
        let a: Vec<u8> = (0..64).map(|i| kv_byte(0, 5, i)).collect();
        let b: Vec<u8> = (0..64).map(|i| kv_byte(1, 5, i)).collect();
        let c: Vec<u8> = (0..64).map(|i| kv_byte(0, 6, i)).collect();
        assert_ne!(a, b);
        assert_ne!(a, c);
        let r1: Vec<u8> = (0..16).map(|i| aux_byte(0, 1, i)).collect();
        let r2: Vec<u8> = (0..16).map(|i| aux_byte(0, 2, i)).collect();
        assert_ne!(r1, r2);
    }

    #[test]
    fn chunk_plan_floors_non_last_chunks() {
        assert_eq!(
            chunk_plan(0, 100, 16, 2),
            vec![(0..2, 32), (2..4, 32), (4..6, 32), (6..7, 4)]
        );
        assert_eq!(chunk_plan(64, 64, 16, 2), vec![(4..4, 0)]);
        assert_eq!(chunk_plan(0, 32, 16, 4), vec![(0..2, 32)]);
        assert_eq!(chunk_plan(48, 100, 64, 1), vec![(0..1, 16), (1..2, 36)]);
    }
}
