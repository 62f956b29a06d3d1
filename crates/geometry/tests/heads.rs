//! Head slicing for any pair of attention TP sizes, including replicated KV heads.

use kvbridge_geometry::{
    ByteRange, HeadSharding, HeadSlice, PoolGeometry, compute_head_slice_params, identity_pairs,
};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    ProptestConfig::with_cases(if cfg!(miri) { 4 } else { 256 })
}

/// (H, tp_src, tp_dst) with each TP size dividing H or a multiple of it.
fn split() -> impl Strategy<Value = (u64, u64, u64)> {
    let sizes = [1u64, 2, 4, 8, 16];
    (0usize..4, 0usize..5, 0usize..5)
        .prop_map(move |(h, s, d)| ([1u64, 2, 4, 8][h], sizes[s], sizes[d]))
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn every_decode_rank_gets_each_of_its_heads_exactly_once((h, tp_src, tp_dst) in split()) {
        let s = HeadSharding::new(h, tp_src, tp_dst).unwrap();
        for dst_rank in 0..tp_dst {
            let need = s.dst_heads(dst_rank).unwrap();
            let mut got = Vec::new();
            for src in s.sources_for(dst_rank).unwrap() {
                let held = s.src_heads(src.src_rank).unwrap();
                for k in 0..src.slice.num_heads {
                    let head = held.start + src.slice.src_head_start + k;
                    prop_assert!(held.contains(&head), "source rank holds the head it sends");
                    prop_assert_eq!(head, need.start + src.slice.dst_head_start + k, "lands at its own slot");
                    got.push(head);
                }
            }
            prop_assert_eq!(got, need.collect::<Vec<_>>());
        }
        // targets_of is the inverse mapping.
        let mut pairs = 0;
        for src_rank in 0..tp_src {
            let targets = s.targets_of(src_rank).unwrap();
            let brute: Vec<(u64, kvbridge_geometry::HeadSlice)> = (0..tp_dst)
                .flat_map(|d| {
                    s.sources_for(d)
                        .unwrap()
                        .into_iter()
                        .filter(|x| x.src_rank == src_rank)
                        .map(move |x| (d, x.slice))
                })
                .collect();
            prop_assert_eq!(&targets, &brute);
            pairs += targets.len();
        }
        let total: usize = (0..tp_dst).map(|d| s.sources_for(d).unwrap().len()).sum();
        prop_assert_eq!(pairs, total);
    }

    /// Where SGLang's parameters are right (the prefill does not replicate heads and one TP
    /// size divides the other), the exact plan picks the same slice from the same rank.
    #[test]
    fn agrees_with_sglang_without_prefill_replication((h, tp_src, tp_dst) in split()) {
        prop_assume!(tp_src <= h);
        let s = HeadSharding::new(h, tp_src, tp_dst).unwrap();
        for dst_rank in 0..tp_dst {
            for src in s.sources_for(dst_rank).unwrap() {
                let sglang = compute_head_slice_params(tp_src, tp_dst, src.src_rank, dst_rank, h).unwrap();
                prop_assert_eq!(sglang, src.slice);
            }
        }
    }

    /// Byte level on the page path: each decode rank's token rows end up holding exactly its
    /// heads, in order, from prefill ranks that hold them.
    #[test]
    fn page_ranges_fill_decode_rows_with_the_right_heads((h, tp_src, tp_dst) in split(), hb in 1u64..4) {
        let s = HeadSharding::new(h, tp_src, tp_dst).unwrap();
        let p = 2u64;
        let (hs, hd) = (s.heads_per_src_rank(), s.heads_per_dst_rank());
        let src = PoolGeometry::builder(p).num_pages(4).target_entries(&[p * hs * hb]).build().unwrap();
        let dst = PoolGeometry::builder(p).num_pages(4).target_entries(&[p * hd * hb]).build().unwrap();
        let value = |head: u64, row: u64, k: u64| (head * 31 + row * 7 + k) as u8 | 1;
        let prefill_mem = |rank: u64| {
            let heads = s.src_heads(rank).unwrap();
            let mut mem = vec![0u8; src.entry_bytes(0).unwrap() as usize];
            for row in 0..4 * p {
                for (i, head) in heads.clone().enumerate() {
                    for k in 0..hb {
                        mem[(row * hs * hb + i as u64 * hb + k) as usize] = value(head, row, k);
                    }
                }
            }
            mem
        };
        for dst_rank in 0..tp_dst {
            let mut mem = vec![0u8; dst.entry_bytes(0).unwrap() as usize];
            for source in s.sources_for(dst_rank).unwrap() {
                let from = prefill_mem(source.src_rank);
                let ranges = s.page_ranges(source, &src, &dst, &identity_pairs(1), &[1, 2], &[3, 0]).unwrap();
                for r in ranges.iter().flat_map(ByteRange::rows) {
                    let d = &mut mem[r.dst_offset as usize..(r.dst_offset + r.len) as usize];
                    prop_assert!(d.iter().all(|&x| x == 0));
                    d.copy_from_slice(&from[r.src_offset as usize..(r.src_offset + r.len) as usize]);
                }
            }
            let need = s.dst_heads(dst_rank).unwrap();
            for (src_page, dst_page) in [(1u64, 3u64), (2, 0)] {
                for t in 0..p {
                    let (srow, drow) = (src_page * p + t, dst_page * p + t);
                    for (i, head) in need.clone().enumerate() {
                        for k in 0..hb {
                            prop_assert_eq!(mem[(drow * hd * hb + i as u64 * hb + k) as usize], value(head, srow, k));
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn replicated_prefill_heads_are_sent_once() {
    // 2 KV heads, prefill TP 8 (each head on 4 ranks), decode TP 2 (one head each).
    let s = HeadSharding::new(2, 8, 2).unwrap();
    let to0 = s.sources_for(0).unwrap();
    assert_eq!(to0.len(), 1);
    assert_eq!(
        to0[0].slice,
        HeadSlice {
            src_head_start: 0,
            num_heads: 1,
            dst_head_start: 0
        }
    );
    assert!(s.src_heads(to0[0].src_rank).unwrap().contains(&0));
    // SGLang's parameters would have all four replicas of head 0 write the same slot.
    let writers = (0..8)
        .filter(|&r| s.src_heads(r).unwrap().contains(&0))
        .filter(|&r| {
            compute_head_slice_params(8, 2, r, 0, 2)
                .unwrap()
                .dst_head_start
                == 0
        })
        .count();
    assert_eq!(writers, 4);
}

#[test]
fn splits_that_do_not_divide_are_refused() {
    let e = HeadSharding::new(8, 3, 2).unwrap_err().to_string();
    assert!(
        e.contains("KV heads do not split: total_kv_heads=8, prefill attn TP=3, decode attn TP=2"),
        "{e}"
    );
    assert!(HeadSharding::new(0, 1, 1).is_err());
    assert!(HeadSharding::new(8, 2, 4).unwrap().sources_for(4).is_err());
}
