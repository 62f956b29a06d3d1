//! Worked examples of the planner with SGLang 0.5.23's results, one test each (the rules:
//! docs/planning.md).

use kvbridge_geometry::{
    ByteRange, DcpPlanInput, EntryPair, GeometryError, HeadSharding, HeadSlice, PoolFormat,
    PoolGeometry, Run, SendPages, align_prefix_down, align_prefix_up, compute_head_slice_params,
    dcp_pack_buffer_bytes, dcp_token_item_lens, group_concurrent_contiguous, head_slice_ranges,
    identity_pairs, page_path_ranges, pair_entries_by_layer_ids, pair_entries_flat_pp,
    pair_entries_mha_pp, prepare_dcp_token_item_lens,
};

fn pool(page_size: u64, num_pages: u64, target: &[u64], draft: &[u64]) -> PoolGeometry {
    PoolGeometry::builder(page_size)
        .num_pages(num_pages)
        .target_entries(target)
        .draft_entries(draft)
        .build()
        .unwrap()
}

/// `(src_addr, dst_addr, len)` of every row with per-entry base addresses, as Mooncake would
/// post them (one descriptor per row).
fn addressed(ranges: &[ByteRange], src_ptrs: &[u64], dst_ptrs: &[u64]) -> Vec<(u64, u64, u64)> {
    ranges
        .iter()
        .flat_map(ByteRange::rows)
        .map(|r| {
            (
                src_ptrs[r.src_entry] + r.src_offset,
                dst_ptrs[r.dst_entry] + r.dst_offset,
                r.len,
            )
        })
        .collect()
}

#[test]
fn group_concurrent_contiguous_example_and_edges() {
    let runs = group_concurrent_contiguous(&[1, 2, 3, 7, 8], &[10, 11, 13, 14, 15]).unwrap();
    assert_eq!(
        runs,
        [Run::new(1, 10, 2), Run::new(3, 13, 1), Run::new(7, 14, 2)]
    );
    assert!(
        group_concurrent_contiguous(&[], &[1, 2])
            .unwrap()
            .is_empty()
    );
    assert!(group_concurrent_contiguous(&[1], &[]).unwrap().is_empty());
    let err = group_concurrent_contiguous(&[1, 2], &[1])
        .unwrap_err()
        .to_string();
    assert!(err.contains(
        "group_concurrent_contiguous requires equal-length src/dst index arrays, got 2 and 1"
    ));
    // Duplicates and descending steps cut.
    let runs = group_concurrent_contiguous(&[5, 5, 4], &[1, 2, 3]).unwrap();
    assert_eq!(runs.len(), 3);
}

#[test]
fn page_path_mla_example() {
    let src = pool(16, 16, &[18_432, 18_432], &[]);
    let dst = pool(16, 32, &[18_432, 18_432], &[]);
    let ranges = page_path_ranges(
        &src,
        &dst,
        &identity_pairs(2),
        &[4, 5, 6, 9],
        &[10, 11, 20, 21],
    )
    .unwrap();
    let got = addressed(
        ranges.as_slice(),
        &[0x100_0000, 0x200_0000],
        &[0xA00_0000, 0xB00_0000],
    );
    assert_eq!(
        got,
        [
            (0x101_2000, 0xA02_D000, 36_864),
            (0x101_B000, 0xA05_A000, 18_432),
            (0x102_8800, 0xA05_E800, 18_432),
            (0x201_2000, 0xB02_D000, 36_864),
            (0x201_B000, 0xB05_A000, 18_432),
            (0x202_8800, 0xB05_E800, 18_432),
        ]
    );
    // Pages 6 and 9 (one page each) land on consecutive pages 20 and 21: one progression.
    assert_eq!((ranges.len(), ranges.row_count()), (4, 6));
    assert_eq!(
        ranges.as_slice()[1],
        ByteRange::new(0, 6 * 18_432, 0, 20 * 18_432, 18_432).with_rows(2, 3 * 18_432, 18_432)
    );
}

#[test]
fn page_path_mha_example() {
    let src = PoolGeometry::builder(16)
        .num_pages(4)
        .target_entries(&[32_768; 4])
        .format(PoolFormat::Mha {
            total_kv_heads: 8,
            head_dim: 128,
        })
        .build()
        .unwrap();
    let dst = pool(16, 16, &[32_768; 4], &[]);
    let ranges = page_path_ranges(&src, &dst, &identity_pairs(4), &[1, 2], &[7, 8]).unwrap();
    let got = addressed(
        ranges.as_slice(),
        &[0x100_000, 0x200_000, 0x300_000, 0x400_000],
        &[0xA00_000, 0xB00_000, 0xC00_000, 0xD00_000],
    );
    assert_eq!(got[0], (0x108_000, 0xA38_000, 65_536));
    assert_eq!(got[1], (0x208_000, 0xB38_000, 65_536));
    assert_eq!(got.len(), 4);
}

#[test]
fn page_path_truncates_source_and_refuses_mismatched_entries() {
    let src = pool(16, 16, &[1024], &[]);
    let dst = pool(16, 16, &[1024], &[]);
    let r = page_path_ranges(&src, &dst, &identity_pairs(1), &[1, 2, 3], &[4, 5]).unwrap();
    assert_eq!(r.as_slice(), [ByteRange::new(0, 1024, 0, 4096, 2048)]);
    let other = pool(16, 16, &[2048], &[]);
    let err = page_path_ranges(&src, &other, &identity_pairs(1), &[1], &[4]).unwrap_err();
    assert!(matches!(err, GeometryError::WidthMismatch { .. }), "{err}");
    let err = page_path_ranges(&src, &dst, &identity_pairs(1), &[1], &[16]).unwrap_err();
    assert!(
        err.to_string()
            .contains("decode page id 16 is outside the pool of 16 pages")
    );
}

#[test]
fn pp_entry_pairing_examples() {
    let pairs = |v: Vec<EntryPair>| v.into_iter().map(|p| (p.src, p.dst)).collect::<Vec<_>>();
    // MLA stage [s2,s3] vs decode [d0..d3], start 2.
    assert_eq!(
        pairs(pair_entries_flat_pp(2, 4, 2, 0).unwrap()),
        [(0, 2), (1, 3)]
    );
    // With one draft entry: [s2,s3,sD] vs [d0..d3,dD].
    assert_eq!(
        pairs(pair_entries_flat_pp(3, 5, 2, 1).unwrap()),
        [(0, 2), (1, 3), (2, 4)]
    );
    // MHA stage [K2,K3,V2,V3] vs [k0..k3,v0..v3], start 2.
    assert_eq!(
        pairs(pair_entries_mha_pp(4, 8, 2).unwrap()),
        [(0, 2), (1, 3), (2, 6), (3, 7)]
    );
    // MHA [K0,K1,V0,V1] vs [k0,k1,v0,v1,dk,dv].
    assert_eq!(
        pairs(pair_entries_mha_pp(4, 6, 0).unwrap()),
        [(0, 0), (1, 1), (2, 2), (3, 3)]
    );
    // Equal sizes: identity.
    assert_eq!(
        pairs(pair_entries_flat_pp(3, 3, 7, 1).unwrap()),
        [(0, 0), (1, 1), (2, 2)]
    );
    // Past the decode's entries: refused instead of silently shortened.
    assert!(pair_entries_flat_pp(3, 4, 2, 0).is_err());
}

#[test]
fn layer_id_pairing_and_its_errors() {
    let got = pair_entries_by_layer_ids(&[3, 4, 3, 4], &[4, 3, 4, 3], 4, 4, false).unwrap();
    let got: Vec<_> = got.into_iter().map(|p| (p.src, p.dst)).collect();
    assert_eq!(got, [(0, 1), (1, 0), (2, 3), (3, 2)]);
    assert!(
        pair_entries_by_layer_ids(&[], &[], 0, 5, false)
            .unwrap()
            .is_empty()
    );
    let e = pair_entries_by_layer_ids(&[1], &[], 1, 1, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Layer metadata must be provided by both PD peers or neither"));
    // With fallback, one-sided ids fall back to positional pairing.
    assert_eq!(
        pair_entries_by_layer_ids(&[1], &[], 1, 1, true)
            .unwrap()
            .len(),
        1
    );
    let e = pair_entries_by_layer_ids(&[1, 2], &[1], 2, 2, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains(
        "Layer metadata length must match transfer entries: src metadata=2 entries=2, dst metadata=1 entries=2"
    ));
    let e = pair_entries_by_layer_ids(&[1, 9], &[1, 2], 2, 2, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Decode peer is missing a transfer entry for model layer 9"));
    let e = pair_entries_by_layer_ids(&[], &[], 4, 2, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains(
        "PP-heterogeneous transfer requires layer ids on both peers; got src=4 dst=2 entries"
    ));
    let e = pair_entries_by_layer_ids(&[], &[], 2, 4, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("got src=2 dst=4 entries"));
    assert_eq!(
        pair_entries_by_layer_ids(&[], &[], 2, 4, true)
            .unwrap()
            .len(),
        2
    );
}

#[test]
fn head_slice_params_examples() {
    let hs = |a, b, c| HeadSlice {
        src_head_start: a,
        num_heads: b,
        dst_head_start: c,
    };
    assert_eq!(
        compute_head_slice_params(2, 4, 1, 3, 8).unwrap(),
        hs(2, 2, 0)
    );
    assert_eq!(
        compute_head_slice_params(4, 2, 3, 1, 8).unwrap(),
        hs(0, 2, 2)
    );
    assert_eq!(
        compute_head_slice_params(2, 8, 0, 5, 2).unwrap(),
        hs(0, 1, 0)
    );
    assert_eq!(
        compute_head_slice_params(1, 4, 0, 2, 4).unwrap(),
        hs(2, 1, 0)
    );
    assert_eq!(
        compute_head_slice_params(8, 2, 5, 1, 8).unwrap(),
        hs(0, 1, 1)
    );
}

#[test]
fn head_slice_byte_example() {
    // H=8, P=2, prefill TP2 rank 1 -> decode TP4 rank 3, src item 2048, dst item 1024.
    let src = pool(2, 8, &[2048, 2048], &[]);
    let dst = pool(2, 16, &[1024, 1024], &[]);
    let slice = compute_head_slice_params(2, 4, 1, 3, 8).unwrap();
    let ranges = head_slice_ranges(&src, &dst, &identity_pairs(1), slice, 2, &[3], &[10]).unwrap();
    let got = addressed(ranges.as_slice(), &[0x10_0000], &[0xA0_0000]);
    assert_eq!(
        got,
        [(0x10_1A00, 0xA0_2800, 512), (0x10_1E00, 0xA0_2A00, 512)]
    );
    // The two token rows of the page: one strided range of 2 rows.
    assert_eq!((ranges.len(), ranges.row_count()), (1, 2));
    // The exact plan picks the same slice from the same rank.
    let sharding = HeadSharding::new(8, 2, 4).unwrap();
    let sources = sharding.sources_for(3).unwrap();
    assert_eq!(sources.len(), 1);
    assert_eq!((sources[0].src_rank, sources[0].slice), (1, slice));
    let exact = sharding
        .page_ranges(sources[0], &src, &dst, &identity_pairs(1), &[3], &[10])
        .unwrap();
    assert_eq!(exact, ranges);
}

#[test]
fn head_slice_wider_than_the_slot_is_refused() {
    let src = pool(2, 8, &[2048], &[]);
    let dst = pool(2, 16, &[1024], &[]);
    let slice = HeadSlice {
        src_head_start: 0,
        num_heads: 4,
        dst_head_start: 0,
    };
    let e = head_slice_ranges(&src, &dst, &identity_pairs(1), slice, 2, &[3], &[10])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("slice size (1024) exceeds target token slot size (512)"),
        "{e}"
    );
}

#[test]
fn dcp_byte_ranges_example() {
    // P=2, d=4, rank 1, two MLA target entries and one draft entry, 1152 bytes per token.
    let input = DcpPlanInput {
        src_pages: &[5, 2, 11, 4],
        dst_pages: SendPages::after_prefix(&[7]),
        page_size: 2,
        dcp_size: 4,
        dcp_rank: 1,
        num_kv_tokens: Some(8),
        ..DcpPlanInput::default()
    };
    let plan = input.plan().unwrap();
    let src = pool(2, 12, &[2304, 2304], &[2304]);
    let dst = pool(2, 8, &[2304, 2304], &[9216]);
    assert_eq!(
        dcp_token_item_lens(&src, &dst, 4).unwrap(),
        [1152, 1152, 1152]
    );
    let ranges = plan.byte_ranges(&src, &dst, &identity_pairs(3)).unwrap();
    let got = addressed(
        ranges.as_slice(),
        &[0x10000, 0x20000, 0x30000],
        &[0xA0000, 0xB0000, 0xC0000],
    );
    assert_eq!(
        got,
        [
            (0x13180, 0xA3F00, 1152),
            (0x16780, 0xA4380, 1152),
            (0x23180, 0xB3F00, 1152),
            (0x26780, 0xB4380, 1152),
            (0x32D00, 0xCFC00, 2304),
            (0x31200, 0xD0500, 2304),
            (0x36300, 0xD0E00, 2304),
            (0x32400, 0xD1700, 2304),
        ]
    );
    // Target rows 1 and 5 (source page stride 4 rows, destination consecutive) are one
    // range per entry; the draft rows' pages are not in progression.
    assert_eq!((ranges.len(), ranges.row_count()), (5, 8));
    assert_eq!(
        ranges.as_slice()[0],
        ByteRange::new(0, 11 * 1152, 0, 14 * 1152, 1152).with_rows(2, 12 * 1152, 1152)
    );
}

#[test]
fn dcp_geometry_check_examples() {
    let dst = [Some(2048), Some(2048), Some(4096)];
    assert_eq!(
        prepare_dcp_token_item_lens(&[2048, 2048, 1024], 1, 64, &dst, 4).unwrap(),
        [32, 32, 16]
    );
    let e = prepare_dcp_token_item_lens(&[2048, 1024], 1, 64, &[Some(2048), Some(1024)], 4)
        .unwrap_err()
        .to_string();
    assert!(e.contains(
        "PD DCP source/destination KV geometry differs at entry 1: src token bytes=16, dst token bytes=4 (dst item_len=1024, page scale=256)"
    ), "{e}");
    // Unknown decode lengths are skipped.
    assert_eq!(
        prepare_dcp_token_item_lens(&[2048, 1024], 1, 64, &[Some(2048), None], 4).unwrap(),
        [32, 16]
    );
    let e = prepare_dcp_token_item_lens(&[2048, 2048, 1024], 1, 64, &[Some(2048)], 4)
        .unwrap_err()
        .to_string();
    assert!(e.contains(
        "PD DCP requires the decode to register one KV entry per prefill entry: src=3 (draft=1), dst=1"
    ));
}

#[test]
fn pack_buffer_sizing_examples() {
    let mla = vec![64 * 1152; 61];
    assert_eq!(
        dcp_pack_buffer_bytes(&mla, 64, 32_768, 4).unwrap(),
        2_302_672_896
    );
    assert_eq!(
        dcp_pack_buffer_bytes(&[1024, 1024], 64, 10, 4).unwrap(),
        384
    );
    assert_eq!(
        dcp_pack_buffer_bytes(&[1024, 1024], 64, 16_384, 8).unwrap(),
        524_288
    );
    assert_eq!(dcp_pack_buffer_bytes(&[], 64, 16_384, 8).unwrap(), 0);
    let text = |r: Result<u64, GeometryError>| r.unwrap_err().to_string();
    assert!(
        text(dcp_pack_buffer_bytes(&[1024], 0, 10, 4))
            .contains("page_size must be positive, got 0")
    );
    assert!(
        text(dcp_pack_buffer_bytes(&[1024], 64, 10, 0))
            .contains("dcp_size must be positive, got 0")
    );
    assert!(text(dcp_pack_buffer_bytes(&[1024, 32], 64, 10, 4)).contains(
        "PD DCP pack requires each kv_item_len to span at least one page, got [1024, 32] with page_size=64"
    ));
    assert!(
        text(dcp_pack_buffer_bytes(&[1024, 100], 64, 10, 4)).contains(
            "PD DCP pack requires page-aligned kv_item_lens, got [1024, 100] with page_size=64"
        )
    );
}

#[test]
fn worked_example_b_second_chunk_with_prefix() {
    let plan = |r| {
        DcpPlanInput {
            src_pages: &[9, 3],
            dst_pages: SendPages::after_prefix(&[4, 6]),
            page_size: 2,
            dcp_size: 2,
            dcp_rank: r,
            chunk_start: 2,
            decode_prefix_len: 4,
            num_kv_tokens: Some(4),
        }
        .plan()
        .unwrap()
        .to_token_plan()
    };
    let r0 = plan(0);
    assert_eq!((r0.target_src, r0.target_dst), (vec![18, 6], vec![9, 12]));
    let r1 = plan(1);
    assert_eq!((r1.target_src, r1.target_dst), (vec![19, 7], vec![9, 12]));
    assert_eq!(r1.draft_src, [18, 19, 6, 7]);
    assert_eq!(r1.draft_dst, [18, 19, 24, 25]);
}

#[test]
fn worked_example_c_last_chunk_mid_page_and_chunk_invariance() {
    let run = |src: &[u64], o: u64, n, r| {
        DcpPlanInput {
            src_pages: src,
            dst_pages: SendPages::after_prefix(&[5, 9]),
            page_size: 4,
            dcp_size: 2,
            dcp_rank: r,
            chunk_start: o * 4,
            decode_prefix_len: 8,
            num_kv_tokens: Some(n),
        }
        .plan()
        .unwrap()
        .to_token_plan()
    };
    let r1 = run(&[12], 2, 3, 1);
    assert_eq!((r1.target_src, r1.target_dst), (vec![49], vec![36]));
    let r0 = run(&[12], 2, 3, 0);
    assert_eq!(
        (r0.target_src.clone(), r0.target_dst.clone()),
        (vec![48, 50], vec![36, 37])
    );
    assert_eq!(
        (r0.draft_src, r0.draft_dst),
        (vec![48, 49, 50], vec![72, 73, 74])
    );
    let whole = run(&[30, 31, 12], 0, 11, 0);
    assert_eq!(whole.target_src, [120, 122, 124, 126, 48, 50]);
    assert_eq!(whole.target_dst, [20, 21, 22, 23, 36, 37]);
}

#[test]
fn error_examples_d_and_up_front_rejections() {
    let base = DcpPlanInput {
        src_pages: &[0],
        dst_pages: SendPages::after_prefix(&[0]),
        page_size: 16,
        dcp_size: 4,
        ..DcpPlanInput::default()
    };
    for l in [100, 48] {
        let e = DcpPlanInput {
            decode_prefix_len: l,
            ..base
        }
        .plan()
        .unwrap_err()
        .to_string();
        assert!(e.contains(&format!(
            "PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size (64), got {l}"
        )));
    }
    let e = DcpPlanInput {
        page_size: 2,
        num_kv_tokens: Some(3),
        ..base
    }
    .plan()
    .unwrap_err();
    assert!(
        e.to_string().contains(
            "num_kv_tokens must fit in the provided source pages, got tokens=3, capacity=2"
        )
    );
    let e = DcpPlanInput {
        src_pages: &[1, 2, 3, 4],
        dst_pages: SendPages::after_prefix(&[7]),
        page_size: 2,
        dcp_size: 2,
        num_kv_tokens: Some(8),
        ..base
    }
    .plan()
    .unwrap_err();
    assert!(e.to_string().contains(
        "Insufficient destination DCP pages: required=2, provided=1, src_page_offset=0, dcp_rank=0"
    ));
    assert!(matches!(
        DcpPlanInput {
            page_size: 0,
            ..base
        }
        .plan(),
        Err(GeometryError::ZeroPageSize { .. })
    ));
    assert!(matches!(
        DcpPlanInput {
            dcp_size: 0,
            ..base
        }
        .plan(),
        Err(GeometryError::ZeroDcpSize { .. })
    ));
    assert!(matches!(
        DcpPlanInput {
            dcp_rank: 4,
            ..base
        }
        .plan(),
        Err(GeometryError::DcpRankOutOfRange {
            dcp_rank: 4,
            dcp_size: 4
        })
    ));
    // n == 0 short-circuits before the capacity check (0.5.23).
    let empty = DcpPlanInput {
        src_pages: &[],
        dst_pages: SendPages::after_prefix(&[]),
        num_kv_tokens: Some(0),
        ..base
    };
    assert!(empty.plan().unwrap().is_empty());
    // Huge page ids are refused instead of overflowing.
    let e = DcpPlanInput {
        src_pages: &[u64::MAX / 8],
        ..base
    }
    .plan()
    .unwrap_err();
    assert!(matches!(e, GeometryError::Overflow { .. }), "{e}");
}

#[test]
fn prefix_alignment_helpers() {
    assert_eq!(align_prefix_down(100, 16, 4).unwrap(), 64);
    assert_eq!(align_prefix_down(64, 16, 4).unwrap(), 64);
    assert_eq!(align_prefix_down(63, 16, 4).unwrap(), 0);
    assert_eq!(align_prefix_up(100, 16, 4).unwrap(), 128);
    assert_eq!(align_prefix_up(128, 16, 4).unwrap(), 128);
    assert_eq!(align_prefix_up(0, 16, 4).unwrap(), 0);
    assert!(align_prefix_up(u64::MAX, 16, 4).is_err());
    assert!(align_prefix_down(1, 0, 4).is_err());
    // The rounded-down prefix is accepted by the planner.
    let l = align_prefix_down(100, 16, 4).unwrap();
    let ok = DcpPlanInput {
        src_pages: &[0],
        dst_pages: SendPages::after_prefix(&[0]),
        page_size: 16,
        dcp_size: 4,
        decode_prefix_len: l,
        ..DcpPlanInput::default()
    };
    assert!(ok.plan().is_ok());
}

#[test]
fn pool_geometry_constructor_validates() {
    let e = PoolGeometry::builder(0)
        .target_entries(&[64])
        .build()
        .unwrap_err();
    assert!(matches!(e, GeometryError::ZeroPageSize { .. }));
    let e = PoolGeometry::builder(64)
        .num_pages(4)
        .target_entries(&[100])
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("entry 0 has item_len=100"), "{e}");
    let e = PoolGeometry::builder(64)
        .num_pages(4)
        .target_entries(&[64])
        .draft_entries(&[0])
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("entry 1 has item_len=0"), "{e}");
    assert!(PoolGeometry::builder(64).build().is_err());
    // A page count left out is named as such, not reported later as every page id being out
    // of range.
    let e = PoolGeometry::builder(64)
        .target_entries(&[64])
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("page count is not set; call num_pages(n)"),
        "{e}"
    );
    let e = PoolGeometry::builder(64)
        .num_pages(0)
        .target_entries(&[64])
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_pages is 0"), "{e}");
    let mha = PoolFormat::Mha {
        total_kv_heads: 8,
        head_dim: 128,
    };
    assert!(
        PoolGeometry::builder(64)
            .target_entries(&[64; 3])
            .format(mha)
            .build()
            .is_err()
    );
    assert!(
        PoolGeometry::builder(64)
            .target_entries(&[64])
            .dtype("")
            .build()
            .is_err()
    );
    assert!(
        PoolGeometry::builder(64)
            .num_pages(u64::MAX)
            .target_entries(&[128])
            .build()
            .is_err()
    );
    let p = PoolGeometry::builder(64)
        .num_pages(10)
        .target_entries(&[64 * 1152; 2])
        .draft_entries(&[64 * 4 * 1152])
        .dtype("fp8_e4m3")
        .build()
        .unwrap();
    assert_eq!(
        (p.num_target(), p.num_draft(), p.dtype()),
        (2, 1, "fp8_e4m3")
    );
    assert_eq!(p.token_bytes(0), Some(1152));
    assert_eq!(p.entry_bytes(2), Some(10 * 64 * 4 * 1152));
    assert_eq!(p.kind(), kvbridge_geometry::PoolKind::Mla);
}
