//! Every check that applies to descriptors, one test (or more) per problem code of
//! docs/errors.md, in both compatibility modes. SGLang's texts are asserted verbatim.

mod common;

use common::{gqa, mla, with};
use kvbridge_handshake::{
    CheckOptions, Compat, HandshakeError, PoolKind, ProblemCode as C, ProtocolVersion, Report,
    Severity, TransferPath, check, check_with,
};
use serde_json::json;

fn sglang(
    p: &kvbridge_handshake::PeerDescriptor,
    d: &kvbridge_handshake::PeerDescriptor,
) -> Report {
    check_with(p, d, &CheckOptions::new(Compat::Sglang))
}

fn both(
    p: &kvbridge_handshake::PeerDescriptor,
    d: &kvbridge_handshake::PeerDescriptor,
) -> [Report; 2] {
    [sglang(p, d), check(p, d)]
}

fn only(r: &Report, code: C) -> &kvbridge_handshake::Problem {
    assert_eq!(r.codes(), [code], "{:#?}", r.problems);
    assert!(r.mapping.is_none());
    &r.problems[0]
}

#[test]
fn matching_mla_pair_is_compatible_with_mapping_and_no_warnings() {
    for r in both(&mla("prefill", 4, 1, 0), &mla("decode", 4, 1, 2)) {
        assert!(r.is_compatible(), "{:?}", r.problems);
        assert!(r.warnings.is_empty());
        let m = r.mapping.expect("mapping");
        assert_eq!(m.target_tp_ranks, [2]);
        assert_eq!(m.path, TransferPath::Pages);
    }
}

// ---- SGLang's decode-side checks (KVB-E001..E012) ----

#[test]
fn e001_page_size_mismatch_sglang_text_and_kvbridge_accepts() {
    let p = mla("prefill", 4, 1, 0);
    let d = with(
        &mla("decode", 4, 1, 0),
        json!({"page_size": 16, "kv_item_lens": [18432, 18432]}),
    );
    let r = sglang(&p, &d);
    let pr = only(&r, C::PageSizeMismatch);
    assert_eq!(
        pr.message,
        "Page size mismatch: prefill server has page_size=64, but decode server has page_size=16. \
         Both servers must use the same --page-size value."
    );
    assert!(pr.remedy.contains("--page-size"));
    assert_eq!(
        pr.values[0],
        ("prefill.page_size".to_owned(), "64".to_owned())
    );
    let k = check(&p, &d);
    assert!(k.is_compatible(), "{:?}", k.problems);
    assert_eq!(
        k.mapping.expect("mapping").path,
        TransferPath::Rows { head_slices: false }
    );
}

#[test]
fn e001_kvbridge_still_requires_equal_bytes_per_token() {
    let p = mla("prefill", 4, 1, 0);
    // page 16 but the per-token width is half: 9216 / 16 = 576 != 73728 / 64 = 1152.
    let d = with(
        &mla("decode", 4, 1, 0),
        json!({"page_size": 16, "kv_item_lens": [9216, 9216]}),
    );
    let r = check(&p, &d);
    assert_eq!(r.codes(), [C::EntryGeometry, C::EntryGeometry]);
    assert!(
        r.problems[0]
            .message
            .contains("prefill bytes per token=1152, decode bytes per token=576")
    );
}

#[test]
fn e002_dtype_mismatch() {
    let p = mla("prefill", 4, 1, 0);
    let d = with(
        &mla("decode", 4, 1, 0),
        json!({"kv_cache_dtype": "fp8_e4m3"}),
    );
    for r in both(&p, &d) {
        assert_eq!(
            only(&r, C::DtypeMismatch).message,
            "KV cache dtype mismatch: prefill server has kv_cache_dtype=auto, but decode server has \
             kv_cache_dtype=fp8_e4m3. Both servers must use the same --kv-cache-dtype value."
        );
    }
}

#[test]
fn e004_layout_mismatch_only_when_both_set() {
    let p = with(&mla("prefill", 4, 1, 0), json!({"kv_layout": "a"}));
    let d = with(&mla("decode", 4, 1, 0), json!({"kv_layout": "b"}));
    for r in both(&p, &d) {
        assert_eq!(
            only(&r, C::LayoutMismatch).message,
            "KV layout mismatch: prefill server has kv_layout=a, but decode server has kv_layout=b. \
             Both servers must use the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT."
        );
    }
    assert!(check(&p, &mla("decode", 4, 1, 0)).is_compatible());
}

#[test]
fn e007_decode_dcp_needs_mla_pool() {
    let p = gqa("prefill", 4, 8, 0);
    let d = with(
        &gqa("decode", 4, 8, 1),
        json!({"dcp_size": 2, "dcp_rank": 1}),
    );
    for r in both(&p, &d) {
        let pr = &r.problems[0];
        assert_eq!(pr.code, C::DcpNeedsMlaPool);
        assert_eq!(
            pr.message,
            "PD decode DCP requires an MLA or hybrid-MLA KV pool."
        );
        assert!(pr.remedy.contains("--dcp-size 1"));
    }
    // SGLang's prefill also refuses the topology (1 -> 2 on an MHA pool).
    assert_eq!(sglang(&p, &d).codes(), [C::DcpNeedsMlaPool, C::DcpTopology]);
    assert_eq!(check(&p, &d).codes(), [C::DcpNeedsMlaPool]);
    // Hybrid MLA is fine.
    let hp = with(&mla("prefill", 4, 1, 0), json!({"kv_pool": "hybrid_mla"}));
    let hd = with(&mla("decode", 4, 2, 1), json!({"kv_pool": "hybrid_mla"}));
    assert!(sglang(&hp, &hd).is_compatible());
}

#[test]
fn e007_prefill_dcp_on_mha_pool_refused_by_kvbridge() {
    let p = with(&gqa("prefill", 4, 8, 0), json!({"dcp_size": 2}));
    let d = gqa("decode", 4, 8, 0);
    let r = check(&p, &d);
    assert_eq!(
        only(&r, C::DcpNeedsMlaPool).message,
        "PD prefill DCP requires an MLA or hybrid-MLA KV pool."
    );
    assert_eq!(sglang(&p, &d).codes(), [C::DcpTopology]);
    assert_eq!(
        sglang(&p, &d).problems[0].message,
        "Unsupported PD DCP topology: 2 -> 1"
    );
}

#[test]
fn e008_dcp_needs_prefill_cp1() {
    let p = with(&mla("prefill", 4, 1, 0), json!({"attn_cp_size": 2}));
    let d = mla("decode", 4, 4, 0);
    for r in both(&p, &d) {
        assert_eq!(
            only(&r, C::DcpPrefillCp).message,
            "PD decode DCP currently requires prefill attention CP=1, got 2."
        );
    }
    let p2 = with(&mla("prefill", 4, 2, 0), json!({"attn_cp_size": 2}));
    let r = check(&p2, &mla("decode", 4, 1, 0));
    assert_eq!(
        only(&r, C::DcpPrefillCp).message,
        "PD prefill DCP requires prefill attention CP=1, got 2."
    );
}

#[test]
fn e009_dcp_with_prefill_sharding() {
    let p = with(&mla("prefill", 4, 1, 0), json!({"kv_cache_sharding": true}));
    let d = mla("decode", 4, 4, 0);
    for r in both(&p, &d) {
        assert_eq!(
            only(&r, C::DcpPrefillSharding).message,
            "PD decode DCP does not support a prefill with --enable-kv-cache-sharding."
        );
    }
}

#[test]
fn e010_mla_sharding_needs_equal_tp() {
    let p = with(&mla("prefill", 2, 1, 0), json!({"kv_cache_sharding": true}));
    let d = mla("decode", 4, 1, 3);
    for r in both(&p, &d) {
        assert_eq!(
            only(&r, C::MlaShardingTp).message,
            "MLA KV cache sharding requires equal prefill/decode attn TP sizes, got prefill=2 decode=4"
        );
    }
    let ok = check(&with(&p, json!({"attn_tp_size": 4})), &d);
    let m = ok.mapping.expect("compatible");
    assert_eq!(
        (
            m.target_tp_rank,
            m.required_dst_info_num,
            m.required_prefill_response_num
        ),
        (None, 4, 4)
    );
    assert!(m.peers.iter().all(|p| !p.is_dummy));
}

#[test]
fn e011_decode_cp_must_be_1() {
    let d = with(&mla("decode", 4, 1, 0), json!({"attn_cp_size": 2}));
    for r in both(&mla("prefill", 4, 1, 0), &d) {
        assert_eq!(
            only(&r, C::DecodeCp).message,
            "Decode cp size (2) should be equal to 1"
        );
    }
}

#[test]
fn e012_pp_sizes() {
    let p = with(&mla("prefill", 4, 1, 0), json!({"pp_size": 4}));
    let d = with(&mla("decode", 4, 1, 0), json!({"pp_size": 2}));
    for r in both(&p, &d) {
        assert_eq!(
            only(&r, C::PpMismatch).message,
            "Decode pp size (2) should be equal to prefill pp size (4) or 1"
        );
    }
    // Decode PP 1 pulls from every stage (the prefill stage has a subset of the layers).
    let r = check(&p, &mla("decode", 4, 1, 0));
    assert_eq!(r.mapping.expect("compatible").target_pp_ranks, [0, 1, 2, 3]);
}

// ---- DCP topologies (KVB-E014 in SGLang mode), and kvbridge's answers ----

#[test]
fn topology_1_to_1_page_path_any_pool() {
    for (p, d) in [
        (mla("prefill", 4, 1, 0), mla("decode", 4, 1, 0)),
        (gqa("prefill", 4, 8, 0), gqa("decode", 4, 8, 0)),
    ] {
        let r = sglang(&p, &d);
        assert_eq!(r.mapping.expect("compatible").path, TransferPath::Pages);
    }
}

#[test]
fn topology_2_to_2_matching_ranks_page_path() {
    let r = sglang(&mla("prefill", 2, 2, 1), &mla("decode", 2, 2, 1));
    let m = r.mapping.expect("compatible");
    assert_eq!(m.path, TransferPath::Pages);
    assert_eq!((m.peers[0].dcp_rank, m.decode_dcp_rank), (1, 1));
    // An MHA pool with equal DCP sizes passes the prefill-side table but not decode row 7.
    let p = with(&gqa("prefill", 2, 8, 0), json!({"dcp_size": 2}));
    let d = with(
        &gqa("decode", 2, 8, 1),
        json!({"dcp_size": 2, "dcp_rank": 1}),
    );
    assert_eq!(sglang(&p, &d).codes(), [C::DcpNeedsMlaPool]);
}

#[test]
fn topology_2_to_2_mismatched_ranks() {
    // Decode TP 4 rank 1 (DCP rank 1) maps to prefill TP 2 rank 0 (DCP rank 0).
    let r = sglang(&mla("prefill", 2, 2, 0), &mla("decode", 4, 2, 1));
    assert_eq!(
        only(&r, C::DcpRankMismatch).message,
        "PD peers must connect matching DCP ranks, got prefill=0, decode=1"
    );
}

#[test]
fn topology_1_to_4_relayout_for_mla_and_hybrid() {
    for pool in ["mla", "hybrid_mla"] {
        let p = with(&mla("prefill", 4, 1, 0), json!({"kv_pool": pool}));
        let d = with(&mla("decode", 4, 4, 3), json!({"kv_pool": pool}));
        for r in both(&p, &d) {
            assert_eq!(
                r.mapping.expect("compatible").path,
                TransferPath::DcpTokenPlan,
                "{pool}"
            );
        }
    }
}

#[test]
fn topology_1_to_4_mha_unsupported() {
    let p = gqa("prefill", 4, 8, 0);
    let d = with(&gqa("decode", 4, 8, 0), json!({"dcp_size": 4}));
    let r = sglang(&p, &d);
    assert!(
        r.problems
            .iter()
            .any(|p| p.message == "Unsupported PD DCP topology: 1 -> 4")
    );
}

#[test]
fn topology_2_to_4_unsupported_in_sglang_supported_in_kvbridge() {
    let p = mla("prefill", 4, 2, 0);
    let d = mla("decode", 4, 4, 0);
    assert_eq!(
        only(&sglang(&p, &d), C::DcpTopology).message,
        "Unsupported PD DCP topology: 2 -> 4"
    );
    let m = check(&p, &d).mapping.expect("kvbridge supports 2 -> 4");
    assert_eq!(m.path, TransferPath::Rows { head_slices: false });
    assert_eq!((m.prefill_dcp_size, m.decode_dcp_size), (2, 4));
}

#[test]
fn topology_4_to_1_and_4_to_2_unsupported_in_sglang() {
    for (b, text) in [
        (1, "Unsupported PD DCP topology: 4 -> 1"),
        (2, "Unsupported PD DCP topology: 4 -> 2"),
    ] {
        let p = mla("prefill", 4, 4, 0);
        let d = mla("decode", 4, b, 0);
        assert_eq!(only(&sglang(&p, &d), C::DcpTopology).message, text);
        assert!(check(&p, &d).is_compatible());
    }
}

// ---- DCP geometry check (docs/planning.md, "DCP geometry check") ----

#[test]
fn e015_dcp_entry_count() {
    let p = mla("prefill", 4, 1, 0);
    let d = with(
        &mla("decode", 4, 4, 0),
        json!({"kv_item_lens": [73728, 73728, 73728]}),
    );
    for r in both(&p, &d) {
        assert_eq!(
            only(&r, C::DcpEntryCount).message,
            "PD DCP requires the decode to register one KV entry per prefill entry: src=2 (draft=0), dst=3"
        );
    }
}

#[test]
fn e016_dcp_geometry_sglang_example() {
    // P=64, src [2048,2048,1024], one draft, dst [2048,2048,4096], d=4 -> OK.
    let p = with(
        &mla("prefill", 4, 1, 0),
        json!({"kv_pool": "hybrid_mla", "kv_item_lens": [2048, 2048, 1024], "num_draft_entries": 1}),
    );
    let d = with(
        &mla("decode", 4, 4, 0),
        json!({"kv_pool": "hybrid_mla", "kv_item_lens": [2048, 2048, 4096], "num_draft_entries": 1}),
    );
    assert!(sglang(&p, &d).is_compatible());
    // The draft entry registered with the physical page: 1024 / 256 = 4 token bytes.
    let bad = with(&d, json!({"kv_item_lens": [2048, 1024, 1024]}));
    for r in both(&p, &bad) {
        assert_eq!(
            r.codes(),
            [C::DcpEntryGeometry, C::DcpEntryGeometry],
            "{:#?}",
            r.problems
        );
        assert_eq!(
            r.problems[0].message,
            "PD DCP source/destination KV geometry differs at entry 1: src token bytes=32, dst token bytes=16 \
             (dst item_len=1024, page scale=64)"
        );
        assert_eq!(
            r.problems[1].message,
            "PD DCP source/destination KV geometry differs at entry 2: src token bytes=16, dst token bytes=4 \
             (dst item_len=1024, page scale=256)"
        );
        assert!(
            r.problems[1]
                .remedy
                .contains("expected decode item_len 4096")
        );
    }
}

#[test]
fn e016_generalised_for_prefill_dcp_and_page_sizes() {
    // Prefill DCP 2, page 16 -> decode DCP 4, page 64, one draft entry of 16 B/token.
    let p = with(
        &mla("prefill", 2, 2, 0),
        json!({"page_size": 16, "kv_pool": "hybrid_mla",
        "kv_item_lens": [512, 512], "num_draft_entries": 1}),
    );
    let d = with(
        &mla("decode", 4, 4, 0),
        json!({"kv_pool": "hybrid_mla",
        "kv_item_lens": [2048, 4096], "num_draft_entries": 1}),
    );
    let r = check(&p, &d);
    assert!(r.is_compatible(), "{:#?}", r.problems);
    let bad = with(&d, json!({"kv_item_lens": [2048, 2048]}));
    let r = check(&p, &bad);
    assert_eq!(
        only(&r, C::DcpEntryGeometry).message,
        "PD DCP source/destination KV geometry differs at entry 1: src token bytes=16, dst token bytes=8 \
         (dst item_len=2048, page scale=256)"
    );
}

// ---- aux buffers (KVB-E017, KVB-W002), head slicing (KVB-E018) ----

#[test]
fn e017_aux_buffers_differ() {
    let p = with(
        &mla("prefill", 4, 1, 0),
        json!({"aux_item_lens": [4, 8, 16384]}),
    );
    let d = with(
        &mla("decode", 4, 1, 0),
        json!({"aux_item_lens": [4, 16384]}),
    );
    for r in both(&p, &d) {
        let pr = only(&r, C::AuxLayout);
        assert!(
            pr.message
                .contains("buffer 1: prefill 8 B/row, decode 16384 B/row"),
            "{}",
            pr.message
        );
    }
}

#[test]
fn w002_extra_trailing_aux_buffer_is_a_warning() {
    let p = with(
        &mla("prefill", 4, 1, 0),
        json!({"aux_item_lens": [4, 16384]}),
    );
    let d = with(
        &mla("decode", 4, 1, 1),
        json!({"aux_item_lens": [4, 16384, 8]}),
    );
    for r in both(&p, &d) {
        assert!(r.is_compatible());
        assert_eq!(r.warnings.len(), 1);
        assert_eq!(r.warnings[0].code, C::AuxCount);
        assert_eq!(r.warnings[0].severity, Severity::Warning);
        assert!(r.warnings[0].message.starts_with(
            "Decode attn_tp_rank=1 registered 3 metadata buffers but this prefill has 2; only the first 2 \
             are transferred, and misaligned if the extra buffer is not the last."
        ));
    }
}

#[test]
fn w003_fields_of_a_newer_minor_version_are_a_warning() {
    let p = with(
        &mla("prefill", 4, 1, 0),
        json!({"protocol_version": "1.3", "kv_zones": 4, "zone_names": ["a"]}),
    );
    assert_eq!(p.unknown_fields(), ["kv_zones", "zone_names"]);
    for r in both(&p, &mla("decode", 4, 1, 1)) {
        assert!(r.is_compatible(), "{:?}", r.problems);
        assert!(r.mapping.is_some());
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
        let w = &r.warnings[0];
        assert_eq!(
            (w.code, w.severity),
            (C::NewerMinorFields, Severity::Warning)
        );
        assert_eq!(w.code.as_str(), "KVB-W003");
        assert_eq!(
            w.message,
            "prefill descriptor uses protocol_version 1.3, newer than this kvbridge's 1.0; its \
             fields kv_zones, zone_names are unknown here and ignored"
        );
    }
    // However many fields a peer adds, the warning names a few and counts the rest.
    let many: serde_json::Map<String, serde_json::Value> = (0..1000)
        .map(|i| (format!("f{i:04}"), json!(i)))
        .chain([("protocol_version".to_owned(), json!("1.3"))])
        .collect();
    let p = with(&mla("prefill", 4, 1, 0), serde_json::Value::Object(many));
    assert_eq!(p.unknown_fields().len(), 1000);
    let r = check(&p, &mla("decode", 4, 1, 1));
    assert!(
        r.warnings[0]
            .message
            .contains("f0014, f0015 and 984 more are unknown"),
        "{}",
        r.warnings[0].message
    );
    // A newer minor version without new fields is nothing to warn about.
    let p = with(&mla("prefill", 4, 1, 0), json!({"protocol_version": "1.3"}));
    assert!(check(&p, &mla("decode", 4, 1, 1)).warnings.is_empty());
}

#[test]
fn e018_head_slicing_needs_one_item_length() {
    // Draft entries with another geometry on an MHA pool, TP 2 -> TP 4.
    let p = with(
        &gqa("prefill", 2, 8, 0),
        json!({"kv_item_lens": [65536, 65536, 65536, 65536, 16384, 16384], "num_draft_entries": 2}),
    );
    let d = with(
        &gqa("decode", 4, 8, 0),
        json!({"kv_item_lens": [32768, 32768, 32768, 32768, 8192, 8192], "num_draft_entries": 2}),
    );
    for r in both(&p, &d) {
        assert_eq!(
            r.codes(),
            [C::HeadSliceItemLens, C::HeadSliceItemLens],
            "{:#?}",
            r.problems
        );
        assert_eq!(
            r.problems[0].message,
            "head-sliced transfer assumes one item length for every KV entry, got {16384, 65536}"
        );
    }
}

#[test]
fn w001_mha_different_tp_is_a_warning() {
    for r in both(&gqa("prefill", 2, 8, 0), &gqa("decode", 4, 8, 3)) {
        assert!(r.is_compatible(), "{:?}", r.problems);
        assert_eq!(r.warnings[0].code, C::TpDiffersMha);
        assert_eq!(
            r.warnings[0].message,
            "Performance is NOT guaranteed when using different TP sizes for non-MLA models. "
        );
        assert_eq!(r.mapping.expect("mapping").path, TransferPath::HeadSlices);
    }
}

// ---- what SGLang lets through ----

#[test]
fn e020_roles() {
    let r = check(&mla("decode", 4, 1, 0), &mla("prefill", 4, 1, 0));
    assert!(only(&r, C::RoleMistake).message.contains("swapped"));
    let r = check(&mla("prefill", 4, 1, 0), &mla("prefill", 4, 1, 0));
    let pr = only(&r, C::RoleMistake);
    assert!(
        pr.message
            .contains("the decode descriptor has role=prefill"),
        "{}",
        pr.message
    );
}

#[test]
fn e021_zero_sizes() {
    let d = with(
        &mla("decode", 4, 1, 0),
        json!({"pp_size": 0, "page_size": 0}),
    );
    let r = check(&mla("prefill", 4, 1, 0), &d);
    assert!(r.codes().contains(&C::ZeroSize));
    assert!(
        r.problems[0].message.contains("page_size=0, pp_size=0"),
        "{}",
        r.problems[0].message
    );
}

#[test]
fn e022_ranks_out_of_range() {
    let d = with(
        &mla("decode", 4, 1, 0),
        json!({"attn_tp_rank": 5, "pp_rank": 1}),
    );
    let r = check(&mla("prefill", 4, 1, 0), &d);
    assert_eq!(r.codes(), [C::RankOutOfRange, C::RankOutOfRange]);
    assert!(
        r.problems[0]
            .message
            .contains("decode attn_tp_rank=5 is out of range for attn_tp_size=4")
    );
    assert!(
        r.problems[0]
            .remedy
            .contains("SGLang would silently use rank 1")
    );
}

#[test]
fn e023_dcp_not_nested_in_tp() {
    let r = check(
        &mla("prefill", 4, 1, 0),
        &with(&mla("decode", 4, 1, 0), json!({"dcp_size": 3})),
    );
    assert!(r.codes().contains(&C::DcpNotNested));
    let r = check(
        &mla("prefill", 4, 1, 0),
        &with(&mla("decode", 4, 4, 1), json!({"dcp_rank": 2})),
    );
    assert_eq!(
        only(&r, C::DcpNotNested).message,
        "decode dcp_rank=2 but attn_tp_rank=1 with dcp_size=4 implies dcp_rank=1"
    );
}

#[test]
fn e025_head_geometry_missing_or_different() {
    let d = with(
        &gqa("decode", 4, 8, 0),
        json!({"total_kv_heads": null, "head_dim": null, "kv_item_lens": [32768, 32768]}),
    );
    let r = check(&gqa("prefill", 4, 8, 0), &d);
    assert!(r.problems.iter().any(|p| p.code == C::HeadGeometry
        && p.message.contains("decode kv_pool=mha needs total_kv_heads and head_dim (missing or 0: total_kv_heads, head_dim)")));
    let r = check(&gqa("prefill", 4, 8, 0), &gqa("decode", 4, 4, 0));
    assert!(r.problems.iter().any(|p| {
        p.code == C::HeadGeometry
            && p.message
                .contains("prefill total_kv_heads=8 but decode total_kv_heads=4")
    }));
}

#[test]
fn e026_heads_that_do_not_split() {
    for (tp, fragment) in [
        (3, "8 heads do not divide evenly over 3 ranks"),
        (12, "12 ranks cannot replicate 8 heads"),
    ] {
        let d = with(&gqa("decode", 4, 8, 0), json!({"attn_tp_size": tp}));
        let r = check(&gqa("prefill", 4, 8, 0), &d);
        let pr = r
            .problems
            .iter()
            .find(|p| p.code == C::HeadsDoNotSplit)
            .expect("E026");
        assert!(pr.message.contains(fragment), "{}", pr.message);
    }
}

#[test]
fn gqa_replication_when_tp_exceeds_heads_is_accepted() {
    // 2 KV heads, prefill TP 2 -> decode TP 8: each head replicated on 4 decode ranks.
    for r in both(&gqa("prefill", 2, 2, 0), &gqa("decode", 8, 2, 5)) {
        assert!(r.is_compatible(), "{:?}", r.problems);
        let m = r.mapping.expect("mapping");
        assert_eq!(
            (m.target_tp_ranks.as_slice(), m.required_dst_info_num),
            (&[1][..], 4)
        );
    }
}

#[test]
fn e027_item_lens_malformed() {
    for (v, fragment) in [
        (json!({"kv_item_lens": []}), "kv_item_lens is empty"),
        (
            json!({"kv_item_lens": [1000, 73728]}),
            "entry 0 item_len=1000 is not a multiple of page_size=64",
        ),
        (
            json!({"num_draft_entries": 3}),
            "num_draft_entries=3 exceeds the 2 entries",
        ),
        (
            json!({"kv_item_lens": [0, 73728]}),
            "entry 0 has item_len 0",
        ),
    ] {
        let r = check(&mla("prefill", 4, 1, 0), &with(&mla("decode", 4, 1, 0), v));
        let pr = r
            .problems
            .iter()
            .find(|p| p.code == C::ItemLensMalformed)
            .expect("E027");
        assert!(pr.message.contains(fragment), "{}", pr.message);
    }
}

#[test]
fn e028_item_lens_vs_head_geometry() {
    // bf16, 8 heads on TP 4 = 2 heads x 128 x 2 B x 64 = 32768, not 65536.
    let d = with(
        &gqa("decode", 4, 8, 0),
        json!({"kv_item_lens": [65536, 65536, 65536, 65536]}),
    );
    let r = check(&gqa("prefill", 4, 8, 0), &d);
    let pr = r
        .problems
        .iter()
        .find(|p| p.code == C::ItemLensVsHeads)
        .expect("E028");
    assert!(
        pr.message
            .contains("implies 4 bytes per element, but kv_cache_dtype=bfloat16 has 2"),
        "{}",
        pr.message
    );
    // Odd number of MHA entries.
    let d = with(
        &gqa("decode", 4, 8, 0),
        json!({"kv_item_lens": [32768, 32768, 32768]}),
    );
    let r = check(&gqa("prefill", 4, 8, 0), &d);
    assert!(r.codes().contains(&C::ItemLensVsHeads));
    // A "mla" pool whose layers differ.
    let d = with(
        &mla("decode", 4, 1, 0),
        json!({"kv_item_lens": [73728, 16384]}),
    );
    let r = check(&mla("prefill", 4, 1, 0), &d);
    assert!(
        r.problems
            .iter()
            .any(|p| p.code == C::ItemLensVsHeads && p.remedy.contains("hybrid_mla"))
    );
}

#[test]
fn e029_pool_kind_mismatch() {
    let d = with(&mla("decode", 4, 1, 0), json!({"kv_pool": "hybrid_mla"}));
    let r = check(&mla("prefill", 4, 1, 0), &d);
    assert_eq!(
        only(&r, C::PoolKindMismatch).message,
        "prefill kv_pool=mla but decode kv_pool=hybrid_mla: the servers do not hold the same kind of KV cache"
    );
}

#[test]
fn e030_e031_page_path_entries() {
    let d = with(
        &mla("decode", 4, 1, 0),
        json!({"kv_item_lens": [73728, 73728, 73728]}),
    );
    let r = check(&mla("prefill", 4, 1, 0), &d);
    assert_eq!(
        only(&r, C::EntryCount).message,
        "prefill registers 2 KV entries (draft=0) but decode registers 3 (draft=0); entries are paired by position"
    );
    let d = with(
        &mla("decode", 4, 1, 0),
        json!({"kv_item_lens": [73728, 36864]}),
    );
    let r = check(&mla("prefill", 4, 1, 0), &d);
    assert!(r.codes().contains(&C::EntryGeometry));
    assert!(r.problems.iter().any(|p| p.message.contains(
        "KV entry geometry differs at entry 1: prefill bytes per page=73728, decode bytes per page=36864")));
}

#[test]
fn e032_protocol_major_from_code() {
    let mut p = mla("prefill", 4, 1, 0);
    p.protocol_version = ProtocolVersion { major: 2, minor: 0 };
    let r = check(&p, &mla("decode", 4, 1, 0));
    assert!(
        only(&r, C::ProtocolVersion)
            .message
            .contains("prefill descriptor uses protocol_version 2.0")
    );
}

// ---- all problems at once ----

#[test]
fn three_problems_are_all_reported_in_check_order() {
    let p = mla("prefill", 4, 1, 0);
    let d = with(
        &mla("decode", 4, 1, 0),
        json!({"page_size": 16, "kv_cache_dtype": "fp8_e4m3",
        "kv_item_lens": [18432, 18432], "pp_size": 2}),
    );
    let r = sglang(&p, &d);
    assert_eq!(
        r.codes(),
        [C::PageSizeMismatch, C::DtypeMismatch, C::PpMismatch],
        "{:#?}",
        r.problems
    );
    match r.into_result() {
        Err(e @ HandshakeError::Incompatible { .. }) => {
            let text = e.to_string();
            assert!(text.contains("incompatible (3 problems)"));
            assert!(
                text.contains("KVB-E001") && text.contains("KVB-E002") && text.contains("KVB-E012")
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn every_problem_has_values_and_a_remedy() {
    let p = mla("prefill", 4, 1, 0);
    let d = with(
        &gqa("decode", 6, 8, 0),
        json!({"page_size": 16, "dcp_size": 4, "attn_cp_size": 2, "attn_tp_rank": 7}),
    );
    let r = sglang(&p, &d);
    assert!(r.problems.len() >= 6, "{:#?}", r.problems);
    for pr in &r.problems {
        assert!(!pr.remedy.is_empty(), "{pr:?}");
        assert!(!pr.values.is_empty(), "{pr:?}");
        assert_eq!(pr.severity, Severity::Error);
    }
    assert_eq!(p.kv_pool, PoolKind::Mla);
}
