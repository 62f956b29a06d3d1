//! Strided ops posted as NIXL stride descriptors (one run per run of rows): every shape of
//! batch must land exactly the bytes a row-by-row copy would, and nothing else, and must reach
//! NIXL in the stride form (the process's [`kvbridge_nixl::stats`] say which form each batch
//! took). One test function, as the counts are per process. Built without the stride shim (no
//! C++ compiler: cfg `kvbridge_nixl_no_shim`), the same batches must land the same bytes as
//! per-row descriptors, each strided one counted as a fallback.
#![cfg(feature = "nixl")]

mod common;

use std::sync::Arc;

use kvbridge_conformance::SplitMix64;
use kvbridge_nixl::{NixlOptions, NixlTransport, stats};
use kvbridge_transport::{KvTransport, KvTransportExt, TransferBatch, TransferOp};

const SRC: usize = 1 << 20;
const DST: usize = 1 << 20;

/// The destination after a row-by-row copy of `ops` from `source` onto `model`.
fn apply(model: &mut [u8], source: &[u8], ops: &[TransferOp]) {
    for op in ops {
        for row in op.rows() {
            let (s, d, n) = (
                row.local_offset as usize,
                row.remote_offset as usize,
                row.len as usize,
            );
            model[d..d + n].copy_from_slice(&source[s..s + n]);
        }
    }
}

/// Random ops on disjoint 64 KiB destination slices: packed or strided on either side,
/// single rows, a source stride of zero (one row written many times).
fn random_ops(
    rng: &mut SplitMix64,
    src: kvbridge_transport::RegionId,
    dst: kvbridge_transport::RegionId,
) -> Vec<TransferOp> {
    let mut ops = Vec::new();
    for slot in 0..(1 + rng.next_u64() % 8) {
        let base = slot * 65_536;
        let len = [1, 64, 1152, 4096, 16_384, 20_000][(rng.next_u64() % 6) as usize];
        let remote_stride = match rng.next_u64() % 3 {
            0 => len,
            1 => 4 * len,
            _ => len + 1 + rng.next_u64() % 64,
        };
        let count = (1 + rng.next_u64() % 40).min(65_536 / remote_stride).max(1);
        let local_stride = match rng.next_u64() % 4 {
            0 => 0,
            k => len * k,
        };
        let span = local_stride * (count - 1) + len;
        let local_offset = rng.next_u64() % (SRC as u64 - span);
        ops.push(
            TransferOp::new(src, local_offset, dst, base, len).with_rows(
                count,
                local_stride,
                remote_stride,
            ),
        );
    }
    ops
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strided_ops_go_as_stride_runs_and_land_like_row_by_row_copies() {
    if !common::runtime_ready() {
        return;
    }
    let options = || NixlOptions::default().with_device_memory(false);
    let tx: Arc<dyn KvTransport> = Arc::new(NixlTransport::with_options(options()).unwrap());
    let rx: Arc<dyn KvTransport> = Arc::new(NixlTransport::with_options(options()).unwrap());
    let (src_id, src) = tx.allocate_registered(SRC).await.unwrap();
    let (dst_id, dst) = rx.allocate_registered(DST).await.unwrap();
    let peer = tx.connect(&rx.local_descriptor()).await.unwrap();
    let mut rng = SplitMix64::new(0x57de);
    let source = rng.bytes(SRC);
    src.write_at(0, &source).unwrap();

    // DCP 4 -> 1's shape: 16 packed source rows to every 4th destination row, 48 ops.
    let (len, rows) = (1152u64, 16u64);
    let ops: Vec<TransferOp> = (0..48u64)
        .map(|k| {
            TransferOp::new(
                src_id,
                k * rows * len,
                dst_id,
                (k / 4) * 4 * rows * len + (k % 4) * len,
                len,
            )
            .with_rows(rows, len, 4 * len)
        })
        .collect();
    let before = stats();
    let mut model = vec![0u8; DST];
    dst.write_at(0, &model).unwrap();
    apply(&mut model, &source, &ops);
    tx.transfer(peer, TransferBatch::write(ops.clone()))
        .await
        .unwrap();
    assert!(
        dst.to_vec(0, DST as u64).unwrap() == model,
        "DCP 4 -> 1 rows differ"
    );
    let d = stats().since(&before);
    if cfg!(kvbridge_nixl_no_shim) {
        // Per row, said once and counted.
        assert_eq!(
            (d.stride_batches, d.row_batches, d.stride_fallbacks),
            (0, 1, 1),
            "{d:?}"
        );
        assert_eq!(d.row_descriptors, 48 * rows, "{d:?}");
        for t in [tx, rx] {
            t.shutdown().await.unwrap();
        }
        return;
    }
    assert_eq!(d.stride_batches, 1, "{d:?}");
    assert_eq!(d.stride_blocks, 48 * rows, "{d:?}");
    // The packed source is one run; the destination is one run per four ops.
    assert_eq!(d.stride_local_descriptors, 1, "{d:?}");
    assert_eq!(d.stride_remote_descriptors, 48, "{d:?}");
    assert_eq!(d.row_batches, 0, "{d:?}");

    // Random shapes, each checked against a row-by-row model of the whole destination.
    let before = stats();
    let mut strided = 0;
    for round in 0..24 {
        let mut model = vec![0u8; DST];
        dst.write_at(0, &model).unwrap();
        let ops = random_ops(&mut rng, src_id, dst_id);
        strided += u64::from(ops.iter().any(|op| !op.is_contiguous()));
        apply(&mut model, &source, &ops);
        tx.transfer(peer, TransferBatch::write(ops.clone()))
            .await
            .unwrap();
        assert!(
            dst.to_vec(0, DST as u64).unwrap() == model,
            "round {round}: the destination differs from a row-by-row copy of {ops:?}"
        );
    }
    let d = stats().since(&before);
    // Every batch with a strided op went as stride runs (source rows that overlap, a stride of
    // zero among them, as one run per row) or, with small rows packed on the peer, to the
    // per-row path that gathers them; none fell back.
    assert_eq!(d.stride_batches + d.row_batches, 24, "{d:?}");
    assert!(d.stride_batches > 0 && d.stride_batches <= strided, "{d:?}");
    assert_eq!(d.stride_fallbacks, 0, "{d:?}");

    // Small rows packed on the peer are gathered, not sent as stride runs.
    let ops = vec![TransferOp::new(src_id, 0, dst_id, 0, len).with_rows(64, 4 * len, len)];
    let before = stats();
    tx.transfer(peer, TransferBatch::write(ops)).await.unwrap();
    let d = stats().since(&before);
    assert_eq!(
        (d.stride_batches, d.row_batches, d.row_descriptors),
        (0, 1, 1),
        "{d:?}"
    );

    // The notification arrives after the bytes.
    let mut model = vec![0u8; DST];
    dst.write_at(0, &model).unwrap();
    let ops = vec![TransferOp::new(src_id, 0, dst_id, 0, len).with_rows(200, 2 * len, 3 * len)];
    apply(&mut model, &source, &ops);
    let batch = TransferBatch::write(ops).with_notification(bytes::Bytes::from_static(b"strided"));
    tx.transfer(peer, batch).await.unwrap();
    let note = tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv_notification())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&note.payload[..], b"strided");
    assert!(
        dst.to_vec(0, DST as u64).unwrap() == model,
        "rows before the notification differ"
    );

    // Rows outside the peer's region are refused before anything moves, as per row.
    let ops =
        vec![TransferOp::new(src_id, 0, dst_id, DST as u64 - len, len).with_rows(2, len, len)];
    let err = tx.post(peer, TransferBatch::write(ops)).await.unwrap_err();
    assert!(
        matches!(err, kvbridge_transport::TransportError::OutOfBounds { .. }),
        "{err}"
    );

    // With the option off the same ops go per row, and land the same.
    let tx2: Arc<dyn KvTransport> =
        Arc::new(NixlTransport::with_options(options().with_stride_descriptors(false)).unwrap());
    let (src2_id, src2) = tx2.allocate_registered(SRC).await.unwrap();
    src2.write_at(0, &source).unwrap();
    let peer2 = tx2.connect(&rx.local_descriptor()).await.unwrap();
    let mut model = vec![0u8; DST];
    dst.write_at(0, &model).unwrap();
    let ops = random_ops(&mut rng, src2_id, dst_id);
    apply(&mut model, &source, &ops);
    let before = stats();
    tx2.transfer(peer2, TransferBatch::write(ops))
        .await
        .unwrap();
    let d = stats().since(&before);
    assert!(
        dst.to_vec(0, DST as u64).unwrap() == model,
        "per-row copy differs"
    );
    assert_eq!(
        (d.stride_batches, d.row_batches, d.stride_fallbacks),
        (0, 1, 0),
        "{d:?}"
    );
    for t in [tx, tx2, rx] {
        t.shutdown().await.unwrap();
    }
}
