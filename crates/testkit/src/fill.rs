//! Fill and verify KV memory with bytes derived from (request, entry, absolute token
//! position), so a row that lands in the wrong place — wrong page, wrong DCP rank, wrong head
//! slice, wrong layer — or is left over from an earlier request in the same pages is detected.
//! Used by kvbridge's tests, `kvbridge-lab demo` and `kvbridge-lab bench --e2e`.
//!
//! Every byte of a token's *full* row (all KV heads of the model, for MHA/GQA) is a pure
//! function of `(room, entry, position, byte offset in the full row)`: [`kv_byte`]. Word `w`
//! (8 bytes, little endian) of the row is `seed ^ (w + 1) · φ`, where `seed` is a splitmix64
//! hash of `(room, entry, position)`, so rows are written and checked a 64-bit word at a time
//! and a real-sized cache fills and verifies at memory speed. A rank that holds a head slice
//! holds the corresponding sub-range of the full row (a slice at the wrong offset fails,
//! because the word index differs), so the same function describes what every rank must hold,
//! whatever the TP layout. The owner rule decides which positions a rank holds: position `p`
//! lives on DCP rank `p mod d` at local row `p div d`, in page `page_table[p div (P·d)]`.
//!
//! `room` is any request identifier the filling and the verifying side agree on (normally the
//! bootstrap room): the same memory verified as another room fails at its first row.
//!
//! ```
//! use kvbridge_testkit::fill::{kv_byte, TokenLayout};
//! // One rank of a DCP-4 group, page size 2 (virtual page 8): position 13 is on rank 1.
//! let layout = TokenLayout {
//!     page_size: 2,
//!     dcp_size: 4,
//!     dcp_rank: 1,
//!     page_table: vec![7, 3],
//!     token_bytes: vec![16],
//!     row_offset: vec![0],
//!     head_major: None,
//! };
//! assert_eq!(layout.row_of(13), Some(3 * 2 + 1)); // page_table[13 / 8] = 3, local row 13 / 4 = 3 -> slot 1
//! assert_eq!(layout.row_of(12), None);
//! // kv_byte(room, entry, position, offset)
//! assert_ne!(kv_byte(1, 0, 13, 0), kv_byte(1, 0, 12, 0));
//! assert_ne!(kv_byte(1, 0, 13, 0), kv_byte(2, 0, 13, 0));
//! ```

use std::fmt;
use std::ops::Range;

use kvbridge_geometry::{HeadSharding, PoolKind};
use kvbridge_handshake::PeerDescriptor;
use kvbridge_transport::MemoryRegion;

const PHI: u64 = 0x9E37_79B9_7F4A_7C15;

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser
    x = x.wrapping_add(PHI);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The seed of the full token row of `(room, entry, pos)`.
fn row_seed(room: u64, entry: usize, pos: u64) -> u64 {
    mix(mix(room ^ 0x6b76_6272_6964_6765) ^ ((entry as u64) << 40) ^ pos)
}

/// The seed of the aux row of `room` in aux buffer `buffer` (never equal to a KV row's seed
/// by construction of the inputs, and unrelated to it).
fn aux_seed(room: u64, buffer: usize) -> u64 {
    mix(mix(room ^ 0x6b76_6272_6175_7800) ^ (buffer as u64))
}

fn word(seed: u64, w: u64) -> u64 {
    seed ^ w.wrapping_add(1).wrapping_mul(PHI)
}

fn seed_byte(seed: u64, offset: u64) -> u8 {
    (word(seed, offset / 8) >> (8 * (offset % 8))) as u8
}

/// Byte `offset` of the full token row of absolute position `pos` in KV entry `entry` of
/// request `room`.
pub fn kv_byte(room: u64, entry: usize, pos: u64, offset: u64) -> u8 {
    seed_byte(row_seed(room, entry, pos), offset)
}

/// Byte `offset` of the aux row of `room` in aux buffer `buffer`.
pub fn aux_byte(buffer: usize, room: u64, offset: u64) -> u8 {
    seed_byte(aux_seed(room, buffer), offset)
}

/// Writes bytes `[from, from + out.len())` of the row of `seed` into `out` (word-wise when
/// aligned).
fn fill_seeded(out: &mut [u8], seed: u64, from: u64) {
    if from % 8 == 0 && out.len() % 8 == 0 {
        let w0 = from / 8;
        for (i, c) in out.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&word(seed, w0 + i as u64).to_le_bytes());
        }
    } else {
        for (i, b) in out.iter_mut().enumerate() {
            *b = seed_byte(seed, from + i as u64);
        }
    }
}

/// The first byte of `row` that differs from bytes `[from, ..)` of the row of `seed`
/// (compared word-wise when aligned).
fn first_difference(row: &[u8], seed: u64, from: u64) -> Option<usize> {
    if from % 8 == 0 && row.len() % 8 == 0 {
        let w0 = from / 8;
        let bad = row.chunks_exact(8).enumerate().position(|(i, c)| {
            u64::from_le_bytes(c.try_into().unwrap_or_default()) != word(seed, w0 + i as u64)
        })?;
        let at = bad * 8;
        return (at..at + 8).find(|&k| row[k] != seed_byte(seed, from + k as u64));
    }
    (0..row.len()).find(|&i| row[i] != seed_byte(seed, from + i as u64))
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
    /// tokens), as in `ReceiveRequest::page_table`; for the planners' send range use
    /// `kvbridge_geometry::SendPages::from_page_table`.
    pub page_table: Vec<u64>,
    /// Bytes of one token row in each entry of this rank's pool (`item_len / page_size`).
    pub token_bytes: Vec<u64>,
    /// Where this rank's row starts inside the full token row, per entry (non-zero for MHA
    /// ranks holding a head slice other than the first).
    pub row_offset: Vec<u64>,
    /// `Some(h)`: head-major pages (`kv_layout` `LBHNC`, vLLM's CPU layout): a page holds,
    /// head by head, the page's K rows of that head, then its V rows, so a token's row (per
    /// head its K then its V half) is `2h` pieces of `token_bytes / 2h` bytes, `page_size`
    /// pieces apart. `None`: token-major (a token's row is contiguous).
    pub head_major: Option<u64>,
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
        let mut head_major = None;
        let row_offset = match descriptor.kv_pool {
            PoolKind::Mha => {
                let h = u64::from(descriptor.total_kv_heads.unwrap_or(0));
                let tp = u64::from(descriptor.attn_tp_size);
                let sharding = HeadSharding::new(h, tp, tp).map_err(|e| e.to_string())?;
                let heads = sharding
                    .src_heads(u64::from(descriptor.attn_tp_rank))
                    .map_err(|e| e.to_string())?;
                let per_rank = heads.end - heads.start;
                head_major = descriptor.is_head_major().then_some(per_rank);
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
            head_major,
        })
    }

    /// Pieces of a token row in a page and bytes of each in entry `entry`: `(2h, tb / 2h)`
    /// for head-major pages (a K and a V half per head), `(1, tb)` (one piece, the whole
    /// row) for token-major ones.
    fn pieces(&self, entry: usize) -> Result<(u64, u64), String> {
        let tb = self.token_bytes[entry];
        match self.head_major {
            None => Ok((1, tb)),
            Some(h) if h > 0 && tb % (2 * h) == 0 => Ok((2 * h, tb / (2 * h))),
            Some(h) => Err(format!(
                "entry {entry}: {tb}-byte token rows do not split into {h} head-major heads \
                 of a K and a V half"
            )),
        }
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

/// The views of entries laid out one per region: entry `i` is `spans[i] = (offset, len)` of
/// `regions[i]`. The coordinator's `AllocatedMemory` holds its entries this way: the KV
/// entries are `entry_views(&mem.kv_regions, mem.memory.kv.iter().map(|e| (e.offset, e.len)))`,
/// the aux buffers the same of `aux_regions` and `memory.aux`.
pub fn entry_views(
    regions: &[MemoryRegion],
    spans: impl IntoIterator<Item = (u64, u64)>,
) -> Vec<EntryView> {
    regions
        .iter()
        .zip(spans)
        .map(|(r, (offset, len))| EntryView {
            region: r.clone(),
            offset,
            len,
        })
        .collect()
}

/// A byte that does not hold what the owner rule says it must.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// KV entry (or aux buffer) index.
    pub entry: usize,
    /// Absolute token position (the room, for aux; `u64::MAX` for untouched bytes).
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
             landed in the wrong place, was not written, was overwritten, or is stale (from \
             another request)",
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

/// Visits every row this rank owns among `positions`, a page at a time (one borrow of the
/// region per page): calls `f(entry, position, physical row, offset in the rank's row,
/// bytes)` once per piece of the row (the whole row when token-major, each head's bytes when
/// head-major). Returns the bytes visited.
fn for_each_row(
    entries: &[EntryView],
    layout: &TokenLayout,
    positions: Range<u64>,
    mut f: impl FnMut(usize, u64, u64, u64, &mut [u8]) -> Result<(), Mismatch>,
) -> Result<u64, VerifyError> {
    let (p, d, rank) = (layout.page_size, layout.dcp_size, layout.dcp_rank);
    if p == 0 || d == 0 || rank >= d {
        return Err(VerifyError::Layout(format!(
            "page_size {p}, dcp_size {d}, dcp_rank {rank}: sizes must be positive and the rank \
             below dcp_size"
        )));
    }
    if layout.token_bytes.len() < entries.len() || layout.row_offset.len() < entries.len() {
        return Err(VerifyError::Layout(format!(
            "{} entries but the layout describes {} token widths and {} row offsets",
            entries.len(),
            layout.token_bytes.len(),
            layout.row_offset.len()
        )));
    }
    let mut bytes = 0u64;
    for (e, view) in entries.iter().enumerate() {
        let tb = layout.token_bytes[e];
        if tb == 0 {
            continue;
        }
        let item = tb * p;
        let (heads, hb) = layout.pieces(e).map_err(VerifyError::Layout)?;
        for (j, &page) in layout.page_table.iter().enumerate() {
            let first_local = j as u64 * p;
            // Positions of this page: (first_local + k) · d + rank for k in 0..p.
            let lo = first_local * d + rank;
            if lo >= positions.end {
                break;
            }
            let hi = (first_local + p - 1) * d + rank;
            if hi < positions.start {
                continue;
            }
            let at = page * item;
            if at + item > view.len {
                return Err(VerifyError::Layout(format!(
                    "entry {e}: page {page} ({item} bytes at {at}) is outside the entry of {} \
                     bytes",
                    view.len
                )));
            }
            let layout_err = |err| VerifyError::Layout(format!("entry {e} page {page}: {err}"));
            // Foreign memory (shared mappings) is never borrowed as a slice: its page is copied
            // out, visited, and copied back.
            let (mut borrowed, mut bounce);
            let slice: &mut [u8] = if view.region.can_borrow() {
                borrowed = view
                    .region
                    .borrow_mut(view.offset + at, item)
                    .map_err(layout_err)?;
                &mut borrowed
            } else {
                bounce = view
                    .region
                    .to_vec(view.offset + at, item)
                    .map_err(layout_err)?;
                &mut bounce
            };
            for k in 0..p {
                let pos = (first_local + k) * d + rank;
                if pos >= positions.end {
                    break;
                }
                if pos < positions.start {
                    continue;
                }
                // Head `h` of slot `k` sits at `(h·P + k)·hb` (token-major: one piece at `k·tb`).
                for h in 0..heads {
                    let at = ((h * p + k) * hb) as usize;
                    let piece = &mut slice[at..at + hb as usize];
                    f(e, pos, page * p + k, h * hb, piece).map_err(VerifyError::Mismatch)?;
                }
                bytes += tb;
            }
            if !view.region.can_borrow() {
                view.region
                    .write_at(view.offset + at, slice)
                    .map_err(layout_err)?;
            }
        }
    }
    Ok(bytes)
}

/// Writes every row of `positions` this rank owns with request `room`'s expected bytes, a
/// page at a time. Returns the bytes written.
///
/// # Errors
/// A message when the layout does not fit the entries (a page outside an entry, a zero size).
pub fn fill_rows(
    entries: &[EntryView],
    layout: &TokenLayout,
    room: u64,
    positions: Range<u64>,
) -> Result<u64, String> {
    for_each_row(entries, layout, positions, |e, pos, _, at, piece| {
        fill_seeded(piece, row_seed(room, e, pos), layout.row_offset[e] + at);
        Ok(())
    })
    .map_err(|err| err.to_string())
}

/// Checks every row of `positions` this rank owns holds request `room`'s expected bytes, a
/// page at a time. Returns the bytes verified.
///
/// # Errors
/// [`VerifyError::Mismatch`] for the first wrong byte (including a row written for another
/// room); [`VerifyError::Layout`] when the layout does not fit the entries.
pub fn verify_rows(
    entries: &[EntryView],
    layout: &TokenLayout,
    room: u64,
    positions: Range<u64>,
) -> Result<u64, VerifyError> {
    for_each_row(entries, layout, positions, |e, pos, r, at, piece| {
        let seed = row_seed(room, e, pos);
        let from = layout.row_offset[e] + at;
        match first_difference(piece, seed, from) {
            None => Ok(()),
            Some(i) => Err(Mismatch {
                entry: e,
                position: pos,
                row: r,
                byte: at + i as u64,
                expected: seed_byte(seed, from + i as u64),
                found: piece[i],
                what: "kv",
            }),
        }
    })
}

/// Checks every byte of the entries that is **not** a row of `positions` owned by this rank
/// is still zero (nothing was written where it does not belong). Call on freshly allocated
/// (zeroed) memory. Returns the bytes checked. For head-major pages a [`Mismatch`]'s `row`
/// counts pieces of one head of one token (`(page·h + head)·P + slot`).
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
        // Pieces of `width` bytes: token rows, or each head's row of a token when head-major
        // (piece `(page·h + head)·P + slot`).
        let (heads, hb) = layout.pieces(e).map_err(VerifyError::Layout)?;
        let (width, p) = (hb.max(1), layout.page_size);
        let mut owned = std::collections::HashSet::new();
        for pos in positions.clone() {
            if let Some(row) = layout.row_of(pos) {
                let (page, slot) = (row / p, row % p);
                owned.extend((0..heads).map(|h| (page * heads + h) * p + slot));
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
        if (row + 1) * len > view.len {
            return Err(format!(
                "aux buffer {j}: row {row} is outside {} bytes",
                view.len
            ));
        }
        let mut bytes = vec![0u8; len as usize];
        fill_seeded(&mut bytes, aux_seed(room, j), 0);
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
        let seed = aux_seed(room, j);
        if let Some(i) = first_difference(&buf, seed, 0) {
            return Err(VerifyError::Mismatch(Mismatch {
                entry: j,
                position: room,
                row,
                byte: i as u64,
                expected: seed_byte(seed, i as u64),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_depend_on_room_entry_position_and_offset() {
        let row = |room, entry, pos| -> Vec<u8> {
            (0..64).map(|i| kv_byte(room, entry, pos, i)).collect()
        };
        let a = row(1, 0, 5);
        assert_ne!(a, row(1, 1, 5));
        assert_ne!(a, row(1, 0, 6));
        assert_ne!(a, row(2, 0, 5));
        let r1: Vec<u8> = (0..16).map(|i| aux_byte(0, 1, i)).collect();
        let r2: Vec<u8> = (0..16).map(|i| aux_byte(0, 2, i)).collect();
        let r3: Vec<u8> = (0..16).map(|i| aux_byte(1, 1, i)).collect();
        assert_ne!(r1, r2);
        assert_ne!(r1, r3);
    }

    #[test]
    fn word_path_matches_byte_path() {
        let s = row_seed(3, 1, 77);
        let mut fast = vec![0u8; 64];
        fill_seeded(&mut fast, s, 16);
        let slow: Vec<u8> = (0..64).map(|i| kv_byte(3, 1, 77, 16 + i)).collect();
        assert_eq!(fast, slow);
        let mut odd = vec![0u8; 13];
        fill_seeded(&mut odd, s, 5);
        assert_eq!(
            odd,
            (0..13)
                .map(|i| kv_byte(3, 1, 77, 5 + i))
                .collect::<Vec<_>>()
        );
        assert_eq!(first_difference(&fast, s, 16), None);
        assert_eq!(first_difference(&odd, s, 5), None);
        fast[21] ^= 1;
        assert_eq!(first_difference(&fast, s, 16), Some(21));
        odd[7] ^= 0x80;
        assert_eq!(first_difference(&odd, s, 5), Some(7));
        fast[21] ^= 1;
        assert!(
            first_difference(&fast, s, 24).is_some(),
            "a slice at the wrong offset fails"
        );
    }

    fn views(n: usize, len: u64) -> Vec<EntryView> {
        (0..n)
            .map(|_| EntryView {
                region: MemoryRegion::allocate(len as usize).unwrap(),
                offset: 0,
                len,
            })
            .collect()
    }

    fn mismatch(r: Result<u64, VerifyError>) -> Mismatch {
        match r {
            Err(VerifyError::Mismatch(m)) => m,
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }

    #[test]
    fn rows_follow_the_owner_rule_and_stale_rows_are_caught() {
        // DCP 2, page 4 (virtual 8), 2 entries of 16-byte rows, 3 pages.
        let layout = TokenLayout {
            page_size: 4,
            dcp_size: 2,
            dcp_rank: 1,
            page_table: vec![2, 0, 1],
            token_bytes: vec![16, 16],
            row_offset: vec![0, 0],
            head_major: None,
        };
        let views = views(2, 3 * 64);
        // 21 tokens: rank 1 owns positions 1, 3, ..., 19 (10 rows per entry).
        assert_eq!(fill_rows(&views, &layout, 9, 0..21).unwrap(), 2 * 10 * 16);
        assert_eq!(verify_rows(&views, &layout, 9, 0..21).unwrap(), 2 * 10 * 16);
        assert_eq!(
            verify_untouched(&views, &layout, 0..21).unwrap(),
            2 * 2 * 16
        );
        // Position 13 is local row 6: page_table[1] = page 0, row 2.
        let mut row = vec![0u8; 16];
        views[1].region.read_at(2 * 16, &mut row).unwrap();
        let want: Vec<u8> = (0..16).map(|i| kv_byte(9, 1, 13, i)).collect();
        assert_eq!(row, want);
        // The same memory does not verify as another request.
        let m = mismatch(verify_rows(&views, &layout, 10, 0..21));
        assert_eq!((m.entry, m.position, m.row), (0, 1, 2 * 4));
        // A single flipped byte is found and named: position 3 is page 2, row 1.
        views[0].region.write_at(2 * 64 + 16 + 3, &[0xAA]).unwrap();
        let m = mismatch(verify_rows(&views, &layout, 9, 0..21));
        assert_eq!((m.entry, m.position, m.row, m.byte), (0, 3, 2 * 4 + 1, 3));
        assert_eq!(m.found, 0xAA);
        assert_eq!(m.expected, kv_byte(9, 0, 3, 3));
        assert!(m.to_string().contains("position 3"), "{m}");
    }

    #[test]
    fn head_slices_hold_their_range_of_the_full_row() {
        // Two ranks of a TP-2 MHA group, 32-byte full rows: each holds 16 bytes at its offset.
        let lo = TokenLayout {
            page_size: 2,
            dcp_size: 1,
            dcp_rank: 0,
            page_table: vec![1, 0],
            token_bytes: vec![16],
            row_offset: vec![0],
            head_major: None,
        };
        let hi = TokenLayout {
            row_offset: vec![16],
            ..lo.clone()
        };
        let (a, b) = (views(1, 64), views(1, 64));
        fill_rows(&a, &lo, 4, 0..3).unwrap();
        fill_rows(&b, &hi, 4, 0..3).unwrap();
        let mut row = vec![0u8; 16];
        b[0].region.read_at(2 * 16, &mut row).unwrap(); // position 0: page 1, row 0
        assert_eq!(
            row,
            (16..32).map(|i| kv_byte(4, 0, 0, i)).collect::<Vec<_>>()
        );
        assert_eq!(verify_rows(&b, &hi, 4, 0..3).unwrap(), 3 * 16);
        // The second half's bytes do not pass as the first half.
        assert_eq!(mismatch(verify_rows(&b, &lo, 4, 0..3)).position, 0);
        // Unaligned offsets take the byte path and still agree.
        let odd = TokenLayout {
            token_bytes: vec![13],
            row_offset: vec![5],
            ..lo.clone()
        };
        let c = views(1, 2 * 2 * 13);
        assert_eq!(fill_rows(&c, &odd, 4, 0..4).unwrap(), 4 * 13);
        assert_eq!(verify_rows(&c, &odd, 4, 0..4).unwrap(), 4 * 13);
    }

    #[test]
    fn head_major_pages_hold_each_head_of_a_token_page_size_rows_apart() {
        // Rank 1 of a TP-2 group of 4 heads: heads 2 and 3 (8 bytes a token each: 4 of K, 4
        // of V), pages of 2 tokens, 2 pages: a page is [head 2 K: slot 0, slot 1][head 2 V:
        // slot 0, slot 1][head 3 K: ...][head 3 V: ...], 4 bytes a piece.
        let layout = TokenLayout {
            page_size: 2,
            dcp_size: 1,
            dcp_rank: 0,
            page_table: vec![1, 0],
            token_bytes: vec![16],
            row_offset: vec![16],
            head_major: Some(2),
        };
        let v = views(1, 2 * 2 * 16);
        assert_eq!(fill_rows(&v, &layout, 4, 0..3).unwrap(), 3 * 16);
        let piece = |at: u64| {
            let mut b = vec![0u8; 4];
            v[0].region.read_at(at, &mut b).unwrap();
            b
        };
        let want = |pos, from: u64| {
            (from..from + 4)
                .map(|i| kv_byte(4, 0, pos, i))
                .collect::<Vec<_>>()
        };
        for j in 0..4 {
            // Position 1: page 1, slot 1; piece j (bytes 16 + 4j of the full row).
            assert_eq!(piece(32 + j * 8 + 4), want(1, 16 + 4 * j), "piece {j}");
            // Position 2: page 0, slot 0; slot 1 stays empty.
            assert_eq!(piece(j * 8), want(2, 16 + 4 * j), "piece {j}");
            assert_eq!(piece(j * 8 + 4), vec![0; 4], "piece {j}");
        }
        assert_eq!(verify_rows(&v, &layout, 4, 0..3).unwrap(), 3 * 16);
        assert_eq!(verify_untouched(&v, &layout, 0..3).unwrap(), 2 * 8);
        // The same bytes read token-major do not verify, and a stray byte is found.
        let token_major = TokenLayout {
            head_major: None,
            ..layout.clone()
        };
        assert!(verify_rows(&v, &token_major, 4, 0..3).is_err());
        v[0].region.write_at(4, &[1]).unwrap();
        let m = match verify_untouched(&v, &layout, 0..3) {
            Err(VerifyError::Mismatch(m)) => m,
            other => panic!("expected a mismatch, got {other:?}"),
        };
        assert_eq!((m.row, m.what), (1, "untouched"));
        v[0].region.write_at(16 + 3, &[0xAA]).unwrap();
        let m = mismatch(verify_rows(&v, &layout, 4, 0..3));
        assert_eq!((m.position, m.byte), (2, 8 + 3));
        // Token rows that do not split into the heads are a layout error.
        let odd = TokenLayout {
            head_major: Some(3),
            ..layout
        };
        assert!(matches!(
            verify_rows(&v, &odd, 4, 0..3),
            Err(VerifyError::Layout(_))
        ));
    }

    #[test]
    fn layouts_that_do_not_fit_are_errors() {
        let layout = TokenLayout {
            page_size: 4,
            dcp_size: 1,
            dcp_rank: 0,
            page_table: vec![0, 5],
            token_bytes: vec![8],
            row_offset: vec![0],
            head_major: None,
        };
        let v = views(1, 2 * 32);
        let err = fill_rows(&v, &layout, 1, 0..8).unwrap_err();
        assert!(err.contains("page 5"), "{err}");
        assert!(matches!(
            verify_rows(&v, &layout, 1, 0..8),
            Err(VerifyError::Layout(_))
        ));
        // Positions beyond the first page never touch the bad page.
        assert_eq!(fill_rows(&v, &layout, 1, 0..4).unwrap(), 4 * 8);
        let zero = TokenLayout {
            dcp_size: 0,
            ..layout
        };
        assert!(matches!(
            verify_rows(&v, &zero, 1, 0..4),
            Err(VerifyError::Layout(_))
        ));
    }

    #[test]
    fn entry_views_pair_each_region_with_its_span() {
        let regions: Vec<MemoryRegion> = (0..2)
            .map(|_| MemoryRegion::allocate(64).unwrap())
            .collect();
        let v = entry_views(&regions, [(8, 32), (0, 64), (0, 1)]);
        assert_eq!(v.len(), 2, "one view per region, extra spans ignored");
        assert_eq!(
            (v[0].offset, v[0].len, v[1].offset, v[1].len),
            (8, 32, 0, 64)
        );
        // A view reads its own region at its offset.
        v[0].region.write_at(8, &[7]).unwrap();
        let mut b = [0u8; 1];
        regions[0].read_at(8, &mut b).unwrap();
        assert_eq!(b, [7]);
    }

    #[test]
    fn aux_rows_are_per_room() {
        let bufs = views(2, 4 * 24);
        fill_aux(&bufs, &[24, 20], 2, 7).unwrap();
        verify_aux(&bufs, &[24, 20], &[24, 20], 2, 7).unwrap();
        match verify_aux(&bufs, &[24, 20], &[24, 20], 2, 8) {
            Err(VerifyError::Mismatch(m)) => assert_eq!((m.entry, m.what), (0, "aux")),
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }
}
