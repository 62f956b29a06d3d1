//! Any-to-any DCP resharding: exactness over all rank pairs, SGLang equivalence where SGLang
//! defines the result, byte-level delivery and descriptor counts.

mod common;

use std::collections::HashMap;

use common::world;

use kvbridge_geometry::{
    ByteRange, ByteRanges, DcpPlanInput, EntryPair, GeometryError, HeadSharding, PoolGeometry,
    ReshardInput, SendPages, identity_pairs, page_path_ranges, reshard_sources, reshard_targets,
};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    ProptestConfig::with_cases(if cfg!(miri) { 4 } else { 128 })
}

proptest! {
    #![proptest_config(config())]

    /// Every decode row of the send range is written exactly once, with the right token, and
    /// nothing is written to a row the decode rank does not own.
    #[test]
    fn union_over_rank_pairs_delivers_every_row_once(w in world()) {
        let mut written: Vec<HashMap<u64, u64>> = vec![HashMap::new(); w.b as usize];
        for (c0, n) in w.chunks() {
            for ar in 0..w.a {
                for br in 0..w.b {
                    let plan = w.input(ar, br, c0, n).plan().unwrap();
                    let positions: Vec<u64> = plan.positions().collect();
                    let pairs: Vec<(u64, u64)> = plan.pairs().collect();
                    prop_assert_eq!(positions.len(), pairs.len());
                    prop_assert_eq!(plan.len(), pairs.len() as u64);
                    for (&p, &(s, d)) in positions.iter().zip(&pairs) {
                        prop_assert!(p >= w.prefix + c0 && p < w.prefix + c0 + n);
                        prop_assert_eq!(p % w.a, ar);
                        prop_assert_eq!(p % w.b, br);
                        prop_assert_eq!(s, w.src_row(ar, p), "source row holds the token");
                        prop_assert_eq!(d, w.dst_row(p));
                        prop_assert!(written[br as usize].insert(d, p).is_none(), "row written twice");
                    }
                    if !reshard_sources(w.a, w.b, br).unwrap().contains(&ar) {
                        prop_assert!(plan.is_empty());
                    }
                }
            }
        }
        for br in 0..w.b {
            let expected: HashMap<u64, u64> = (w.prefix..w.prefix + w.total)
                .filter(|p| p % w.b == br)
                .map(|p| (w.dst_row(p), p))
                .collect();
            prop_assert_eq!(&written[br as usize], &expected);
        }
    }

    /// Byte level: copying every pair's byte ranges fills each decode rank's pool exactly with
    /// its tokens' bytes; no range leaves its entry.
    #[test]
    fn byte_ranges_deliver_every_decode_byte(w in world(), tok in 1u64..5) {
        let entries = [tok * w.p1, 2 * tok * w.p1];
        let dst_entries = [tok * w.p2, 2 * tok * w.p2];
        let src_pages = w.prefill_tables.iter().flatten().max().unwrap() + 1;
        let src = PoolGeometry::builder(w.p1).num_pages(src_pages).target_entries(&entries).build().unwrap();
        let dst = PoolGeometry::builder(w.p2).num_pages(w.dst.iter().max().unwrap() + 1).target_entries(&dst_entries).build().unwrap();
        let byte = |p: u64, e: usize, k: u64| (p * 7 + e as u64 * 3 + k) as u8 | 1;
        // Prefill memory: rank -> entry -> bytes.
        let prefill: Vec<Vec<Vec<u8>>> = (0..w.a).map(|ar| {
            (0..2).map(|e| {
                let width = (e as u64 + 1) * tok;
                let mut mem = vec![0u8; src.entry_bytes(e).unwrap() as usize];
                for p in (0..w.prefix + w.total).filter(|p| p % w.a == ar) {
                    let row = w.src_row(ar, p);
                    for k in 0..width {
                        mem[(row * width + k) as usize] = byte(p, e, k);
                    }
                }
                mem
            }).collect()
        }).collect();
        let mut decode = vec![vec![vec![0u8; dst.entry_bytes(0).unwrap() as usize], vec![0u8; dst.entry_bytes(1).unwrap() as usize]]; w.b as usize];
        for (c0, n) in w.chunks() {
            for ar in 0..w.a {
                for br in 0..w.b {
                    let plan = w.input(ar, br, c0, n).plan().unwrap();
                    let ranges = plan.byte_ranges(&src, &dst, &identity_pairs(2)).unwrap();
                    prop_assert!(ranges.row_count() <= 2 * plan.len());
                    prop_assert!(ranges.len() as u64 <= ranges.row_count());
                    for r in ranges.iter().flat_map(ByteRange::rows) {
                        let s = &prefill[ar as usize][r.src_entry][r.src_offset as usize..(r.src_offset + r.len) as usize];
                        let d = &mut decode[br as usize][r.dst_entry][r.dst_offset as usize..(r.dst_offset + r.len) as usize];
                        prop_assert!(d.iter().all(|&x| x == 0), "byte written twice");
                        d.copy_from_slice(s);
                    }
                }
            }
        }
        for br in 0..w.b {
            for (e, got) in decode[br as usize].iter().enumerate() {
                let width = (e as u64 + 1) * tok;
                let mut expected = vec![0u8; dst.entry_bytes(e).unwrap() as usize];
                for p in (w.prefix..w.prefix + w.total).filter(|p| p % w.b == br) {
                    let row = w.dst_row(p);
                    for k in 0..width {
                        expected[(row * width + k) as usize] = byte(p, e, k);
                    }
                }
                prop_assert_eq!(got, &expected);
            }
        }
    }

    /// Prefill DCP 1 with equal page sizes is SGLang's DCP token plan (target rows).
    #[test]
    fn one_to_n_equals_the_sglang_plan(p in 1u64..8, d in 1u64..7, prefix_v in 0u64..3, pages in 1usize..12, o in 0usize..12, r in 0u64..7, partial in 0u64..8) {
        let r = r % d;
        let o = o % pages;
        let src: Vec<u64> = (0..pages as u64).map(|i| (i * 5 + 3) % (pages as u64 * 5 + 1)).collect();
        let total = pages as u64 * p - partial % p;
        let dst: Vec<u64> = (0..total.div_ceil(p * d)).map(|i| 40 - i).collect();
        let n = total - o as u64 * p;
        let sglang = DcpPlanInput {
            src_pages: &src[o..],
            dst_pages: SendPages::after_prefix(&dst),
            page_size: p,
            dcp_size: d,
            dcp_rank: r,
            chunk_start: o as u64 * p,
            decode_prefix_len: prefix_v * p * d,
            num_kv_tokens: Some(n),
        }.plan().unwrap();
        let ours = ReshardInput {
            src_pages: &src[o..],
            dst_pages: SendPages::after_prefix(&dst),
            src_page_size: p,
            dst_page_size: p,
            src_dcp_size: 1,
            src_dcp_rank: 0,
            dst_dcp_size: d,
            dst_dcp_rank: r,
            decode_prefix_len: prefix_v * p * d,
            chunk_start: o as u64 * p,
            num_tokens: n,
        }.plan().unwrap();
        prop_assert_eq!(ours.arrays(), sglang.target_arrays());
        prop_assert_eq!(ours.runs().collect::<Vec<_>>(), sglang.target_runs().collect::<Vec<_>>());
        prop_assert_eq!(ours.runs_vec(), sglang.target_runs_vec());
    }

    /// Equal DCP sizes and page sizes: rank r → rank r moves rows the page path moves, to the
    /// same places, and no other pair moves anything.
    #[test]
    fn n_to_n_moves_what_the_page_path_moves(n_dcp in 1u64..5, p in 1u64..6, vpages in 1u64..6, o in 0u64..6, tail in 0u64..20) {
        let v = n_dcp * p;
        let o = o % vpages;
        let src: Vec<u64> = (0..vpages).map(|i| 3 * i + 1).collect();
        let dst: Vec<u64> = (0..vpages).map(|i| 50 - 2 * i).collect();
        let total = vpages * v - tail % v;
        let c0 = o * v;
        let n = total - c0;
        let pool = PoolGeometry::builder(p).num_pages(64).target_entries(&[p * 4]).build().unwrap();
        let page_path = page_path_ranges(&pool, &pool, &identity_pairs(1), &src[o as usize..], &dst[o as usize..]).unwrap();
        for r in 0..n_dcp {
            for br in 0..n_dcp {
                let plan = ReshardInput {
                    src_pages: &src[o as usize..],
                    dst_pages: SendPages::after_prefix(&dst),
                    src_page_size: p,
                    dst_page_size: p,
                    src_dcp_size: n_dcp,
                    src_dcp_rank: r,
                    dst_dcp_size: n_dcp,
                    dst_dcp_rank: br,
                    decode_prefix_len: 0,
                    chunk_start: c0,
                    num_tokens: n,
                }.plan().unwrap();
                if r != br {
                    prop_assert!(plan.is_empty());
                    continue;
                }
                let owned = (c0..total).filter(|q| q % n_dcp == r).count() as u64;
                prop_assert_eq!(plan.len(), owned);
                let ranges = plan.byte_ranges(&pool, &pool, &identity_pairs(1)).unwrap();
                // Every reshard byte range lies inside one page-path range at the same shift.
                for br in ranges.iter().flat_map(ByteRange::rows) {
                    prop_assert!(page_path.iter().any(|pp| br.src_offset >= pp.src_offset
                        && br.src_offset + br.len <= pp.src_offset + pp.len
                        && br.dst_offset - pp.dst_offset == br.src_offset - pp.src_offset
                        && br.dst_offset >= pp.dst_offset));
                }
            }
        }
    }
}

#[test]
fn rank_mapping_counts() {
    assert_eq!(reshard_sources(2, 4, 0).unwrap(), [0]);
    assert_eq!(reshard_sources(2, 4, 3).unwrap(), [1]);
    assert_eq!(reshard_sources(4, 2, 0).unwrap(), [0, 2]);
    assert_eq!(reshard_sources(4, 1, 0).unwrap(), [0, 1, 2, 3]);
    assert_eq!(reshard_sources(1, 8, 5).unwrap(), [0]);
    assert_eq!(reshard_sources(4, 6, 5).unwrap(), [1, 3]);
    assert_eq!(reshard_targets(2, 4, 1).unwrap(), [1, 3]);
    assert_eq!(reshard_targets(4, 1, 3).unwrap(), [0]);
    assert!(matches!(
        reshard_sources(2, 4, 4),
        Err(GeometryError::DcpRankOutOfRange { .. })
    ));
    assert!(matches!(
        reshard_targets(0, 4, 0),
        Err(GeometryError::ZeroDcpSize { .. })
    ));
}

#[test]
fn reshard_errors_name_the_problem() {
    let base = ReshardInput {
        src_pages: &[0, 1],
        dst_pages: SendPages::after_prefix(&[0]),
        src_page_size: 16,
        dst_page_size: 64,
        src_dcp_size: 2,
        dst_dcp_size: 4,
        num_tokens: 64,
        ..ReshardInput::default()
    };
    assert!(base.plan().is_ok());
    let e = ReshardInput {
        decode_prefix_len: 64,
        ..base
    }
    .plan()
    .unwrap_err()
    .to_string();
    assert!(e.contains("PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size (256), got 64"), "{e}");
    let e = ReshardInput {
        src_pages: &[0],
        ..base
    }
    .plan()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("prefill rank 0 needs at least 2 pages for this chunk, got 1"),
        "{e}"
    );
    let e = ReshardInput {
        num_tokens: 300,
        src_pages: &[0; 10],
        ..base
    }
    .plan()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("decode rank 0 needs at least 2 pages for this chunk, got 1"),
        "{e}"
    );
    let e = ReshardInput {
        dst_dcp_rank: 4,
        ..base
    }
    .plan()
    .unwrap_err();
    assert!(matches!(e, GeometryError::DcpRankOutOfRange { .. }));
    let e = ReshardInput {
        src_page_size: 0,
        ..base
    }
    .plan()
    .unwrap_err();
    assert!(matches!(e, GeometryError::ZeroPageSize { .. }));
}

#[test]
fn head_slices_over_resharded_rows() {
    // MHA, 8 KV heads of 64 bytes per token row; prefill TP 2 (4 heads) -> decode TP 4
    // (2 heads), prefill page 2 -> decode page 4, no DCP.
    let sharding = HeadSharding::new(8, 2, 4).unwrap();
    let src = PoolGeometry::builder(2)
        .num_pages(8)
        .target_entries(&[2 * 256, 2 * 256])
        .build()
        .unwrap();
    let dst = PoolGeometry::builder(4)
        .num_pages(8)
        .target_entries(&[4 * 128, 4 * 128])
        .build()
        .unwrap();
    let plan = ReshardInput {
        src_pages: &[3, 5],
        dst_pages: SendPages::after_prefix(&[6]),
        src_page_size: 2,
        dst_page_size: 4,
        src_dcp_size: 1,
        dst_dcp_size: 1,
        num_tokens: 4,
        ..ReshardInput::default()
    }
    .plan()
    .unwrap();
    let source = sharding.sources_for(3).unwrap()[0];
    assert_eq!(source.src_rank, 1);
    let ranges: ByteRanges = plan
        .head_byte_ranges(&src, &dst, &[EntryPair::new(0, 0)], &sharding, source)
        .unwrap();
    let got: Vec<(u64, u64, u64)> = ranges
        .iter()
        .flat_map(ByteRange::rows)
        .map(|r| (r.src_offset, r.dst_offset, r.len))
        .collect();
    // Rows 6,7,10,11 (heads 2..4 of the prefill rank, bytes 128..256) -> rows 24..28.
    assert_eq!(
        got,
        [
            (6 * 256 + 128, 24 * 128, 128),
            (7 * 256 + 128, 25 * 128, 128),
            (10 * 256 + 128, 26 * 128, 128),
            (11 * 256 + 128, 27 * 128, 128)
        ]
    );
}
