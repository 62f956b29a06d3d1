//! Sizes and counts above their maxima: refused as `KVB-E033` before anything is allocated or
//! looped over (a peer controls every descriptor field), and the largest accepted deployments
//! still map.

mod common;

use common::{gqa, mla, with};
use kvbridge_handshake::{
    CheckOptions, Compat, HandshakeError, MAX_AUX_BUFFERS, MAX_DEPLOYMENT_RANKS, MAX_ENTRIES,
    MAX_GROUP_SIZE, MAX_HEAD_DIM, MAX_ITEM_LEN, MAX_KV_HEADS, MAX_PAGE_SIZE, MappingInput,
    PeerDescriptor, PoolKind, ProblemCode, check, check_all_ranks, check_with, sglang_rank_mapping,
};
use proptest::prelude::*;
use serde_json::json;

fn too_large_fields(r: &kvbridge_handshake::Report) -> Vec<String> {
    r.problems
        .iter()
        .filter(|p| p.code == ProblemCode::TooLarge)
        .flat_map(|p| p.values.iter().map(|(k, _)| k.clone()))
        .collect()
}

/// Before the bound, `pp_size` 4294967295 on the prefill made the mapping collect 2^32 target
/// PP ranks (a 16 GiB allocation, then an abort).
#[test]
fn prefill_pp_size_u32_max_is_refused_before_the_mapping() {
    let prefill = with(&mla("prefill", 4, 1, 0), json!({"pp_size": 4294967295u64}));
    let r = check(&prefill, &mla("decode", 4, 4, 1));
    assert_eq!(r.codes(), [ProblemCode::TooLarge], "{:?}", r.problems);
    assert!(r.mapping.is_none());
    let p = &r.problems[0];
    assert!(
        p.message.contains("pp_size=4294967295 (max 1024)"),
        "{}",
        p.message
    );
    assert!(p.remedy.contains("docs/errors.md"), "{}", p.remedy);
    assert_eq!(too_large_fields(&r), ["prefill.pp_size"]);
}

/// Before the bound, a prefill `attn_tp_size` of 1,048,576 was accepted and its mapping took
/// quadratic time in the claimed size (262,144 target ranks, each looked up in a list of
/// 262,144).
#[test]
fn attn_tp_size_of_a_million_is_refused() {
    let prefill = with(&mla("prefill", 4, 1, 0), json!({"attn_tp_size": 1_048_576}));
    let r = check(&prefill, &mla("decode", 4, 4, 1));
    assert_eq!(r.codes(), [ProblemCode::TooLarge], "{:?}", r.problems);
    assert_eq!(too_large_fields(&r), ["prefill.attn_tp_size"]);
}

/// The largest accepted prefill TP against decode TP 1: every prefill rank is a peer, each
/// looked up once.
#[test]
fn the_largest_accepted_tp_still_maps() {
    let tp = u32::try_from(MAX_GROUP_SIZE).unwrap();
    let prefill = mla("prefill", tp, 1, 0);
    let r = check(&prefill, &mla("decode", 1, 1, 0));
    let m = r.mapping.expect("compatible");
    assert_eq!(m.peers.len(), 1024);
    assert_eq!(m.senders().count(), 1);
}

/// A deployment whose every size is within its maximum but whose product is not: the
/// bootstrap list would hold tp x cp x pp peers.
#[test]
fn the_product_of_the_sizes_is_bounded_too() {
    let prefill = with(
        &mla("prefill", 1024, 1, 0),
        json!({"attn_cp_size": 1024, "pp_size": 1024}),
    );
    let decode = mla("decode", 1, 1, 0);
    let r = kvbridge_handshake::check_with(
        &prefill,
        &decode,
        &CheckOptions::default().with_all_cp_ranks_transfer(true),
    );
    assert_eq!(
        too_large_fields(&r),
        ["prefill.attn_tp_size x attn_cp_size x pp_size"]
    );
}

#[test]
fn every_field_has_its_maximum() {
    let d = with(
        &gqa("decode", 4, 8, 0),
        json!({
            "page_size": MAX_PAGE_SIZE + 1,
            "attn_cp_size": 2048, "dcp_size": 4096,
            "total_kv_heads": MAX_KV_HEADS + 1, "head_dim": MAX_HEAD_DIM + 1,
            "kv_item_lens": [64, MAX_ITEM_LEN + 1],
            "aux_item_lens": vec![MAX_ITEM_LEN * 2; usize::try_from(MAX_AUX_BUFFERS).unwrap() + 1],
        }),
    );
    let r = check(&gqa("prefill", 4, 8, 0), &d);
    assert_eq!(
        too_large_fields(&r),
        [
            "decode.page_size",
            "decode.attn_cp_size",
            "decode.dcp_size",
            "decode.total_kv_heads",
            "decode.head_dim",
            "decode.aux_item_lens.len",
            "decode.kv_item_lens[1]",
            "decode.aux_item_lens[0]",
        ]
    );
    let entries = vec![64u64; usize::try_from(MAX_ENTRIES).unwrap() + 1];
    let d = with(&mla("decode", 4, 1, 0), json!({ "kv_item_lens": entries }));
    let r = check(&mla("prefill", 4, 1, 0), &d);
    assert_eq!(too_large_fields(&r), ["decode.kv_item_lens.len"]);
}

/// Before the bound, `--all-ranks` looped over 2^32 decode PP ranks.
#[test]
fn all_ranks_does_not_loop_over_a_claimed_count() {
    let decode = with(&mla("decode", 4, 1, 0), json!({"pp_size": 4294967295u64}));
    let ranks = check_all_ranks(&mla("prefill", 4, 1, 0), &decode, &CheckOptions::default());
    assert_eq!(ranks.len(), 1);
    assert!(ranks[0].report.codes().contains(&ProblemCode::TooLarge));
}

/// The public SGLang mapping refuses what `check` refuses, before collecting rank lists.
#[test]
fn sglang_rank_mapping_bounds_its_sizes() {
    let input = MappingInput {
        decode_tp_size: 4,
        decode_engine_rank: 0,
        decode_cp_size: 1,
        decode_pp_size: 1,
        decode_pp_rank: 0,
        decode_pool: PoolKind::Mla,
        decode_kv_cache_sharding: false,
        prefill_tp_size: 4,
        prefill_cp_size: 1,
        prefill_pp_size: u32::MAX,
        prefill_kv_cache_sharding: false,
        prefill_dsa_layer_split: false,
        all_cp_ranks_transfer: false,
    };
    let e = sglang_rank_mapping(&input).unwrap_err();
    assert!(
        matches!(&e, HandshakeError::MappingPrecondition { message, .. }
            if message == "prefill pp_size=4294967295 is above the maximum of 1024"),
        "{e}"
    );
    let e = sglang_rank_mapping(&MappingInput {
        prefill_pp_size: 64,
        prefill_cp_size: 64,
        prefill_tp_size: 64,
        all_cp_ranks_transfer: true,
        ..input
    })
    .unwrap_err();
    assert!(e.to_string().contains("262144"), "{e}");
}

/// The maxima documented in docs/errors.md ("Descriptor format") and docs/planning.md.
#[test]
fn the_documented_maxima_are_the_constants() {
    assert_eq!(MAX_PAGE_SIZE, 1 << 20);
    assert_eq!(MAX_GROUP_SIZE, 1024);
    assert_eq!(MAX_DEPLOYMENT_RANKS, 1 << 16);
    assert_eq!(MAX_KV_HEADS, 1 << 16);
    assert_eq!(MAX_HEAD_DIM, 1 << 16);
    assert_eq!(MAX_ENTRIES, 4096);
    assert_eq!(MAX_ITEM_LEN, 1 << 40);
    assert_eq!(MAX_AUX_BUFFERS, 64);
    let doc = kvbridge_handshake::catalog_markdown();
    for text in [
        "1,048,576 tokens (2^20)",
        "1,024 ranks each",
        "65,536 ranks (2^16)",
        "4,096 entries, each at most 2^40 bytes",
        "64 buffers, each at most 2^40 bytes",
    ] {
        assert!(doc.contains(text), "docs/errors.md lacks {text:?}");
    }
}

fn size() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => 0..=8u32,
        1 => 1000..=1100u32,
        1 => Just(u32::MAX),
        1 => Just(1 << 31),
        1 => any::<u32>(),
    ]
}

fn descriptor(role: &'static str) -> impl Strategy<Value = PeerDescriptor> {
    (
        (size(), size(), size(), size()),
        (size(), size(), size(), size()),
        (
            prop_oneof![Just(64u64), any::<u64>()],
            prop::option::of(size()),
            prop::option::of(size()),
        ),
        prop::sample::select(vec![PoolKind::Mha, PoolKind::Mla, PoolKind::HybridMla]),
        prop::collection::vec(prop_oneof![Just(73_728u64), any::<u64>()], 0..6),
        0..3usize,
    )
        .prop_map(
            move |(
                (tp, cp, pp, dcp),
                (tpr, cpr, ppr, dcpr),
                (page, heads, dim),
                pool,
                lens,
                nd,
            )| {
                let mut d = mla(role, 1, 1, 0);
                (d.attn_tp_size, d.attn_cp_size, d.pp_size, d.dcp_size) = (tp, cp, pp, dcp);
                (d.attn_tp_rank, d.attn_cp_rank, d.pp_rank, d.dcp_rank) = (tpr, cpr, ppr, dcpr);
                (d.page_size, d.total_kv_heads, d.head_dim) = (page, heads, dim);
                (d.kv_pool, d.kv_item_lens, d.num_draft_entries) = (pool, lens, nd);
                d
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random sizes, huge ones included, built in code (no parser in between): `check` never
    /// panics, and a value above its maximum is reported and leaves no mapping.
    #[test]
    fn random_huge_sizes_never_panic(p in descriptor("prefill"), d in descriptor("decode")) {
        for compat in [Compat::Kvbridge, Compat::Sglang] {
            let r = check_with(&p, &d, &CheckOptions::new(compat));
            let huge = |x: &PeerDescriptor| {
                [x.attn_tp_size, x.attn_cp_size, x.pp_size, x.dcp_size]
                    .iter()
                    .any(|&s| u64::from(s) > MAX_GROUP_SIZE)
                    || x.page_size > MAX_PAGE_SIZE
            };
            if huge(&p) || huge(&d) {
                prop_assert!(r.codes().contains(&ProblemCode::TooLarge));
                prop_assert!(r.mapping.is_none());
            }
            if let Some(m) = &r.mapping {
                prop_assert!(m.peers.len() as u64 <= MAX_DEPLOYMENT_RANKS);
            }
        }
    }
}
