//! Head-major pages (`kv_layout` `LBHNC`, vLLM's CPU layout) between attention TP sizes:
//! every decode byte verified against the (global head, token) it came from; pages go whole,
//! a partial last page's other slots (poisoned on the prefill) included, and nothing outside
//! the request's pages is written.

mod common;

use common::{AUX_LENS, Request, Rig, Spec, bounded, join_all, kv_views, mha, request, rig};
use kvbridge_coordinator::FailureCause;
use kvbridge_handshake::{HEAD_MAJOR_KV_LAYOUT, PeerDescriptor, ProblemCode, check};
use kvbridge_testkit::fill::{fill_rows, verify_rows, verify_untouched};

/// A vLLM CPU rank: one entry per layer (`layers` even), each page `[heads of the rank,
/// page, 2·head_size]` bf16, `head_dim = 2·head_size` as the connector advertises it.
fn lbhnc(
    role: &str,
    page: u64,
    layers: usize,
    heads: u32,
    head_size: u32,
    tp: u32,
    rank: u32,
) -> PeerDescriptor {
    // `mha` registers K and V per layer: `layers / 2` of them are `layers` entries of the
    // same size as vLLM's one entry per layer.
    PeerDescriptor::mha(
        role.parse().unwrap(),
        page,
        layers / 2,
        heads,
        2 * head_size,
    )
    .element_bytes(2)
    .attn_tp(tp, rank)
    .kv_layout(HEAD_MAJOR_KV_LAYOUT)
    .aux_item_lens(AUX_LENS.to_vec())
    .build()
    .unwrap()
}

/// TP `a` → TP `b`, 4 KV heads of head size 8, pages of 4 tokens, 4 layers.
async fn tp(a: u32, b: u32, heads: u32) -> Rig {
    rig(Spec::new(
        (0..a)
            .map(|i| lbhnc("prefill", 4, 4, heads, 8, a, i))
            .collect(),
        (0..b)
            .map(|i| lbhnc("decode", 4, 4, heads, 8, b, i))
            .collect(),
    ))
    .await
}

/// Runs `req` with the prefill's slots past `input_len` (the rest of the last page) filled
/// with another room's bytes: head-major pages go whole, so the decode must hold those bytes
/// in the same slots of its last page, and nothing outside the request's pages. Returns the
/// bytes of the request's tokens verified.
async fn run_and_verify(r: &Rig, req: &Request) -> u64 {
    r.start(req).await;
    for (i, (_, rank)) in r.prefills.iter().enumerate() {
        let layout = r.prefill_layout(i, req);
        let end = req.input_len.next_multiple_of(layout.page_size);
        fill_rows(
            &kv_views(&rank.mem),
            &layout,
            req.room + 1000,
            req.input_len..end,
        )
        .unwrap();
    }
    let senders = (0..r.prefills.len()).map(|i| r.send_all(i, req)).collect();
    for sent in join_all(senders).await {
        sent.unwrap();
    }
    for (agent, _) in &r.decodes {
        bounded(agent.wait(req.room)).await.unwrap();
    }
    let verified = r.verify_with(req, false);
    for (i, (_, rank)) in r.decodes.iter().enumerate() {
        let layout = r.decode_layout(i, req);
        let end = req.input_len.next_multiple_of(layout.page_size);
        let views = kv_views(&rank.mem);
        verify_rows(&views, &layout, req.room + 1000, req.input_len..end)
            .unwrap_or_else(|e| panic!("decode rank {i}, the last page's other slots: {e}"));
        verify_untouched(&views, &layout, 0..end)
            .unwrap_or_else(|e| panic!("decode rank {i}: {e}"));
    }
    verified
}

/// Bytes a decode group of `b` ranks holds for `tokens` tokens: 4 entries, every head once
/// per rank that holds it (`max(1, heads/b)` heads a rank), 2·8 bf16 per head and token.
fn held(b: u64, heads: u64, tokens: u64) -> u64 {
    b * 4 * tokens * (heads / b).max(1) * 2 * 8 * 2
}

#[tokio::test(start_paused = true)]
async fn tp_1_to_2_in_chunks_with_a_partial_last_page() {
    let r = tp(1, 2, 4).await;
    let req = Request {
        chunk_pages: 3,
        ..Request::new(7, 37)
    };
    assert_eq!(run_and_verify(&r, &req).await, held(2, 4, 37));
}

/// One entry per layer, as vLLM registers them: `layers` of them, any count.
fn lbhnc_layers(role: &str, layers: usize, tp: u32, rank: u32) -> PeerDescriptor {
    let heads_here = u64::from(4 / tp.min(4));
    PeerDescriptor::builder(role.parse().unwrap())
        .page_size(4)
        .kv_pool(kvbridge_handshake::PoolKind::Mha)
        .heads(4, 2 * 8)
        .element_bytes(2)
        .kv_item_lens(vec![4 * heads_here * 2 * 8 * 2; layers])
        .attn_tp(tp, rank)
        .kv_layout(HEAD_MAJOR_KV_LAYOUT)
        .aux_item_lens(AUX_LENS.to_vec())
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn an_odd_number_of_layers_moves_as_any_other() {
    // Head-major pages hold K and V of a layer in one entry: nothing pairs entries, so a
    // model of 3 layers is 3 entries (a K/V-paired MHA pool refuses an odd count).
    let r = rig(Spec::new(
        (0..2).map(|i| lbhnc_layers("prefill", 3, 2, i)).collect(),
        vec![lbhnc_layers("decode", 3, 1, 0)],
    ))
    .await;
    let req = Request {
        chunk_pages: 2,
        ..Request::new(9, 21)
    };
    assert_eq!(run_and_verify(&r, &req).await, 3 * 4 * 21 * 2 * 8 * 2);
}

#[tokio::test(start_paused = true)]
async fn tp_2_to_1_gathers_whole_pages_of_each_prefill() {
    let r = tp(2, 1, 4).await;
    let req = Request::new(3, 40);
    assert_eq!(run_and_verify(&r, &req).await, held(1, 4, 40));
}

#[tokio::test(start_paused = true)]
async fn tp_2_to_4_with_a_cached_decode_prefix() {
    let r = tp(2, 4, 4).await;
    let req = Request {
        chunk_pages: 2,
        cached_prefix: 8,
        ..Request::new(11, 45)
    };
    assert_eq!(run_and_verify(&r, &req).await, held(4, 4, 45));
}

#[tokio::test(start_paused = true)]
async fn tp_4_to_2_in_chunks_with_a_prefix_and_a_partial_page() {
    let r = tp(4, 2, 4).await;
    let req = Request {
        chunk_pages: 3,
        cached_prefix: 4,
        ..Request::new(5, 30)
    };
    assert_eq!(run_and_verify(&r, &req).await, held(2, 4, 30));
}

#[tokio::test(start_paused = true)]
async fn gqa_replicated_heads_on_either_side() {
    // 2 KV heads: a prefill of TP 4 holds each head twice, a decode of TP 4 wants each twice.
    let r = tp(4, 1, 2).await;
    let req = Request::new(21, 23);
    assert_eq!(run_and_verify(&r, &req).await, held(1, 2, 23));
    let r = tp(1, 4, 2).await;
    let req = Request {
        chunk_pages: 2,
        ..Request::new(22, 23)
    };
    assert_eq!(run_and_verify(&r, &req).await, held(4, 2, 23));
}

#[tokio::test(start_paused = true)]
async fn tp_2_to_4_one_layer_at_a_time() {
    let r = tp(2, 4, 4).await;
    let req = Request {
        chunk_pages: 3,
        layers_per_part: Some(1),
        cached_prefix: 4,
        ..Request::new(9, 33)
    };
    assert_eq!(run_and_verify(&r, &req).await, held(4, 4, 33));
    // To each of its 2 decode ranks: 3 chunks of 4 one-entry parts, then the aux batch.
    assert_eq!(r.prefills[0].0.metrics().batches_posted, 2 * (3 * 4 + 1));
}

#[tokio::test(start_paused = true)]
async fn head_major_pages_post_one_row_per_page_where_token_major_posts_one_per_token() {
    // The same bytes (4 heads, TP 1 -> 2, 2 entries, pages of 16) laid out both ways.
    let rows = |head_major: bool| async move {
        let desc = |role: &str, tp: u32, rank: u32| {
            let mut d = mha(role, 16, 1, 4, 16, tp, rank);
            if head_major {
                d.kv_layout = Some(HEAD_MAJOR_KV_LAYOUT.to_owned());
            }
            d
        };
        let r = rig(Spec::new(
            vec![desc("prefill", 1, 0)],
            (0..2).map(|i| desc("decode", 2, i)).collect(),
        ))
        .await;
        let req = Request::new(4, 64);
        for out in r.run(&req).await {
            out.unwrap();
        }
        r.verify(&req);
        let m = r.prefills[0].0.metrics();
        (m.descriptors_posted, m.rows_posted)
    };
    // Aux: 2 buffers x 2 decode ranks, one row each.
    let (hm, tm) = (rows(true).await, rows(false).await);
    assert_eq!(
        hm.1,
        2 * 2 * 4 + 4,
        "one row per entry, page and decode rank: {hm:?}"
    );
    assert_eq!(tm.1, 2 * 2 * 4 * 16 + 4, "one row per token: {tm:?}");
}

#[tokio::test(start_paused = true)]
async fn a_layout_named_on_one_side_only_is_refused() {
    let p = lbhnc("prefill", 4, 4, 4, 8, 1, 0);
    // Two different layout names: the handshake refuses them.
    let mut named = lbhnc("decode", 4, 4, 4, 8, 1, 0);
    named.kv_layout = Some("NHD".to_owned());
    let report = check(&p, &named);
    assert!(
        report
            .problems
            .iter()
            .any(|x| x.code == ProblemCode::LayoutMismatch)
    );
    // A layout on one side only passes the handshake (SGLang's rule), so the planner refuses
    // it at registration: the bytes are laid out differently.
    let mut plain = named;
    plain.kv_layout = None;
    assert!(check(&p, &plain).is_compatible());
    let r = rig(Spec::new(vec![p], vec![plain])).await;
    let d = &r.decodes[0].0;
    d.receive(1, request(vec![0, 1])).unwrap();
    let err = bounded(d.wait(1)).await.unwrap_err().to_string();
    assert!(
        err.contains(
            "the prefill pages are head-major (kv_layout LBHNC) but the decode pages are not \
             (kv_layout not set)"
        ),
        "{err}"
    );
    assert_eq!(
        d.failure(1).unwrap().reason.cause,
        FailureCause::PeerRejected
    );
}

#[tokio::test(start_paused = true)]
async fn head_major_pages_of_different_sizes_are_refused_at_registration() {
    // The handshake lets different page sizes through (the resharding path), but that path
    // moves token rows, which head-major pages do not have.
    let r = rig(Spec::new(
        vec![lbhnc("prefill", 4, 4, 4, 8, 1, 0)],
        (0..2).map(|i| lbhnc("decode", 8, 4, 4, 8, 2, i)).collect(),
    ))
    .await;
    let d = &r.decodes[1].0;
    d.receive(1, request(vec![0, 1])).unwrap();
    let err = bounded(d.wait(1)).await.unwrap_err().to_string();
    assert!(
        err.contains(
            "head-major pages (kv_layout LBHNC) are planned with equal page sizes and no DCP only"
        ),
        "{err}"
    );
}
