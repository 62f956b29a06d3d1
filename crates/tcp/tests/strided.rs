//! Strided ops over TCP, moved natively (one `Rows` descriptor per op or piece of it): random
//! geometries land row by row exactly where the rows say (gaps untouched), through small
//! batches sent whole, batches cut into pieces between and inside rows, one and several
//! connections, and the bounce-buffer receive path; batches mixing short ranges (gathered by
//! the sender into its staging buffer) with long ones (written in place); and what `post`
//! refuses before anything is sent. Case counts are fixed and every transfer runs under a generous timeout.

use std::sync::OnceLock;
use std::time::Duration;

use kvbridge_tcp::{TcpConfig, TcpTransport};
use kvbridge_transport::{
    KvTransport, KvTransportExt, Side, TransferBatch, TransferOp, TransportError,
};
use proptest::prelude::*;

const LIMIT: Duration = Duration::from_secs(60);
const SRC_LEN: usize = 256 << 10;
const DST_LEN: usize = 512 << 10;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    })
}

/// One strided op of a random geometry that fits both regions.
#[derive(Debug, Clone)]
struct Geometry {
    len: u64,
    count: u64,
    local_offset: u64,
    local_stride: u64,
    remote_offset: u64,
    remote_stride: u64,
}

fn geometry() -> impl Strategy<Value = Geometry> {
    (
        1u64..6000,
        0u64..48,
        0u64..64,
        0u64..3000,
        0u64..64,
        0u64..2000,
    )
        .prop_filter_map(
            "does not fit the regions",
            |(len, count, lo, lgap, ro, rgap)| {
                // Source rows may overlap (a stride below the row length, even 0); destination
                // rows may not.
                let local_stride = (len + lgap).saturating_sub(1500);
                let remote_stride = len + rgap;
                let fits = |offset: u64, stride: u64, region: usize| {
                    count == 0 || offset + (count - 1) * stride + len <= region as u64
                };
                (fits(lo, local_stride, SRC_LEN) && fits(ro, remote_stride, DST_LEN)).then_some(
                    Geometry {
                        len,
                        count,
                        local_offset: lo,
                        local_stride,
                        remote_offset: ro,
                        remote_stride,
                    },
                )
            },
        )
}

fn config(kind: u8) -> TcpConfig {
    match kind {
        // Defaults: batches up to 64 KiB go whole with their `Begin`.
        0 => TcpConfig::default(),
        // 4 KiB pieces over three connections: rows cut into pieces, pieces spread.
        1 => TcpConfig::default()
            .with_piece_bytes(4096)
            .with_connections_per_peer(3),
        // Through the bounce buffer.
        _ => TcpConfig::default()
            .with_piece_bytes(16 << 10)
            .with_receive_in_place(false),
    }
}

/// Byte `i` of the source.
fn src_byte(i: u64) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 8)) as u8
}

async fn moves_rows(kind: u8, ops: Vec<Geometry>) {
    // One batch per op: ops of one batch must not overlap on the destination.
    moves_batches(kind, ops.into_iter().map(|g| vec![g]).collect()).await;
}

/// Moves each batch in turn and checks every byte of the destination after each.
async fn moves_batches(kind: u8, batches: Vec<Vec<Geometry>>) {
    let cfg = config(kind);
    let decode = TcpTransport::bind(cfg.clone()).await.unwrap();
    let prefill = TcpTransport::bind(cfg).await.unwrap();
    let (dst, dst_mem) = decode.allocate_registered(DST_LEN).await.unwrap();
    let (src, src_mem) = prefill.allocate_registered(SRC_LEN).await.unwrap();
    let pattern: Vec<u8> = (0..SRC_LEN as u64).map(src_byte).collect();
    src_mem.write_at(0, &pattern).unwrap();
    dst_mem.fill(0, DST_LEN as u64, 0xEE).unwrap();
    let peer = prefill.connect(&decode.local_descriptor()).await.unwrap();
    for geometries in &batches {
        let mut expected = dst_mem.to_vec(0, DST_LEN as u64).unwrap();
        let ops: Vec<TransferOp> = geometries
            .iter()
            .map(|g| {
                TransferOp::new(src, g.local_offset, dst, g.remote_offset, g.len).with_rows(
                    g.count,
                    g.local_stride,
                    g.remote_stride,
                )
            })
            .collect();
        for op in &ops {
            for row in op.rows() {
                let (s, d, n) = (
                    row.local_offset as usize,
                    row.remote_offset as usize,
                    row.len as usize,
                );
                expected[d..d + n].copy_from_slice(&pattern[s..s + n]);
            }
        }
        tokio::time::timeout(LIMIT, prefill.transfer(peer, TransferBatch::write(ops)))
            .await
            .expect("transfer timed out")
            .unwrap_or_else(|e| panic!("{geometries:?}: {e}"));
        let got = dst_mem.to_vec(0, DST_LEN as u64).unwrap();
        if let Some(at) = got.iter().zip(&expected).position(|(a, b)| a != b) {
            panic!("{geometries:?}: first wrong byte at {at}");
        }
    }
    prefill.shutdown().await.unwrap();
    decode.shutdown().await.unwrap();
}

/// One batch of ops laid one after the other on the destination (so they never overlap),
/// each with its rows anywhere in the source: short rows (gathered by the sender before they
/// are written) and long ones (written in place), strided and contiguous, mixed.
fn mixed_batch() -> impl Strategy<Value = Vec<Geometry>> {
    proptest::collection::vec(
        (
            prop_oneof![1u64..200, 1000u64..1200, 4000u64..4200, 20_000u64..40_000],
            prop_oneof![Just(1u64), 1u64..80],
            0u64..3,
            0u64..SRC_LEN as u64,
            0u64..100,
        ),
        1..40,
    )
    .prop_map(|specs| {
        let mut at = 0u64;
        let mut ops = Vec::new();
        for (len, count, gaps, local_offset, rgap) in specs {
            // Source rows every `gaps + 1` rows (adjacent when 0), wrapped into the region.
            let local_stride = len * (gaps + 1);
            let local_span = (count - 1) * local_stride + len;
            let remote_stride = len + if gaps == 0 { 0 } else { rgap };
            let remote_span = (count - 1) * remote_stride + len;
            if local_span > SRC_LEN as u64 || at + remote_span > DST_LEN as u64 {
                continue;
            }
            ops.push(Geometry {
                len,
                count,
                local_offset: local_offset.min(SRC_LEN as u64 - local_span),
                local_stride,
                remote_offset: at,
                remote_stride,
            });
            at += remote_span;
        }
        ops
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn strided_ops_land_row_by_row(
        kind in 0u8..3,
        ops in proptest::collection::vec(geometry(), 1..4),
    ) {
        runtime().block_on(moves_rows(kind, ops));
    }

    #[test]
    fn a_batch_of_short_and_long_ranges_lands_byte_for_byte(
        kind in 0u8..3,
        batch in mixed_batch(),
    ) {
        runtime().block_on(moves_batches(kind, vec![batch]));
    }
}

#[test]
fn a_large_strided_batch_is_spread_over_pieces_and_connections() {
    // 1152-byte rows every 4 rows, packed on the destination (one DCP relayout page-layer),
    // 200 of them per op and 8 ops: above the inline bound, cut into 4 KiB pieces.
    let ops = (0..8)
        .map(|k| Geometry {
            len: 1152,
            count: 50,
            local_offset: k * 1152,
            local_stride: 4 * 1152,
            remote_offset: k * 50 * 1152,
            remote_stride: 1152,
        })
        .collect();
    runtime().block_on(moves_rows(1, ops));
}

#[tokio::test]
async fn post_refuses_strided_ops_it_can_check_before_sending() {
    let decode = TcpTransport::new().await.unwrap();
    let prefill = TcpTransport::new().await.unwrap();
    let (dst, dst_mem) = decode.allocate_registered(4096).await.unwrap();
    let (src, _) = prefill.allocate_registered(4096).await.unwrap();
    dst_mem.fill(0, 4096, 0xEE).unwrap();
    let peer = prefill.connect(&decode.local_descriptor()).await.unwrap();
    let post = |op: TransferOp| prefill.post(peer, TransferBatch::write(vec![op]));

    // Rows overlapping on the destination.
    let overlap = TransferOp::new(src, 0, dst, 0, 100).with_rows(4, 100, 50);
    match post(overlap).await {
        Err(TransportError::InvalidArgument { message, .. }) => {
            assert!(message.contains("overlap"), "{message}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    // The last local row past the source region.
    let local = TransferOp::new(src, 0, dst, 0, 100).with_rows(5, 1000, 100);
    match post(local).await {
        Err(TransportError::OutOfBounds {
            side: Side::Local,
            region_len: 4096,
            ..
        }) => {}
        other => panic!("expected a local OutOfBounds, got {other:?}"),
    }
    // The last remote row past the peer's region, known from its region table.
    let remote = TransferOp::new(src, 0, dst, 0, 100).with_rows(5, 100, 1000);
    match post(remote).await {
        Err(TransportError::OutOfBounds {
            side: Side::Remote,
            region_len: 4096,
            ..
        }) => {}
        other => panic!("expected a remote OutOfBounds, got {other:?}"),
    }
    // A stride whose last row's end overflows 64 bits.
    let overflow = TransferOp::new(src, 0, dst, 0, 100).with_rows(3, u64::MAX / 2, 100);
    assert!(matches!(
        post(overflow).await,
        Err(TransportError::OutOfBounds {
            side: Side::Local,
            ..
        })
    ));
    // Zero rows and zero-length rows move nothing and complete.
    for op in [
        TransferOp::new(src, 0, dst, 0, 100).with_rows(0, 100, 100),
        TransferOp::new(src, 0, dst, 0, 0).with_rows(7, 3, 0),
    ] {
        tokio::time::timeout(
            LIMIT,
            prefill.transfer(peer, TransferBatch::write(vec![op])),
        )
        .await
        .unwrap()
        .unwrap();
    }
    assert!(dst_mem.to_vec(0, 4096).unwrap().iter().all(|&b| b == 0xEE));
    assert!(prefill.capabilities().strided_ops);
}
