//! In-process copies of strided ops with the transport's own copy loops, without the
//! transport: the baselines `kvbridge-lab bench --e2e` measures the shared-memory path
//! against (docs/benchmarks.md, "End to end").
//!
//! Each function copies the rows of [`TransferOp`]s from a region of this process to another,
//! with the same claims and row loops the copy worker runs (`map::copy_rows`,
//! `map::copy_together`), on the calling thread: what is left of the transport's time once its
//! queues, turns, hand-offs and notifications are taken away.

use kvbridge_transport::{MemoryRegion, TransferOp};

use crate::map;

/// How each row of a baseline copy is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RowStores {
    /// Streaming (non-temporal) stores, as the transport writes a peer's memory (64-byte
    /// stores where the CPU has AVX-512).
    Streaming,
    /// One `memcpy` per row (ordinary stores through the cache).
    Memcpy,
}

/// One op of [`copy_together`]: its rows from `src` (the op's local region) to `dst` (its
/// remote region).
#[derive(Debug, Clone, Copy)]
pub struct OpRows<'a> {
    /// The region the op's local offsets are in.
    pub src: &'a MemoryRegion,
    /// The region the op's remote offsets are in.
    pub dst: &'a MemoryRegion,
    /// The op (its region ids are not looked at).
    pub op: TransferOp,
}

/// Copies `op`'s rows from `src` (its local offsets) to `dst` (its remote offsets), both spans
/// checked and claimed once, then one tight loop over the rows, as the copy worker copies one
/// strided op.
///
/// # Errors
/// The regions' own refusals (a row out of range, a conflicting claim).
pub fn copy_op(
    src: &MemoryRegion,
    dst: &MemoryRegion,
    op: &TransferOp,
    stores: RowStores,
) -> kvbridge_transport::Result<()> {
    map::copy_rows(
        src,
        op.local_offset,
        op.local_stride,
        dst,
        op.remote_offset,
        op.remote_stride,
        op.len,
        op.count,
        matches!(stores, RowStores::Streaming),
    )
}

/// Copies the rows of every op in one pass in the order of their source addresses, with
/// streaming stores, as the copy worker's gang turns copy the batches of one DCP relayout (one
/// per decode rank, whose rows lie interleaved in the same source pages). Ops must write
/// different destination regions, and none may copy within one region.
///
/// # Errors
/// The regions' own refusals; nothing is copied then.
pub fn copy_together(ops: &[OpRows<'_>]) -> kvbridge_transport::Result<()> {
    let members: Vec<map::GangRows<'_>> = ops
        .iter()
        .map(|o| map::GangRows {
            src: o.src,
            src_offset: o.op.local_offset,
            src_stride: o.op.local_stride,
            dst: o.dst,
            dst_offset: o.op.remote_offset,
            dst_stride: o.op.remote_stride,
            len: o.op.len,
            count: o.op.count,
        })
        .collect();
    map::copy_together(&members, true).map_err(|(_, e)| e)
}

#[cfg(test)]
mod tests {
    use kvbridge_transport::RegionId;

    use super::*;

    fn regions() -> (MemoryRegion, MemoryRegion) {
        let src = map::allocate(1 << 20).unwrap();
        let bytes: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
        src.write_at(0, &bytes).unwrap();
        (src, map::allocate(1 << 20).unwrap())
    }

    #[test]
    fn an_op_lands_its_rows_with_either_stores() {
        for stores in [RowStores::Streaming, RowStores::Memcpy] {
            let (src, dst) = regions();
            // 64 rows of 1152 bytes, every 4th source row, packed on the destination.
            let op = TransferOp::new(RegionId(1), 1152, RegionId(2), 64, 1152).with_rows(
                64,
                4 * 1152,
                1152,
            );
            copy_op(&src, &dst, &op, stores).unwrap();
            for row in op.rows() {
                assert_eq!(
                    dst.to_vec(row.remote_offset, 1152).unwrap(),
                    src.to_vec(row.local_offset, 1152).unwrap(),
                    "{stores:?}: row at {}",
                    row.local_offset
                );
            }
            // Nothing before the first row or after the last.
            assert_eq!(dst.to_vec(0, 64).unwrap(), vec![0; 64]);
            assert_eq!(dst.to_vec(64 + 64 * 1152, 64).unwrap(), vec![0; 64]);
        }
    }

    #[test]
    fn ops_copied_together_land_like_each_alone() {
        let (src, _) = regions();
        let dsts: Vec<MemoryRegion> = (0..4).map(|_| map::allocate(1 << 18).unwrap()).collect();
        // Decode rank q of DCP 4 takes every 4th row from row q.
        let ops: Vec<OpRows<'_>> =
            dsts.iter()
                .enumerate()
                .map(|(q, dst)| OpRows {
                    src: &src,
                    dst,
                    op: TransferOp::new(RegionId(1), q as u64 * 1152, RegionId(2), 0, 1152)
                        .with_rows(32, 4 * 1152, 1152),
                })
                .collect();
        copy_together(&ops).unwrap();
        for o in &ops {
            for row in o.op.rows() {
                assert_eq!(
                    o.dst.to_vec(row.remote_offset, 1152).unwrap(),
                    src.to_vec(row.local_offset, 1152).unwrap()
                );
            }
        }
        // A row past the destination's end moves nothing of any op.
        let fresh = map::allocate(1 << 18).unwrap();
        let short = map::allocate(4096).unwrap();
        let bad = [
            OpRows {
                src: &src,
                dst: &fresh,
                op: ops[0].op,
            },
            OpRows {
                src: &src,
                dst: &short,
                op: ops[1].op,
            },
        ];
        assert!(copy_together(&bad).is_err());
        assert_eq!(fresh.to_vec(0, 1152).unwrap(), vec![0; 1152]);
    }
}
