//! Beyond SGLang: any prefill DCP size to any decode DCP size, different page sizes, and head
//! slices over resharded rows. Every decode byte verified against the owner rule.

mod common;

use common::{Request, Spec, mha, mla, rig};

fn prefill_dcp(a: u32, page: u64) -> Vec<kvbridge_handshake::PeerDescriptor> {
    (0..a)
        .map(|i| mla("prefill", page, 2, 32, a, i, a))
        .collect()
}

fn decode_dcp(b: u32, page: u64) -> Vec<kvbridge_handshake::PeerDescriptor> {
    (0..b)
        .map(|i| mla("decode", page, 2, 32, b, i, b))
        .collect()
}

async fn check(
    prefill: Vec<kvbridge_handshake::PeerDescriptor>,
    decode: Vec<kvbridge_handshake::PeerDescriptor>,
    reqs: &[Request],
) {
    let r = rig(Spec::new(prefill, decode)).await;
    for req in reqs {
        for (i, out) in r.run(req).await.into_iter().enumerate() {
            out.unwrap_or_else(|e| panic!("room {} decode rank {i}: {e}", req.room));
        }
        for (p, _) in &r.prefills {
            common::bounded(p.wait(req.room)).await.unwrap();
        }
        let verified = r.verify_with(req, reqs.len() == 1);
        let per_token: u64 = 2 * 32;
        let owned_everywhere = req.input_len * per_token;
        assert_eq!(
            verified, owned_everywhere,
            "room {}: each token row exactly once over the decode ranks",
            req.room
        );
    }
}

fn reqs() -> Vec<Request> {
    vec![
        Request {
            chunk_pages: 3,
            ..Request::new(1, 75)
        },
        Request {
            chunk_pages: 2,
            cached_prefix: 32,
            ..Request::new(2, 101)
        },
    ]
}

#[tokio::test(start_paused = true)]
async fn dcp_2_to_4() {
    check(prefill_dcp(2, 4), decode_dcp(4, 4), &reqs()).await;
}

#[tokio::test(start_paused = true)]
async fn dcp_4_to_2() {
    check(prefill_dcp(4, 4), decode_dcp(2, 4), &reqs()).await;
}

#[tokio::test(start_paused = true)]
async fn dcp_4_to_1() {
    check(prefill_dcp(4, 4), decode_dcp(1, 4), &reqs()).await;
}

#[tokio::test(start_paused = true)]
async fn prefill_page_16_to_decode_page_64() {
    check(
        prefill_dcp(1, 16),
        decode_dcp(1, 64),
        &[
            Request {
                chunk_pages: 2,
                ..Request::new(3, 150)
            },
            Request {
                chunk_pages: 3,
                cached_prefix: 64,
                ..Request::new(4, 200)
            },
        ],
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn prefill_page_64_to_decode_page_16_starts_mid_page() {
    // A 48-token decode prefix is aligned for the decode (page 16) but falls inside a prefill
    // page of 64: the first chunk starts mid-page.
    check(
        prefill_dcp(1, 64),
        decode_dcp(1, 16),
        &[Request {
            chunk_pages: 1,
            cached_prefix: 48,
            ..Request::new(5, 200)
        }],
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn dcp_2_to_4_with_page_8_to_16() {
    check(prefill_dcp(2, 8), decode_dcp(4, 16), &reqs()).await;
}

#[tokio::test(start_paused = true)]
async fn mha_tp2_to_tp4_with_page_16_to_32_slices_heads_over_rows() {
    let r = rig(Spec::new(
        (0..2).map(|i| mha("prefill", 16, 2, 8, 16, 2, i)).collect(),
        (0..4).map(|i| mha("decode", 32, 2, 8, 16, 4, i)).collect(),
    ))
    .await;
    let req = Request {
        chunk_pages: 2,
        ..Request::new(6, 90)
    };
    for out in r.run(&req).await {
        out.unwrap();
    }
    assert_eq!(r.verify(&req), 4 * (4 * 90 * 2 * 16 * 2));
}
