//! Pack buffers: the prefill gathers strided source rows into registered buffers and posts
//! contiguous ranges from them. Every decode byte verified against the owner rule; descriptor
//! counts; a buffer is never written while the batch reading it is in flight.

mod common;

use std::time::Duration;

use common::{Request, Spec, mla, rig};
use kvbridge_coordinator::{MetricsSnapshot, PackBuffers, PrefillConfig};
use kvbridge_handshake::PeerDescriptor;
use kvbridge_mock::FaultScript;

const LAYERS: u64 = 2;
const TOK: u64 = 32;

fn ranks(role: &str, dcp: u32, page: u64) -> Vec<PeerDescriptor> {
    (0..dcp)
        .map(|i| mla(role, page, LAYERS as usize, TOK, dcp, i, dcp))
        .collect()
}

fn pack_spec(a: u32, b: u32, page: u64, pack: PackBuffers) -> Spec {
    let mut spec = Spec::new(ranks("prefill", a, page), ranks("decode", b, page));
    spec.prefill_config = PrefillConfig::default().with_pack_buffers(pack);
    spec
}

/// Runs `req` on every rank, verifies every decode byte and returns each prefill's metrics.
async fn run_verified(spec: Spec, req: &Request) -> Vec<MetricsSnapshot> {
    let r = rig(spec).await;
    for (i, out) in r.run(req).await.into_iter().enumerate() {
        out.unwrap_or_else(|e| panic!("decode rank {i}: {e}"));
    }
    for (p, _) in &r.prefills {
        common::bounded(p.wait(req.room)).await.unwrap();
    }
    assert_eq!(
        r.verify(req),
        req.input_len * LAYERS * TOK,
        "each token row exactly once over the decode ranks"
    );
    r.prefills.iter().map(|(p, _)| p.metrics()).collect()
}

/// 256 tokens in chunks of 64 (prefill page 16), pages in one reversed block on both sides,
/// so each chunk's decode pages are adjacent.
fn blocked() -> Request {
    Request {
        chunk_pages: 4,
        block: Some((0, 16)),
        ..Request::new(1, 256)
    }
}

#[tokio::test(start_paused = true)]
async fn dcp_1_to_4_posts_one_range_per_layer_chunk_and_rank() {
    let req = blocked();
    let strided = run_verified(
        Spec::new(ranks("prefill", 1, 16), ranks("decode", 4, 16)),
        &req,
    )
    .await
    .remove(0);
    let m = run_verified(pack_spec(1, 4, 16, PackBuffers::new(4, 64, 4)), &req)
        .await
        .remove(0);
    let aux = 4 * 2; // two aux buffers per decode rank
    // 4 chunks x 4 decode ranks x 2 layers.
    assert_eq!(m.descriptors_posted, 4 * 4 * LAYERS + aux);
    assert_eq!(
        m.rows_posted, m.descriptors_posted,
        "every posted range is contiguous"
    );
    assert_eq!(m.pack_batches, 4 * 4);
    assert_eq!(m.pack_bytes, 256 * LAYERS * TOK);
    // The strided path covers the same rows with one op per prefill page and layer (its rows
    // are every 4th row of the page).
    assert_eq!(strided.rows_posted, 256 * LAYERS + aux);
    assert_eq!(strided.descriptors_posted, 16 * 4 * LAYERS + aux);
    assert_eq!(strided.pack_batches, 0);
    assert_eq!(m.bytes_transferred, strided.bytes_transferred);
}

#[tokio::test(start_paused = true)]
async fn dcp_1_to_4_scrambled_pages_and_a_cached_prefix() {
    let req = Request {
        chunk_pages: 3,
        cached_prefix: 64,
        ..Request::new(2, 201)
    };
    let m = run_verified(pack_spec(1, 4, 16, PackBuffers::new(2, 48, 4)), &req).await;
    assert!(m[0].pack_batches > 0);
}

#[tokio::test(start_paused = true)]
async fn dcp_2_to_4_gathers_every_other_row() {
    let req = Request {
        chunk_pages: 2,
        ..Request::new(3, 150)
    };
    let m = run_verified(pack_spec(2, 4, 8, PackBuffers::new(2, 64, 4)), &req).await;
    assert!(m.iter().all(|m| m.pack_batches > 0));
    // Rows that stand alone (chunk edges) are posted as they are; the rest is gathered.
    let packed: u64 = m.iter().map(|m| m.pack_bytes).sum();
    assert!(
        packed > 150 * LAYERS * TOK / 2 && packed <= 150 * LAYERS * TOK,
        "{packed}"
    );
}

#[tokio::test(start_paused = true)]
async fn dcp_4_to_1_sources_are_contiguous_so_nothing_is_packed() {
    let req = Request {
        chunk_pages: 2,
        ..Request::new(4, 150)
    };
    let m = run_verified(pack_spec(4, 1, 8, PackBuffers::new(2, 64, 1)), &req).await;
    // Each prefill rank's rows are back to back on its side and every 4th row on the decode:
    // the batches post the planner's ops, strided on the destination.
    for m in &m {
        assert_eq!(m.pack_batches, 0);
        assert!(m.rows_posted > m.descriptors_posted);
    }
}

#[tokio::test(start_paused = true)]
async fn a_buffer_is_not_reused_while_its_batch_is_in_flight() {
    // One buffer; the first batch (chunk 0 to decode rank 0) is held back by the transport
    // for 10 s, so the batches to the other ranks wait for the buffer instead of overwriting
    // the rows the held batch has not sent yet.
    let mut spec = pack_spec(1, 4, 16, PackBuffers::new(1, 64, 4));
    spec.faults = vec![FaultScript::new().delay_batch(0, Duration::from_secs(10))];
    let m = run_verified(spec, &blocked()).await.remove(0);
    assert!(m.pack_waits >= 1, "the second batch waited for the buffer");
    assert_eq!(m.pack_batches, 16);
}

#[tokio::test(start_paused = true)]
async fn a_chunk_longer_than_the_buffers_hold_is_refused() {
    let spec = pack_spec(1, 4, 16, PackBuffers::new(1, 32, 4));
    let r = rig(spec).await;
    let req = blocked();
    r.start(&req).await;
    let err = r.send_all(0, &req).await.unwrap_err();
    assert!(
        err.to_string().contains("PackBuffers::max_chunk_tokens"),
        "{err}"
    );
}

#[tokio::test]
async fn pack_buffers_need_the_kv_region_handles() {
    use std::sync::Arc;

    use kvbridge_coordinator::{CoordinatorError, InProcessControlHub, KvMemory, PrefillAgent};
    use kvbridge_mock::LoopbackTransport;
    use kvbridge_transport::KvTransport;

    let desc = mla("prefill", 16, LAYERS as usize, TOK, 1, 0, 1);
    let transport: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
    let mem = KvMemory::allocate(&*transport, &desc, 4, 1).await.unwrap();
    let hub = InProcessControlHub::new();
    let config = PrefillConfig::default().with_pack_buffers(PackBuffers::new(1, 64, 1));
    let start = |regions: Option<Vec<kvbridge_transport::MemoryRegion>>, name: &str| {
        let b = PrefillAgent::builder(
            desc.clone(),
            mem.memory.clone(),
            transport.clone(),
            Arc::new(hub.channel(name).unwrap()),
        )
        .config(config.clone());
        match regions {
            Some(r) => b.kv_regions(r),
            None => b,
        }
        .start()
    };
    let err = start(None, "p0").unwrap_err();
    assert!(
        matches!(&err, CoordinatorError::InvalidSetup { message } if message.contains("kv_regions")),
        "{err}"
    );
    let err = start(Some(mem.kv_regions[..1].to_vec()), "p1").unwrap_err();
    assert!(
        err.to_string()
            .contains("one KV region handle per KV entry"),
        "{err}"
    );
    start(Some(mem.kv_regions.clone()), "p2")
        .unwrap()
        .shutdown();
}
