//! Plan inputs above their maxima are refused with `GeometryError::TooLarge` before any work
//! or allocation of their size.

use kvbridge_geometry::{
    DcpPlanInput, GeometryError, HeadSharding, MAX_CHUNK_TOKENS, MAX_ENTRIES, MAX_GROUP_SIZE,
    MAX_KV_HEADS, MAX_PAGE_SIZE, PoolGeometry, ReshardInput, SendPages, pair_entries_flat_pp,
    pair_entries_mha_pp, reshard_sources, reshard_targets,
};

fn too_large(e: &GeometryError) -> (&'static str, u64, u64) {
    match e {
        GeometryError::TooLarge {
            field, value, max, ..
        } => (field, *value, *max),
        other => panic!("expected TooLarge, got {other:?}"),
    }
}

/// Before the bound, page sizes 2^32 and 2^62 planned one page of 2^32 (2^62) tokens, and
/// `to_token_plan` allocated 32 GiB (panicked with "capacity overflow").
#[test]
fn dcp_plan_refuses_huge_page_sizes() {
    for page_size in [1u64 << 32, 1 << 62, MAX_PAGE_SIZE + 1] {
        let e = DcpPlanInput {
            src_pages: &[0],
            dst_pages: SendPages::after_prefix(&[0]),
            page_size,
            dcp_size: 4,
            dcp_rank: 1,
            ..DcpPlanInput::default()
        }
        .plan()
        .unwrap_err();
        assert_eq!(too_large(&e), ("page_size", page_size, MAX_PAGE_SIZE));
        let text = e.to_string();
        assert!(
            text.starts_with(&format!(
                "page_size={page_size} is above the maximum of 1048576; "
            )),
            "{text}"
        );
        assert!(text.contains("docs/planning.md"), "{text}");
    }
}

#[test]
fn dcp_plan_bounds_the_dcp_size_and_the_chunk() {
    let base = DcpPlanInput {
        src_pages: &[0],
        dst_pages: SendPages::after_prefix(&[0]),
        page_size: 4,
        dcp_size: 2,
        ..DcpPlanInput::default()
    };
    let e = DcpPlanInput {
        dcp_size: MAX_GROUP_SIZE + 1,
        ..base
    }
    .plan()
    .unwrap_err();
    assert_eq!(too_large(&e).0, "dcp_size");
    // MAX_CHUNK_TOKENS + 1 tokens that the source pages do hold.
    let pages: Vec<u64> = (0..MAX_CHUNK_TOKENS / MAX_PAGE_SIZE + 1).collect();
    let e = DcpPlanInput {
        src_pages: &pages,
        dst_pages: SendPages::after_prefix(&pages),
        page_size: MAX_PAGE_SIZE,
        num_kv_tokens: Some(MAX_CHUNK_TOKENS + 1),
        ..base
    }
    .plan()
    .unwrap_err();
    assert_eq!(
        too_large(&e),
        ("num_kv_tokens", MAX_CHUNK_TOKENS + 1, MAX_CHUNK_TOKENS)
    );
    // The largest chunk is planned.
    let plan = DcpPlanInput {
        src_pages: &pages,
        dst_pages: SendPages::after_prefix(&pages),
        page_size: MAX_PAGE_SIZE,
        num_kv_tokens: Some(MAX_CHUNK_TOKENS),
        ..base
    }
    .plan()
    .unwrap();
    assert_eq!(plan.draft_len(), MAX_CHUNK_TOKENS);
}

#[test]
fn reshard_plan_bounds_its_inputs() {
    let base = ReshardInput {
        src_pages: &[0],
        dst_pages: SendPages::after_prefix(&[0]),
        src_page_size: 16,
        dst_page_size: 16,
        src_dcp_size: 1,
        dst_dcp_size: 1,
        num_tokens: 16,
        ..ReshardInput::default()
    };
    assert!(base.plan().is_ok());
    for (input, field) in [
        (
            ReshardInput {
                src_page_size: 1 << 32,
                ..base
            },
            "src_page_size",
        ),
        (
            ReshardInput {
                dst_page_size: u64::MAX,
                ..base
            },
            "dst_page_size",
        ),
        (
            ReshardInput {
                src_dcp_size: 1 << 40,
                ..base
            },
            "dcp_size",
        ),
        (
            ReshardInput {
                num_tokens: 1 << 62,
                ..base
            },
            "num_tokens",
        ),
    ] {
        assert_eq!(too_large(&input.plan().unwrap_err()).0, field);
    }
}

/// Before the bound, `reshard_sources(2^40, ..)` filtered and collected 2^40 ranks.
#[test]
fn rank_lists_are_bounded() {
    assert_eq!(
        too_large(&reshard_sources(1 << 40, 1, 0).unwrap_err()).0,
        "dcp_size"
    );
    assert_eq!(
        too_large(&reshard_targets(1, u64::MAX, 0).unwrap_err()).0,
        "dcp_size"
    );
    assert_eq!(reshard_sources(MAX_GROUP_SIZE, 1, 0).unwrap().len(), 1024);
    // Head plans loop over heads and ranks.
    let e = HeadSharding::new(MAX_KV_HEADS + 1, 1, 1).unwrap_err();
    assert_eq!(too_large(&e).0, "total_kv_heads");
    let e = HeadSharding::new(8, 1 << 33, 1).unwrap_err();
    assert_eq!(too_large(&e).0, "prefill attn_tp_size");
    assert!(HeadSharding::new(MAX_KV_HEADS, MAX_GROUP_SIZE, 1).is_ok());
}

/// Before the bound, `pair_entries_flat_pp(usize::MAX, usize::MAX, ..)` allocated
/// `usize::MAX` pairs.
#[test]
fn entry_pairings_are_bounded() {
    let e = pair_entries_flat_pp(usize::MAX, usize::MAX, 0, 0).unwrap_err();
    assert_eq!(too_large(&e).0, "n_src");
    let e = pair_entries_mha_pp(4, 8, usize::MAX).unwrap_err();
    assert_eq!(too_large(&e).0, "start_layer");
    let n = usize::try_from(MAX_ENTRIES).unwrap();
    assert_eq!(pair_entries_flat_pp(n, n, 0, 0).unwrap().len(), n);
}

#[test]
fn pools_bound_their_page_size() {
    let e = PoolGeometry::builder(1 << 32)
        .target_entries(&[1 << 33])
        .build()
        .unwrap_err();
    assert_eq!(too_large(&e).0, "page_size");
}

/// The rank lists step through the answer instead of filtering every rank; the same lists as
/// the congruence definition.
#[test]
fn rank_lists_equal_their_definition() {
    let gcd = |mut x: u64, mut y: u64| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    for a in 1..=12u64 {
        for b in 1..=12u64 {
            let g = gcd(a, b);
            for br in 0..b {
                let want: Vec<u64> = (0..a).filter(|r| r % g == br % g).collect();
                assert_eq!(reshard_sources(a, b, br).unwrap(), want, "{a} -> {b}, {br}");
            }
            for ar in 0..a {
                let want: Vec<u64> = (0..b).filter(|r| r % g == ar % g).collect();
                assert_eq!(reshard_targets(a, b, ar).unwrap(), want, "{a} -> {b}, {ar}");
            }
        }
    }
}
