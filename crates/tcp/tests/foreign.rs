//! Writes in both directions between foreign (engine-owned, never borrowed) regions over TCP: the
//! receiver reads straight into them and the sender writes straight out of them, bytes
//! verified both ways.

use std::time::Duration;

use kvbridge_memory::foreign_host_region;
use kvbridge_tcp::TcpTransport;
use kvbridge_transport::{KvTransport, KvTransportExt, TransferBatch, TransferOp};

const LIMIT: Duration = Duration::from_secs(60);
const LEN: usize = 3 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_regions_move_bytes_both_ways() {
    let decode = TcpTransport::new().await.unwrap();
    let prefill = TcpTransport::new().await.unwrap();
    let (src_mem, dst_mem) = (foreign_host_region(LEN), foreign_host_region(LEN));
    assert!(!src_mem.can_borrow() && !dst_mem.can_borrow());
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 7 % 251) as u8).collect();
    src_mem.write_at(0, &pattern).unwrap();
    let src = prefill.register(src_mem.clone()).await.unwrap();
    let dst = decode.register(dst_mem.clone()).await.unwrap();
    let peer = prefill.connect(&decode.local_descriptor()).await.unwrap();
    let write = TransferOp::new(src, 0, dst, 0, LEN as u64);
    tokio::time::timeout(
        LIMIT,
        prefill.transfer(peer, TransferBatch::write(vec![write])),
    )
    .await
    .expect("write timed out")
    .unwrap();
    assert!(
        dst_mem.to_vec(0, LEN as u64).unwrap() == pattern,
        "written bytes differ"
    );
    // Strided rows back the other way into the cleared source region: rows of 1000 bytes,
    // 1500 apart.
    src_mem.fill(0, LEN as u64, 0).unwrap();
    let back = decode.connect(&prefill.local_descriptor()).await.unwrap();
    let rows = TransferOp::new(dst, 0, src, 0, 1000).with_rows(100, 1500, 1500);
    tokio::time::timeout(
        LIMIT,
        decode.transfer(back, TransferBatch::write(vec![rows])),
    )
    .await
    .expect("write back timed out")
    .unwrap();
    let got = src_mem.to_vec(0, LEN as u64).unwrap();
    for row in 0..100 {
        let at = row * 1500;
        assert!(
            got[at..at + 1000] == pattern[at..at + 1000],
            "row {row} differs"
        );
        assert!(
            got[at + 1000..at + 1500].iter().all(|b| *b == 0),
            "gap after row {row} written"
        );
    }
    prefill.shutdown().await.unwrap();
    decode.shutdown().await.unwrap();
}
