//! Rank mapping: every row of a table of SGLang 0.5.23's results (docs/planning.md,
//! "Rank mapping"), SGLang's bootstrap order / dummy /
//! unique-rank rules, an independent re-statement checked on random inputs, and the owner-rule
//! mapping kvbridge uses for any prefill DCP a -> decode DCP b.

mod common;

use common::mla;
use kvbridge_handshake::{
    CheckOptions, Compat, HandshakeError, MappingInput, PeerDescriptor, PoolKind, ProblemCode,
    Role, TargetRanks, TransferPath, bootstrap_order, check_all_ranks, check_with,
    prefill_unique_rank, sglang_is_dummy, sglang_rank_mapping,
};
use proptest::prelude::*;

const POOLS: [PoolKind; 3] = [PoolKind::Mha, PoolKind::Mla, PoolKind::HybridMla];

fn input(tp_d: u32, e: u32, tp_p: u32, pool: PoolKind) -> MappingInput {
    MappingInput {
        decode_tp_size: tp_d,
        decode_engine_rank: e,
        decode_cp_size: 1,
        decode_pp_size: 1,
        decode_pp_rank: 0,
        decode_pool: pool,
        decode_kv_cache_sharding: false,
        prefill_tp_size: tp_p,
        prefill_cp_size: 1,
        prefill_pp_size: 1,
        prefill_kv_cache_sharding: false,
        prefill_dsa_layer_split: false,
        all_cp_ranks_transfer: false,
    }
}

fn expect(
    tp: Option<u32>,
    tps: &[u32],
    cps: &[u32],
    pps: &[u32],
    dst: u32,
    resp: u32,
) -> TargetRanks {
    TargetRanks {
        target_tp_rank: tp,
        target_tp_ranks: tps.to_vec(),
        target_cp_ranks: cps.to_vec(),
        target_pp_ranks: pps.to_vec(),
        required_dst_info_num: dst,
        required_prefill_response_num: resp,
    }
}

fn map(i: &MappingInput) -> TargetRanks {
    sglang_rank_mapping(i).expect("mapping")
}

fn precondition(i: &MappingInput) -> String {
    match sglang_rank_mapping(i) {
        Err(HandshakeError::MappingPrecondition { message, .. }) => message,
        other => panic!("expected a precondition failure, got {other:?}"),
    }
}

// ---- SGLang 0.5.23's results, row by row ----

#[test]
fn row_01_equal_tp_any_pool() {
    for pool in POOLS {
        assert_eq!(
            map(&input(4, 2, 4, pool)),
            expect(Some(2), &[2], &[0], &[0], 1, 1),
            "{pool:?}"
        );
    }
}

#[test]
fn row_02_decode_tp_larger_mha_or_mla() {
    for pool in [PoolKind::Mha, PoolKind::Mla] {
        assert_eq!(
            map(&input(8, 5, 2, pool)),
            expect(Some(1), &[1], &[0], &[0], 4, 1),
            "{pool:?}"
        );
    }
}

#[test]
fn row_03_prefill_tp_larger_mha_waits_for_every_slice() {
    assert_eq!(
        map(&input(2, 1, 8, PoolKind::Mha)),
        expect(Some(4), &[4, 5, 6, 7], &[0], &[0], 1, 4)
    );
}

#[test]
fn row_04_prefill_tp_larger_mla_waits_for_one() {
    assert_eq!(
        map(&input(2, 1, 8, PoolKind::Mla)),
        expect(Some(4), &[4, 5, 6, 7], &[0], &[0], 1, 1)
    );
}

#[test]
fn row_05_prefill_tp_larger_hybrid_counts_as_non_mla() {
    assert_eq!(
        map(&input(2, 1, 8, PoolKind::HybridMla)),
        expect(Some(4), &[4, 5, 6, 7], &[0], &[0], 1, 4)
    );
}

#[test]
fn row_06_mla_prefill_sharding_all_real() {
    let mut i = input(4, 3, 4, PoolKind::Mla);
    i.prefill_kv_cache_sharding = true;
    assert_eq!(map(&i), expect(None, &[0, 1, 2, 3], &[0], &[0], 4, 4));
}

#[test]
fn row_07_mla_prefill_sharding_needs_equal_tp() {
    let mut i = input(4, 3, 2, PoolKind::Mla);
    i.prefill_kv_cache_sharding = true;
    assert_eq!(
        precondition(&i),
        "MLA KV cache sharding requires equal prefill/decode attn TP sizes, got prefill=2 decode=4"
    );
}

#[test]
fn row_08_prefill_cp_without_all_cp() {
    let mut i = input(4, 1, 2, PoolKind::Mla);
    i.prefill_cp_size = 4;
    assert_eq!(map(&i), expect(Some(0), &[0], &[0], &[0], 2, 1));
}

#[test]
fn row_09_prefill_cp_with_all_cp() {
    let mut i = input(4, 1, 2, PoolKind::Mla);
    i.prefill_cp_size = 4;
    i.all_cp_ranks_transfer = true;
    assert_eq!(map(&i), expect(Some(0), &[0], &[0, 1, 2, 3], &[0], 2, 4));
}

#[test]
fn row_10_prefill_cp_with_dsa_layer_split() {
    let mut i = input(4, 1, 2, PoolKind::Mha);
    i.prefill_cp_size = 4;
    i.prefill_dsa_layer_split = true;
    assert_eq!(map(&i), expect(Some(0), &[0], &[0, 1, 2, 3], &[0], 2, 4));
}

#[test]
fn row_11_mha_prefill_tp_and_cp_larger_all_cp() {
    let mut i = input(2, 0, 4, PoolKind::Mha);
    i.prefill_cp_size = 2;
    i.all_cp_ranks_transfer = true;
    assert_eq!(map(&i), expect(Some(0), &[0, 1], &[0, 1], &[0], 1, 4));
}

#[test]
fn row_12_decode_pp1_pulls_every_prefill_stage() {
    for pool in POOLS {
        let mut i = input(4, 1, 4, pool);
        i.prefill_pp_size = 4;
        assert_eq!(
            map(&i),
            expect(Some(1), &[1], &[0], &[0, 1, 2, 3], 1, 4),
            "{pool:?}"
        );
    }
}

#[test]
fn row_13_equal_pp_uses_own_stage() {
    for pool in POOLS {
        let mut i = input(4, 1, 4, pool);
        i.prefill_pp_size = 2;
        i.decode_pp_size = 2;
        i.decode_pp_rank = 1;
        assert_eq!(map(&i), expect(Some(1), &[1], &[0], &[1], 1, 1), "{pool:?}");
    }
}

#[test]
fn row_14_decode_pp_neither_equal_nor_one() {
    for pool in POOLS {
        let mut i = input(4, 1, 4, pool);
        i.prefill_pp_size = 4;
        i.decode_pp_size = 2;
        assert_eq!(
            precondition(&i),
            "Decode pp size (2) should be equal to prefill pp size (4) or 1"
        );
    }
}

#[test]
fn row_15_mha_tp_and_pp_factors_multiply() {
    let mut i = input(2, 1, 8, PoolKind::Mha);
    i.prefill_pp_size = 2;
    assert_eq!(map(&i), expect(Some(4), &[4, 5, 6, 7], &[0], &[0, 1], 1, 8));
}

#[test]
fn row_16_decode_tp16_prefill_tp4_mla() {
    assert_eq!(
        map(&input(16, 13, 4, PoolKind::Mla)),
        expect(Some(3), &[3], &[0], &[0], 4, 1)
    );
}

/// SGLang has no divisibility check: decode TP 6 rank 5 against prefill TP 4 targets the
/// non-existent prefill rank 5. `sglang_rank_mapping` reproduces that value; `check` refuses.
#[test]
fn row_17_non_divisible_tp_targets_missing_rank_and_check_refuses() {
    assert_eq!(
        map(&input(6, 5, 4, PoolKind::Mha)),
        expect(Some(5), &[5], &[0], &[0], 1, 1)
    );
    let gqa = |role, tp, rank| {
        PeerDescriptor::mha(role, 64, 1, 12, 128)
            .element_bytes(2)
            .attn_tp(tp, rank)
            .build()
            .expect("complete")
    };
    let (p, d) = (gqa(Role::Prefill, 4, 0), gqa(Role::Decode, 6, 5));
    assert_eq!((p.kv_item_lens[0], d.kv_item_lens[0]), (49152, 32768));
    for compat in [Compat::Sglang, Compat::Kvbridge] {
        let r = check_with(&p, &d, &CheckOptions::new(compat));
        assert_eq!(
            r.codes(),
            [ProblemCode::TpNotMultiple],
            "{compat:?}: {:?}",
            r.problems
        );
        assert!(
            r.problems[0]
                .message
                .contains("prefill attn_tp_size=4 and decode attn_tp_size=6")
        );
        assert!(r.problems[0].message.contains("prefill rank 5"));
        assert!(r.mapping.is_none());
    }
}

#[test]
fn decode_cp_precondition_text() {
    let mut i = input(4, 1, 4, PoolKind::Mla);
    i.decode_cp_size = 2;
    assert_eq!(precondition(&i), "Decode cp size (2) should be equal to 1");
}

#[test]
fn zero_sizes_are_refused_not_divided_by() {
    let i = input(0, 0, 4, PoolKind::Mla);
    assert!(precondition(&i).contains("decode attn_tp_size must be >= 1 (got 0)"));
}

#[test]
fn engine_rank_is_reduced_modulo_tp_like_sglang() {
    assert_eq!(
        map(&input(4, 6, 4, PoolKind::Mla)),
        map(&input(4, 2, 4, PoolKind::Mla))
    );
}

// ---- bootstrap order, dummies, unique ranks ----

#[test]
fn bootstrap_order_is_cp_then_tp_then_pp_descending() {
    let t = expect(Some(4), &[4, 5], &[0, 1], &[0, 1, 2], 1, 12);
    assert_eq!(
        bootstrap_order(&t),
        [
            (4, 0, 2),
            (4, 0, 1),
            (4, 0, 0),
            (5, 0, 2),
            (5, 0, 1),
            (5, 0, 0),
            (4, 1, 2),
            (4, 1, 1),
            (4, 1, 0),
            (5, 1, 2),
            (5, 1, 1),
            (5, 1, 0),
        ]
    );
}

#[test]
fn dummy_rule() {
    assert!(sglang_is_dummy(PoolKind::Mla, Some(4), 5));
    assert!(!sglang_is_dummy(PoolKind::Mla, Some(4), 4));
    assert!(!sglang_is_dummy(PoolKind::Mla, None, 5));
    assert!(!sglang_is_dummy(PoolKind::Mha, Some(4), 5));
    assert!(!sglang_is_dummy(PoolKind::HybridMla, Some(4), 5));
}

#[test]
fn unique_rank_formula() {
    // attn_tp_rank·(pp_size·attn_cp_size) + pp_rank·attn_cp_size + attn_cp_rank
    assert_eq!(prefill_unique_rank(3, 1, 2, 2, 4), 3 * 8 + 2 * 2 + 1);
    assert_eq!(prefill_unique_rank(0, 0, 0, 1, 1), 0);
    // All (tp, cp, pp) of a 4x2x3 deployment get distinct ids 0..24.
    let mut ids: Vec<u32> = (0..4)
        .flat_map(|tp| {
            (0..2).flat_map(move |cp| (0..3).map(move |pp| prefill_unique_rank(tp, cp, pp, 2, 3)))
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..24).collect::<Vec<_>>());
}

// ---- descriptors → mapping ----

#[test]
fn mapping_from_descriptors_lists_peers_with_dummies_and_ids() {
    // Prefill TP 8 (MLA) -> decode TP 2 rank 1: prefill 4 sends, 5..7 are dummies.
    let r = check_with(
        &mla("prefill", 8, 1, 0),
        &mla("decode", 2, 1, 1),
        &CheckOptions::default(),
    );
    let m = r.mapping.expect("compatible");
    assert_eq!(m.target_tp_ranks, [4, 5, 6, 7]);
    let peers: Vec<(u32, bool, u32)> = m
        .peers
        .iter()
        .map(|p| (p.tp_rank, p.is_dummy, p.unique_rank))
        .collect();
    assert_eq!(
        peers,
        [(4, false, 4), (5, true, 5), (6, true, 6), (7, true, 7)]
    );
    assert_eq!(m.senders().count(), 1);
    assert_eq!(m.path, TransferPath::Pages);
}

#[test]
fn sglang_dcp_example_prefill_tp4_to_decode_tp4_dcp4() {
    for r in check_all_ranks(
        &mla("prefill", 4, 1, 0),
        &mla("decode", 4, 4, 0),
        &CheckOptions::default(),
    ) {
        let m = r.report.mapping.expect("compatible");
        assert_eq!(m.target_tp_ranks, [r.decode_tp_rank]);
        assert_eq!(m.decode_dcp_rank, r.decode_tp_rank);
        assert_eq!(
            (m.required_dst_info_num, m.required_prefill_response_num),
            (1, 1)
        );
        assert_eq!(m.path, TransferPath::DcpTokenPlan);
        assert_eq!(m.decode_virtual_page_size, 256);
    }
}

#[test]
fn sglang_dcp_example_prefill_tp1_to_decode_tp4_dcp4() {
    for r in check_all_ranks(
        &mla("prefill", 1, 1, 0),
        &mla("decode", 4, 4, 0),
        &CheckOptions::new(Compat::Sglang),
    ) {
        let m = r.report.mapping.expect("compatible");
        assert_eq!(m.target_tp_ranks, [0]);
        assert_eq!(m.required_dst_info_num, 4);
        assert_eq!(m.required_prefill_response_num, 1);
    }
}

// ---- kvbridge owner-rule mapping (docs/planning.md, "The general case") ----

fn owner_rule(
    prefill_tp: u32,
    a: u32,
    decode_tp: u32,
    b: u32,
) -> Vec<(Vec<u32>, Vec<u32>, u32, u32)> {
    check_all_ranks(
        &mla("prefill", prefill_tp, a, 0),
        &mla("decode", decode_tp, b, 0),
        &CheckOptions::default(),
    )
    .into_iter()
    .map(|r| {
        let m = r
            .report
            .mapping
            .unwrap_or_else(|| panic!("{:?}", r.report.problems));
        let real: Vec<u32> = m.senders().map(|p| p.tp_rank).collect();
        let dummy: Vec<u32> = m
            .peers
            .iter()
            .filter(|p| p.is_dummy)
            .map(|p| p.tp_rank)
            .collect();
        (
            real,
            dummy,
            m.required_dst_info_num,
            m.required_prefill_response_num,
        )
    })
    .collect()
}

#[test]
fn owner_rule_dcp2_to_dcp4() {
    // Decode DCP ranks 0, 2 need even positions (prefill DCP rank 0), 1, 3 odd ones.
    assert_eq!(
        owner_rule(2, 2, 4, 4),
        [
            (vec![0], vec![], 2, 1),
            (vec![1], vec![], 2, 1),
            (vec![0], vec![], 2, 1),
            (vec![1], vec![], 2, 1),
        ]
    );
}

#[test]
fn owner_rule_dcp4_to_dcp2() {
    assert_eq!(
        owner_rule(4, 4, 2, 2),
        [(vec![0, 2], vec![], 1, 2), (vec![1, 3], vec![], 1, 2)]
    );
}

#[test]
fn owner_rule_dcp4_to_dcp1() {
    assert_eq!(owner_rule(4, 4, 1, 1), [(vec![0, 1, 2, 3], vec![], 1, 4)]);
}

#[test]
fn owner_rule_keeps_dummies_for_uncovered_prefill_ranks() {
    // Prefill TP 8 DCP 2 -> decode TP 2 DCP 1: decode 0 reads prefill 0, 1; 2, 3 are its dummies.
    assert_eq!(
        owner_rule(8, 2, 2, 1),
        [
            (vec![0, 1], vec![2, 3], 1, 2),
            (vec![4, 5], vec![6, 7], 1, 2)
        ]
    );
}

#[test]
fn owner_rule_fixes_sglang_rank_mismatch_for_equal_dcp_with_different_tp() {
    // SGLang maps decode rank 1 (DCP rank 1) to prefill rank 0 (DCP rank 0): refused there.
    let p = mla("prefill", 2, 2, 0);
    let d = mla("decode", 4, 2, 1);
    let sg = check_with(&p, &d, &CheckOptions::new(Compat::Sglang));
    assert_eq!(sg.codes(), [ProblemCode::DcpRankMismatch]);
    assert_eq!(
        sg.problems[0].message,
        "PD peers must connect matching DCP ranks, got prefill=0, decode=1"
    );
    let kv = check_with(&p, &d, &CheckOptions::default());
    let m = kv.mapping.expect("kvbridge maps by the owner rule");
    assert_eq!(m.target_tp_ranks, [1]);
    assert_eq!(m.peers[0].dcp_rank, 1);
    assert_eq!(m.path, TransferPath::Rows { head_slices: false });
}

/// Where SGLang defines the result (prefill DCP 1 -> any, equal DCP with equal TP), kvbridge's
/// mapping is SGLang's unchanged.
#[test]
fn kvbridge_mapping_equals_sglang_where_sglang_defines_it() {
    for (tp_p, a, tp_d, b) in [
        (4, 1, 4, 4),
        (1, 1, 4, 4),
        (8, 1, 4, 4),
        (2, 1, 8, 4),
        (4, 2, 4, 2),
        (8, 8, 8, 8),
    ] {
        let p = mla("prefill", tp_p, a, 0);
        let d = mla("decode", tp_d, b, 0);
        let kv = check_all_ranks(&p, &d, &CheckOptions::default());
        let sg = check_all_ranks(&p, &d, &CheckOptions::new(Compat::Sglang));
        for (k, s) in kv.iter().zip(&sg) {
            assert_eq!(
                k.report.mapping, s.report.mapping,
                "{tp_p}/{a} -> {tp_d}/{b}"
            );
            assert!(k.report.mapping.is_some());
        }
    }
}

/// An independent re-statement of the rules in docs/planning.md, "Rank mapping", written case
/// by case.
fn restated(i: &MappingInput) -> Result<TargetRanks, String> {
    let (td, tp) = (i.decode_tp_size, i.prefill_tp_size);
    let e = i.decode_engine_rank % td;
    let is_mla = matches!(i.decode_pool, PoolKind::Mla);
    let sharded_mla = is_mla && i.prefill_kv_cache_sharding && i.prefill_cp_size == 1;
    if sharded_mla && td != tp {
        return Err(format!(
            "MLA KV cache sharding requires equal prefill/decode attn TP sizes, got prefill={tp} decode={td}"
        ));
    }
    let tp_part: (Option<u32>, Vec<u32>, u32, u32) = match (sharded_mla, td.cmp(&tp)) {
        (true, _) => (None, (0..tp).collect(), td, tp),
        (false, std::cmp::Ordering::Equal) => (Some(e), vec![e], 1, 1),
        (false, std::cmp::Ordering::Greater) => {
            let r = e / (td / tp);
            (Some(r), vec![r], td / tp, 1)
        }
        (false, std::cmp::Ordering::Less) => {
            let k = tp / td;
            (
                Some(e * k),
                (e * k..e * k + k).collect(),
                1,
                if is_mla { 1 } else { k },
            )
        }
    };
    if i.decode_cp_size != 1 {
        return Err(format!(
            "Decode cp size ({}) should be equal to 1",
            i.decode_cp_size
        ));
    }
    let all_cp = i.all_cp_ranks_transfer
        || matches!(i.decode_pool, PoolKind::HybridMla)
        || i.decode_kv_cache_sharding;
    let pull_all_cp = i.prefill_cp_size > 1
        && (all_cp || i.prefill_dsa_layer_split || i.prefill_kv_cache_sharding);
    let cps: Vec<u32> = if pull_all_cp {
        (0..i.prefill_cp_size).collect()
    } else {
        vec![0]
    };
    let pps: Vec<u32> = if i.decode_pp_size == i.prefill_pp_size {
        vec![i.decode_pp_rank]
    } else if i.decode_pp_size == 1 {
        (0..i.prefill_pp_size).collect()
    } else {
        return Err(format!(
            "Decode pp size ({}) should be equal to prefill pp size ({}) or 1",
            i.decode_pp_size, i.prefill_pp_size
        ));
    };
    let responses = tp_part.3 * cps.len() as u32 * pps.len() as u32;
    Ok(TargetRanks {
        target_tp_rank: tp_part.0,
        target_tp_ranks: tp_part.1,
        target_cp_ranks: cps,
        target_pp_ranks: pps,
        required_dst_info_num: tp_part.2,
        required_prefill_response_num: responses,
    })
}

fn arb_input() -> impl Strategy<Value = MappingInput> {
    let pow2 = prop::sample::select(vec![1u32, 2, 4, 8, 16]);
    (
        (
            pow2.clone(),
            0u32..32,
            1u32..=2,
            prop::sample::select(vec![1u32, 2, 4]),
            0u32..4,
        ),
        (
            pow2,
            prop::sample::select(vec![1u32, 2, 4]),
            prop::sample::select(vec![1u32, 2, 4]),
        ),
        (
            0usize..3,
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        ),
    )
        .prop_map(
            |((td, e, dcp, dpp, dpr), (tp, cp, ppp), (pool, dsh, psh, dsa, allcp))| MappingInput {
                decode_tp_size: td,
                decode_engine_rank: e,
                decode_cp_size: dcp,
                decode_pp_size: dpp,
                decode_pp_rank: dpr % dpp,
                decode_pool: POOLS[pool],
                decode_kv_cache_sharding: dsh,
                prefill_tp_size: tp,
                prefill_cp_size: cp,
                prefill_pp_size: ppp,
                prefill_kv_cache_sharding: psh,
                prefill_dsa_layer_split: dsa,
                all_cp_ranks_transfer: allcp,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn sglang_mapping_matches_independent_restatement(i in arb_input()) {
        let ours = sglang_rank_mapping(&i).map_err(|e| match e {
            HandshakeError::MappingPrecondition { message, .. } => message,
            other => other.to_string(),
        });
        prop_assert_eq!(ours, restated(&i));
    }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Owner rule: every decode rank reads each position it owns from exactly one real sender
    /// that holds it, no sender is useless, every prefill rank gets the room's metadata, and the
    /// per-peer registration counts agree with the whole deployment.
    #[test]
    fn owner_rule_mapping_covers_every_owned_position_once(
        a in prop::sample::select(vec![1u32, 2, 3, 4, 8]),
        b in prop::sample::select(vec![1u32, 2, 3, 4, 8]),
        pm in prop::sample::select(vec![1u32, 2, 4]),
        dm in prop::sample::select(vec![1u32, 2, 4]),
    ) {
        let (tp_p, tp_d) = (a * pm, b * dm);
        prop_assume!(tp_p.max(tp_d) % tp_p.min(tp_d) == 0);
        let reports = check_all_ranks(&mla("prefill", tp_p, a, 0), &mla("decode", tp_d, b, 0), &CheckOptions::default());
        let lcm = a * b / gcd(a, b);
        let mut registrations = vec![0u32; tp_p as usize];
        let mut claimed = Vec::new();
        for r in &reports {
            let m = r.report.mapping.clone().expect("supported topology");
            let b_r = r.decode_tp_rank % b;
            for pos in (0..lcm).filter(|pos| pos % b == b_r) {
                let holders = m.senders().filter(|p| p.tp_rank % a == pos % a).count();
                prop_assert_eq!(holders, 1, "decode {} pos {}", r.decode_tp_rank, pos);
            }
            for p in m.senders() {
                prop_assert!((0..lcm).any(|pos| pos % b == b_r && pos % a == p.dcp_rank));
                prop_assert_eq!(p.dcp_rank, p.tp_rank % a);
            }
            prop_assert_eq!(m.required_prefill_response_num as usize, m.senders().count());
            for p in &m.peers {
                prop_assert!(p.tp_rank < tp_p);
                registrations[p.tp_rank as usize] += 1;
                claimed.push((p.tp_rank, p.required_dst_info_num));
            }
        }
        prop_assert!(registrations.iter().all(|&n| n >= 1), "every prefill rank learns the room: {:?}", registrations);
        for (tp, n) in claimed {
            prop_assert_eq!(n, registrations[tp as usize]);
        }
    }
}
