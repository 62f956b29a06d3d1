//! End-to-end transfers in one process: every decode byte verified against the owner rule.

mod common;

use common::{Request, Spec, mha, mla, rig};
use kvbridge_coordinator::{DecodeConfig, FailureCause, RoomState};

#[tokio::test(start_paused = true)]
async fn mla_one_to_one() {
    let r = rig(Spec::new(
        vec![mla("prefill", 16, 3, 64, 1, 0, 1)],
        vec![mla("decode", 16, 3, 64, 1, 0, 1)],
    ))
    .await;
    let req = Request::new(42, 100);
    for out in r.run(&req).await {
        out.unwrap();
    }
    r.prefills[0].0.wait(42).await.unwrap();
    let verified = r.verify(&req);
    assert_eq!(verified, 3 * 100 * 64);
    let m = r.prefills[0].0.metrics();
    assert_eq!(m.rooms_succeeded, 1);
    assert_eq!(
        m.batches_posted, 2,
        "one KV batch for the single chunk, then one aux batch"
    );
    assert!(m.bytes_transferred >= 3 * 100 * 64);
    let d = r.decodes[0].0.metrics();
    assert_eq!(d.rooms_by_state.get(&RoomState::Success), Some(&1));
    assert_eq!(d.transfer_latency.count, 1);
}

#[tokio::test(start_paused = true)]
async fn mha_prefill_tp2_to_decode_tp4_slices_heads() {
    let r = rig(Spec::new(
        (0..2).map(|i| mha("prefill", 4, 2, 8, 16, 2, i)).collect(),
        (0..4).map(|i| mha("decode", 4, 2, 8, 16, 4, i)).collect(),
    ))
    .await;
    let req = Request {
        chunk_pages: 3,
        ..Request::new(7, 37)
    };
    for out in r.run(&req).await {
        out.unwrap();
    }
    // Each decode rank holds 2 heads of 16 dims (bf16) per token in 4 entries (K, V of 2 layers).
    assert_eq!(r.verify(&req), 4 * (4 * 37 * 2 * 16 * 2));
}

#[tokio::test(start_paused = true)]
async fn mha_prefill_tp4_to_decode_tp2_gathers_heads() {
    let r = rig(Spec::new(
        (0..4).map(|i| mha("prefill", 4, 2, 8, 16, 4, i)).collect(),
        (0..2).map(|i| mha("decode", 4, 2, 8, 16, 2, i)).collect(),
    ))
    .await;
    let req = Request {
        chunk_pages: 2,
        ..Request::new(8, 30)
    };
    for out in r.run(&req).await {
        out.unwrap();
    }
    assert_eq!(r.verify(&req), 2 * (4 * 30 * 4 * 16 * 2));
    // Every prefill rank sent to exactly one decode rank and reported Success.
    for (p, _) in &r.prefills {
        p.wait(8).await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn mla_prefill_tp4_to_decode_tp2_uses_dummy_ranks() {
    let r = rig(Spec::new(
        (0..4).map(|i| mla("prefill", 8, 2, 32, 4, i, 1)).collect(),
        (0..2).map(|i| mla("decode", 8, 2, 32, 2, i, 1)).collect(),
    ))
    .await;
    let req = Request::new(9, 45);
    for out in r.run(&req).await {
        out.unwrap();
    }
    r.verify(&req);
    // Two prefill ranks are dummies: they learn the room, conclude it locally, move no byte.
    let bytes: Vec<u64> = r
        .prefills
        .iter()
        .map(|(p, _)| p.metrics().bytes_transferred)
        .collect();
    assert_eq!(bytes.iter().filter(|&&b| b == 0).count(), 2, "{bytes:?}");
    for (p, _) in &r.prefills {
        p.wait(9).await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn dcp_one_to_four_relayout_every_rank_byte_for_byte() {
    let r = rig(Spec::new(
        vec![mla("prefill", 4, 3, 48, 1, 0, 1)],
        (0..4).map(|i| mla("decode", 4, 3, 48, 4, i, 4)).collect(),
    ))
    .await;
    // 71 tokens: the last virtual page (16 tokens) is partial, and so is the last chunk.
    let req = Request {
        chunk_pages: 5,
        ..Request::new(11, 71)
    };
    for out in r.run(&req).await {
        out.unwrap();
    }
    assert_eq!(
        r.verify(&req),
        3 * 71 * 48,
        "every token row exactly once over the 4 ranks"
    );
    let m = r.prefills[0].0.metrics();
    assert_eq!(m.rooms_succeeded, 1);
    // 4 chunks (5+5+5+3 pages of 4 tokens) to 4 decode ranks, plus 4 aux batches.
    assert_eq!(m.batches_posted, 4 * 4 + 4);
}

#[tokio::test(start_paused = true)]
async fn chunked_send_with_partial_last_page() {
    let r = rig(Spec::mla_one_to_one()).await;
    let req = Request {
        chunk_pages: 2,
        ..Request::new(12, 16 * 7 + 5)
    };
    for out in r.run(&req).await {
        out.unwrap();
    }
    r.verify(&req);
    // 8 pages in chunks of 2 → 4 KV batches, then the aux batch.
    assert_eq!(r.prefills[0].0.metrics().batches_posted, 5);
}

#[tokio::test(start_paused = true)]
async fn aligned_decode_prefix_is_not_sent_again() {
    let r = rig(Spec::new(
        vec![mla("prefill", 4, 2, 32, 1, 0, 1)],
        (0..2).map(|i| mla("decode", 4, 2, 32, 2, i, 2)).collect(),
    ))
    .await;
    // Virtual page 8: a cached prefix of 24 tokens is aligned.
    let req = Request {
        cached_prefix: 24,
        chunk_pages: 3,
        ..Request::new(13, 61)
    };
    for out in r.run(&req).await {
        out.unwrap();
    }
    assert_eq!(r.prefills[0].0.decode_prefix_len(13), Some(24));
    r.verify(&req);
    let sent = r.prefills[0].0.metrics().bytes_transferred;
    let aux: u64 = 2 * (64 + 128);
    assert_eq!(
        sent - aux,
        2 * (61 - 24) * 32,
        "only the tokens after the prefix move"
    );
}

#[tokio::test(start_paused = true)]
async fn misaligned_decode_prefix_is_rounded_down_and_the_tail_sent_again() {
    let r = rig(Spec::new(
        vec![mla("prefill", 4, 2, 32, 1, 0, 1)],
        (0..2).map(|i| mla("decode", 4, 2, 32, 2, i, 2)).collect(),
    ))
    .await;
    // Virtual page 8: 21 cached tokens → advertise 16, receive tokens 16..21 again.
    let req = Request {
        cached_prefix: 21,
        chunk_pages: 4,
        ..Request::new(14, 50)
    };
    assert_eq!(r.decodes[0].0.advertised_prefix(21), 16);
    for out in r.run(&req).await {
        out.unwrap();
    }
    assert_eq!(r.prefills[0].0.decode_prefix_len(14), Some(16));
    r.verify(&req);
    let sent = r.prefills[0].0.metrics().bytes_transferred - 2 * (64 + 128);
    assert_eq!(sent, 2 * (50 - 16) * 32);
}

#[tokio::test(start_paused = true)]
async fn misaligned_decode_prefix_fails_with_the_seed_text_in_strict_mode() {
    let mut spec = Spec::new(
        vec![mla("prefill", 4, 2, 32, 1, 0, 1)],
        (0..2).map(|i| mla("decode", 4, 2, 32, 2, i, 2)).collect(),
    );
    spec.decode_config = DecodeConfig::default().with_strict_prefix_alignment(true);
    let r = rig(spec).await;
    let req = Request {
        cached_prefix: 21,
        ..Request::new(15, 50)
    };
    r.start(&req).await;
    for (d, _) in &r.decodes {
        let err = common::bounded(d.wait(15)).await.unwrap_err().to_string();
        assert!(
            err.starts_with("KVTransferError(bootstrap_room=15): "),
            "{err}"
        );
        assert!(
            err.contains(
                "PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size (8), got 21"
            ),
            "{err}"
        );
        assert_eq!(d.failure(15).unwrap().reason.cause, FailureCause::Planning);
        // The planner's problem code travels with the text, for `kvbridge explain`.
        assert!(err.contains("(KVB-E040)"), "{err}");
    }
    let p = &r.prefills[0].0;
    assert_eq!(p.poll(15).unwrap(), RoomState::Failed);
    assert!(p.failure(15).unwrap().to_string().contains("got 21"));
    assert_eq!(
        p.metrics().bytes_transferred,
        0,
        "nothing moves for a refused room"
    );
}

#[tokio::test(start_paused = true)]
async fn many_rooms_in_sequence_leave_no_state_behind() {
    let r = rig(Spec::new(
        vec![mla("prefill", 8, 2, 16, 1, 0, 1)],
        (0..2).map(|i| mla("decode", 8, 2, 16, 2, i, 2)).collect(),
    ))
    .await;
    for room in 100..110u64 {
        let req = Request {
            chunk_pages: 2,
            ..Request::new(room, 20 + room % 13)
        };
        for out in r.run(&req).await {
            out.unwrap();
        }
        r.verify_with(&req, false);
        r.prefills[0].0.wait(room).await.unwrap();
        r.prefills[0].0.clear(room);
        for (d, _) in &r.decodes {
            d.clear(room);
        }
    }
    assert_eq!(r.prefills[0].0.room_count(), 0);
    for (d, _) in &r.decodes {
        assert_eq!(d.room_count(), 0);
        assert_eq!(d.metrics().rooms_succeeded, 10);
        // Registration happened once per peer pair, not per room.
        assert_eq!(d.registered_peers().len(), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn concurrent_rooms_each_land_in_their_own_pages() {
    let mut spec = Spec::new(
        vec![mla("prefill", 4, 2, 16, 1, 0, 1)],
        (0..2).map(|i| mla("decode", 4, 2, 16, 2, i, 2)).collect(),
    );
    spec.prefill_pages = 24 * 8;
    spec.decode_pages = 24 * 8;
    spec.aux_rows = 24;
    let r = rig(spec).await;
    let reqs: Vec<Request> = (0..24u64)
        .map(|k| Request {
            chunk_pages: 1 + k % 3,
            block: Some((k, 8)),
            prefill_aux_row: k,
            decode_aux_row: 23 - k,
            ..Request::new(1000 + k, 20 + k % 12)
        })
        .collect();
    let outs = common::join_all(reqs.iter().map(|q| r.run(q)).collect()).await;
    for out in outs.into_iter().flatten() {
        out.unwrap();
    }
    for q in &reqs {
        r.verify_with(q, false);
    }
    let m = r.prefills[0].0.metrics();
    assert_eq!(m.rooms_succeeded, 24);
    assert_eq!(m.rooms_by_state.get(&RoomState::Success), Some(&24));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_rooms_on_a_multi_threaded_runtime() {
    let mut spec = Spec::new(
        vec![mla("prefill", 4, 2, 16, 1, 0, 1)],
        (0..4).map(|i| mla("decode", 4, 2, 16, 4, i, 4)).collect(),
    );
    spec.prefill_pages = 16 * 16;
    spec.decode_pages = 16 * 16;
    spec.aux_rows = 16;
    let r = rig(spec).await;
    let reqs: Vec<Request> = (0..16u64)
        .map(|k| Request {
            chunk_pages: 1 + k % 4,
            block: Some((k, 16)),
            prefill_aux_row: k,
            decode_aux_row: 15 - k,
            cached_prefix: (k % 3) * 16,
            ..Request::new(2000 + k, 40 + k)
        })
        .collect();
    let outs = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        common::join_all(reqs.iter().map(|q| r.run(q)).collect()),
    )
    .await
    .expect("16 small rooms finish well within 30 s");
    for out in outs.into_iter().flatten() {
        out.unwrap();
    }
    for q in &reqs {
        r.verify_with(q, false);
    }
    assert_eq!(r.prefills[0].0.metrics().rooms_succeeded, 16);
}
