//! GQA/MHA head mapping: SGLang's head slices per peer (SGLang 0.5.23's values; docs/planning.md, "MHA/GQA head slicing"), and
//! kvbridge's exact plan where every decode rank receives each of its KV heads exactly once,
//! replicated KV heads included.

mod common;

use common::gqa;
use kvbridge_handshake::{
    CheckOptions, Compat, HeadRange, PeerDescriptor, RankMapping, check_all_ranks, check_with,
};
use proptest::prelude::*;

fn mapping(p: &PeerDescriptor, d: &PeerDescriptor, compat: Compat) -> RankMapping {
    let r = check_with(p, d, &CheckOptions::new(compat));
    r.mapping.unwrap_or_else(|| panic!("{:#?}", r.problems))
}

fn slice(m: &RankMapping, tp: u32) -> Option<HeadRange> {
    m.peers
        .iter()
        .find(|p| p.tp_rank == tp)
        .and_then(|p| p.head_slice)
}

fn hr(src: u64, n: u64, dst: u64) -> HeadRange {
    HeadRange {
        src_head_start: src,
        num_heads: n,
        dst_head_start: dst,
    }
}

#[test]
fn sglang_head_slices_appear_in_the_mapping() {
    for compat in [Compat::Sglang, Compat::Kvbridge] {
        // (tp_src=2, tp_dst=4, src=1, dst=3, H=8) -> (2, 2, 0)
        let m = mapping(&gqa("prefill", 2, 8, 0), &gqa("decode", 4, 8, 3), compat);
        assert_eq!(slice(&m, 1), Some(hr(2, 2, 0)));
        // (4, 2, 3, 1, 8) -> (0, 2, 2)
        let m = mapping(&gqa("prefill", 4, 8, 0), &gqa("decode", 2, 8, 1), compat);
        assert_eq!(slice(&m, 3), Some(hr(0, 2, 2)));
        assert_eq!(slice(&m, 2), Some(hr(0, 2, 0)));
        // (2, 8, ., 5, H=2) -> (0, 1, 0)
        let m = mapping(&gqa("prefill", 2, 2, 0), &gqa("decode", 8, 2, 5), compat);
        assert_eq!(slice(&m, 1), Some(hr(0, 1, 0)));
        // (8, 2, 5, 1, 8) -> (0, 1, 1)
        let m = mapping(&gqa("prefill", 8, 8, 0), &gqa("decode", 2, 8, 1), compat);
        assert_eq!(slice(&m, 5), Some(hr(0, 1, 1)));
        // Equal TP: whole rows, no slice.
        let m = mapping(&gqa("prefill", 4, 8, 0), &gqa("decode", 4, 8, 1), compat);
        assert_eq!(slice(&m, 1), None);
    }
}

#[test]
fn replicated_prefill_heads_are_read_once_in_kvbridge_mode() {
    // 2 KV heads, prefill TP 8 (each head on 4 ranks) -> decode TP 2 (one head per rank).
    let p = gqa("prefill", 8, 2, 0);
    let d = gqa("decode", 2, 2, 1);
    let sg = mapping(&p, &d, Compat::Sglang);
    assert_eq!(sg.target_tp_ranks, [4, 5, 6, 7]);
    assert_eq!(
        sg.required_prefill_response_num, 4,
        "SGLang reads every replica"
    );
    assert!(sg.peers.iter().all(|p| !p.is_dummy));
    let kv = mapping(&p, &d, Compat::Kvbridge);
    assert_eq!(kv.target_tp_ranks, [4, 5, 6, 7]);
    let real: Vec<u32> = kv.senders().map(|p| p.tp_rank).collect();
    assert_eq!(real.len(), 1);
    assert_eq!(kv.required_prefill_response_num, 1);
    assert_eq!(slice(&kv, real[0]), Some(hr(0, 1, 0)));
    assert!(
        kv.peers
            .iter()
            .filter(|p| p.is_dummy)
            .all(|p| p.head_slice.is_none())
    );
}

/// Global KV heads held by rank `t` of a TP group of size `tp` (independent of the library).
fn holds(h: u32, tp: u32, t: u32) -> Vec<u32> {
    if tp <= h {
        let per = h / tp;
        (t * per..(t + 1) * per).collect()
    } else {
        vec![t / (tp / h)]
    }
}

fn splits(h: u32, tp: u32) -> bool {
    if tp <= h { h % tp == 0 } else { tp % h == 0 }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Every decode rank receives each of its heads from a prefill rank that holds it, at the
    /// right place: exactly once in kvbridge mode, at least once in SGLang mode; every prefill
    /// rank gets the room's metadata; registration counts agree across the deployment.
    #[test]
    fn head_plans_deliver_every_head(
        h in prop::sample::select(vec![1u32, 2, 4, 8]),
        tp_p in prop::sample::select(vec![1u32, 2, 4, 8, 16]),
        tp_d in prop::sample::select(vec![1u32, 2, 4, 8, 16]),
    ) {
        prop_assume!(splits(h, tp_p) && splits(h, tp_d));
        prop_assume!(tp_p.max(tp_d) % tp_p.min(tp_d) == 0);
        for compat in [Compat::Kvbridge, Compat::Sglang] {
            let reports = check_all_ranks(&gqa("prefill", tp_p, h, 0), &gqa("decode", tp_d, h, 0), &CheckOptions::new(compat));
            let mut registrations = vec![0u32; tp_p as usize];
            let mut claimed = Vec::new();
            for r in &reports {
                let m = r.report.mapping.clone().expect("compatible");
                let e = r.decode_tp_rank;
                let need = holds(h, tp_d, e);
                let mut got = vec![0u32; need.len()];
                for peer in m.senders() {
                    let have = holds(h, tp_p, peer.tp_rank);
                    let s = peer.head_slice.unwrap_or(HeadRange {
                        src_head_start: 0, num_heads: have.len() as u64, dst_head_start: 0,
                    });
                    for k in 0..s.num_heads as usize {
                        let src_head = have[s.src_head_start as usize + k];
                        let dst_idx = s.dst_head_start as usize + k;
                        prop_assert_eq!(src_head, need[dst_idx], "{:?} decode {} from {}", compat, e, peer.tp_rank);
                        got[dst_idx] += 1;
                    }
                }
                match compat {
                    Compat::Kvbridge => prop_assert!(got.iter().all(|&n| n == 1), "decode {}: {:?}", e, got),
                    _ => prop_assert!(got.iter().all(|&n| n >= 1), "decode {}: {:?}", e, got),
                }
                prop_assert_eq!(m.required_prefill_response_num as usize, m.senders().count());
                for p in &m.peers {
                    registrations[p.tp_rank as usize] += 1;
                    claimed.push((p.tp_rank, p.required_dst_info_num));
                }
            }
            prop_assert!(registrations.iter().all(|&n| n >= 1), "{:?}: {:?}", compat, registrations);
            for (tp, n) in claimed {
                prop_assert_eq!(n, registrations[tp as usize]);
            }
        }
    }
}
