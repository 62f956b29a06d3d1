//! The demo's KV contents: every token row holds bytes derived from (request, entry, absolute
//! position), written and checked a 64-bit word at a time so a real-sized cache fills and
//! verifies at memory speed.
//!
//! Word `w` of the *full* token row (all KV heads of the model) of position `pos` in KV entry
//! `entry` of request `room` is `seed(room, entry, pos) ^ (w + 1) · φ` (little endian), where
//! the seed is a splitmix64 hash. A row in the wrong place (wrong page, DCP rank, layer or
//! request) fails at its first word; a head slice at the wrong offset fails too, because the
//! word index differs. A rank holding a head slice holds the matching byte range of the full
//! row; where it holds a position is the owner rule, through
//! [`TokenLayout`](kvbridge_coordinator::testing::TokenLayout).

use std::ops::Range;

use kvbridge_coordinator::testing::{EntryView, TokenLayout};

const PHI: u64 = 0x9E37_79B9_7F4A_7C15;

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(PHI);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The seed of one full token row.
pub(crate) fn seed(room: u64, entry: usize, pos: u64) -> u64 {
    mix(mix(room ^ 0x6b76_6272_6964_6765) ^ ((entry as u64) << 40) ^ pos)
}

fn word(seed: u64, w: u64) -> u64 {
    seed ^ (w + 1).wrapping_mul(PHI)
}

/// Byte `offset` of a full row.
pub(crate) fn byte(seed: u64, offset: u64) -> u8 {
    (word(seed, offset / 8) >> (8 * (offset % 8))) as u8
}

/// Writes bytes `[from, from + out.len())` of the full row of `seed` into `out`.
pub(crate) fn fill(out: &mut [u8], seed: u64, from: u64) {
    if from % 8 == 0 && out.len() % 8 == 0 {
        let w0 = from / 8;
        for (i, c) in out.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&word(seed, w0 + i as u64).to_le_bytes());
        }
    } else {
        for (i, b) in out.iter_mut().enumerate() {
            *b = byte(seed, from + i as u64);
        }
    }
}

/// The first byte of `row` that differs from bytes `[from, ..)` of the full row of `seed`.
pub(crate) fn check(row: &[u8], seed: u64, from: u64) -> Option<usize> {
    if from % 8 == 0 && row.len() % 8 == 0 {
        let w0 = from / 8;
        let bad = row.chunks_exact(8).enumerate().position(|(i, c)| {
            u64::from_le_bytes(c.try_into().unwrap_or_default()) != word(seed, w0 + i as u64)
        })?;
        let at = bad * 8;
        return (0..8)
            .map(|k| at + k)
            .find(|&k| row[k] != byte(seed, from + k as u64));
    }
    (0..row.len()).find(|&i| row[i] != byte(seed, from + i as u64))
}

/// A row that does not hold what the owner rule says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mismatch {
    pub(crate) entry: usize,
    pub(crate) position: u64,
    pub(crate) page: u64,
    pub(crate) row: u64,
    pub(crate) byte: usize,
    pub(crate) expected: u8,
    pub(crate) found: u8,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "KV entry {} position {} (page {}, row {} of the page) byte {}: expected {:#04x}, \
             found {:#04x}; the row landed in the wrong place, was not written, or is stale",
            self.entry, self.position, self.page, self.row, self.byte, self.expected, self.found
        )
    }
}

/// Visits every row this rank owns among `positions`, a page at a time: calls `f(entry,
/// position, page, row in page, row bytes)` with the row borrowed from the region.
fn for_each_row(
    entries: &[EntryView],
    layout: &TokenLayout,
    positions: Range<u64>,
    mut f: impl FnMut(usize, u64, u64, u64, &mut [u8]) -> Result<(), String>,
) -> Result<u64, String> {
    let p = layout.page_size;
    let d = layout.dcp_size;
    let mut bytes = 0u64;
    for (e, view) in entries.iter().enumerate() {
        let tb = layout.token_bytes[e];
        let item = tb * p;
        for (j, &page) in layout.page_table.iter().enumerate() {
            let first_local = j as u64 * p;
            // Positions of this page: (first_local + k) · d + dcp_rank for k in 0..p.
            let lo = first_local * d + layout.dcp_rank;
            if lo >= positions.end {
                break;
            }
            let hi = (first_local + p - 1) * d + layout.dcp_rank;
            if hi < positions.start {
                continue;
            }
            let at = page * item;
            if at + item > view.len {
                return Err(format!(
                    "entry {e}: page {page} ({item} bytes at {at}) is outside the entry of {} bytes",
                    view.len
                ));
            }
            let mut slice = view
                .region
                .borrow_mut(view.offset + at, item)
                .map_err(|err| format!("entry {e} page {page}: {err}"))?;
            for (k, row) in slice.chunks_exact_mut(tb as usize).enumerate() {
                let pos = (first_local + k as u64) * d + layout.dcp_rank;
                if pos >= positions.end {
                    break;
                }
                if pos < positions.start {
                    continue;
                }
                f(e, pos, page, k as u64, row)?;
                bytes += tb;
            }
        }
    }
    Ok(bytes)
}

/// Writes every row this rank owns among `positions` for request `room`. Returns the bytes
/// written.
pub(crate) fn fill_rows(
    entries: &[EntryView],
    layout: &TokenLayout,
    room: u64,
    positions: Range<u64>,
) -> Result<u64, String> {
    for_each_row(entries, layout, positions, |e, pos, _, _, row| {
        fill(row, seed(room, e, pos), layout.row_offset[e]);
        Ok(())
    })
}

/// Checks every row this rank owns among `positions` holds request `room`'s bytes. Returns
/// the bytes verified, or the first wrong byte.
pub(crate) fn verify_rows(
    entries: &[EntryView],
    layout: &TokenLayout,
    room: u64,
    positions: Range<u64>,
) -> Result<u64, String> {
    for_each_row(entries, layout, positions, |e, pos, page, k, row| {
        let s = seed(room, e, pos);
        let from = layout.row_offset[e];
        match check(row, s, from) {
            None => Ok(()),
            Some(i) => Err(Mismatch {
                entry: e,
                position: pos,
                page,
                row: k,
                byte: i,
                expected: byte(s, from + i as u64),
                found: row[i],
            }
            .to_string()),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge_transport::MemoryRegion;

    #[test]
    fn word_path_matches_byte_path() {
        let s = seed(3, 1, 77);
        let mut fast = vec![0u8; 64];
        fill(&mut fast, s, 16);
        let slow: Vec<u8> = (0..64).map(|i| byte(s, 16 + i)).collect();
        assert_eq!(fast, slow);
        let mut odd = vec![0u8; 13];
        fill(&mut odd, s, 5);
        assert_eq!(odd, (0..13).map(|i| byte(s, 5 + i)).collect::<Vec<_>>());
        assert_eq!(check(&fast, s, 16), None);
        assert_eq!(check(&odd, s, 5), None);
        fast[21] ^= 1;
        assert_eq!(check(&fast, s, 16), Some(21));
        assert_eq!(
            check(&fast, s, 24).map(|_| ()),
            Some(()),
            "a shifted slice fails"
        );
        assert_ne!(seed(3, 1, 77), seed(4, 1, 77));
        assert_ne!(seed(3, 1, 77), seed(3, 2, 77));
        assert_ne!(seed(3, 1, 77), seed(3, 1, 78));
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
        };
        let views: Vec<EntryView> = (0..2)
            .map(|_| EntryView {
                region: MemoryRegion::allocate(3 * 64).unwrap(),
                offset: 0,
                len: 3 * 64,
            })
            .collect();
        // 21 tokens: rank 1 owns positions 1, 3, ..., 19 (10 rows per entry).
        assert_eq!(fill_rows(&views, &layout, 9, 0..21).unwrap(), 2 * 10 * 16);
        assert_eq!(verify_rows(&views, &layout, 9, 0..21).unwrap(), 2 * 10 * 16);
        // Position 13 is local row 6: page_table[1] = page 0, row 2.
        let mut row = vec![0u8; 16];
        views[1].region.read_at(2 * 16, &mut row).unwrap();
        let mut want = vec![0u8; 16];
        fill(&mut want, seed(9, 1, 13), 0);
        assert_eq!(row, want);
        // The same memory does not verify as another request.
        let err = verify_rows(&views, &layout, 10, 0..21).unwrap_err();
        assert!(err.contains("position 1 "), "{err}");
        // A single flipped byte is found and named.
        views[0].region.write_at(2 * 64 + 16 + 3, &[0xAA]).unwrap();
        let err = verify_rows(&views, &layout, 9, 0..21).unwrap_err();
        assert!(err.contains("entry 0 position 3 "), "{err}");
        assert!(err.contains("byte 3"), "{err}");
    }
}
