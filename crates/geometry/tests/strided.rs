//! Strided byte ranges: every planner path folds rows into progressions, and expanding them
//! gives exactly the per-row ranges of a planner that only merges contiguous continuations
//! (the reference below), for random geometries.

mod common;

use common::World;
use kvbridge_geometry::{
    ByteRange, ByteRanges, DcpPlanInput, EntryPair, EntryRole, HeadSharding, PoolGeometry, Run,
    SendPages, group_concurrent_contiguous, head_slice_ranges, identity_pairs, page_path_ranges,
};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    ProptestConfig::with_cases(if cfg!(miri) { 4 } else { 256 })
}

/// `(src_entry, src_offset, dst_entry, dst_offset, len)` of one contiguous copy.
type Row = (usize, u64, usize, u64, u64);

/// The reference: descriptors pushed one contiguous piece at a time, merged only when both
/// sides continue the previous one.
#[derive(Debug, Default)]
struct Reference(Vec<Row>);

impl Reference {
    fn push(&mut self, r: Row) {
        if r.4 == 0 {
            return;
        }
        if let Some(l) = self.0.last_mut() {
            if l.0 == r.0 && l.2 == r.2 && l.1 + l.4 == r.1 && l.3 + l.4 == r.3 {
                l.4 += r.4;
                return;
            }
        }
        self.0.push(r);
    }

    /// Row `s` of the source is `[s·sw + sc, +width)`, row `d` of the destination
    /// `[d·dw + dc, +width)`; whole rows of a run are one piece, slices one piece per row.
    fn push_runs(&mut self, pair: EntryPair, geo: [u64; 5], runs: impl Iterator<Item = Run>) {
        let [sw, dw, sc, dc, width] = geo;
        let whole = sc == 0 && dc == 0 && width == sw && width == dw;
        for run in runs {
            if whole {
                self.push((
                    pair.src,
                    run.src_start * sw,
                    pair.dst,
                    run.dst_start * dw,
                    run.len * width,
                ));
            } else {
                for (s, d) in run.pairs() {
                    self.push((pair.src, s * sw + sc, pair.dst, d * dw + dc, width));
                }
            }
        }
    }
}

fn whole(width: u64) -> [u64; 5] {
    [width, width, 0, 0, width]
}

/// Checks the strided ranges against the reference and the pools: same rows in the same
/// order, every row inside its entries, destination rows of a range apart, canonical counts.
fn check(got: &ByteRanges, want: &Reference, src: &PoolGeometry, dst: &PoolGeometry) {
    let rows: Vec<Row> = got
        .iter()
        .flat_map(ByteRange::rows)
        .map(|r| (r.src_entry, r.src_offset, r.dst_entry, r.dst_offset, r.len))
        .collect();
    assert_eq!(
        rows, want.0,
        "expanded strided ranges differ from the reference"
    );
    assert_eq!(got.row_count(), want.0.len() as u64);
    assert!(got.len() <= want.0.len());
    assert_eq!(got.total_bytes(), want.0.iter().map(|r| r.4).sum::<u64>());
    for r in got {
        assert!(r.count >= 1 && r.len > 0, "{r:?}");
        if r.count == 1 {
            assert_eq!((r.src_stride, r.dst_stride), (r.len, r.len), "{r:?}");
        } else {
            assert!(r.dst_stride >= r.len, "destination rows overlap: {r:?}");
        }
        let k = r.count - 1;
        let src_end = r.src_offset + k * r.src_stride + r.len;
        let dst_end = r.dst_offset + k * r.dst_stride + r.len;
        assert!(src_end <= src.entry_bytes(r.src_entry).unwrap(), "{r:?}");
        assert!(dst_end <= dst.entry_bytes(r.dst_entry).unwrap(), "{r:?}");
    }
}

/// How page ids are allocated: ascending or descending consecutive ids from a base, every
/// `step`-th id, or shuffled distinct ids.
#[derive(Debug, Clone, Copy)]
enum Alloc {
    Ascending(u64),
    Descending(u64),
    Step(u64, u64),
    Shuffled(u64),
}

fn alloc() -> impl Strategy<Value = Alloc> {
    prop_oneof![
        (0u64..5).prop_map(Alloc::Ascending),
        (0u64..5).prop_map(Alloc::Descending),
        (0u64..5, 2u64..4).prop_map(|(b, s)| Alloc::Step(b, s)),
        any::<u64>().prop_map(Alloc::Shuffled),
    ]
}

fn table(alloc: Alloc, n: u64) -> Vec<u64> {
    match alloc {
        Alloc::Ascending(base) => (base..base + n).collect(),
        Alloc::Descending(base) => (base..base + n).rev().collect(),
        Alloc::Step(base, step) => (0..n).map(|i| base + i * step).collect(),
        Alloc::Shuffled(seed) => common::shuffled(&mut (seed | 1), n),
    }
}

/// A head split (KV heads 1..=8, attention TP sizes 1..=16 on each side), the decode TP size
/// and the bytes of one head per token row.
fn head_sharding() -> impl Strategy<Value = (HeadSharding, u64, u64)> {
    let sizes = [1u64, 2, 4, 8, 16];
    (0usize..4, 0usize..5, 0usize..5, 1u64..=3).prop_map(move |(h, s, d, hb)| {
        let sharding = HeadSharding::new([1u64, 2, 4, 8][h], sizes[s], sizes[d]).unwrap();
        (sharding, sizes[d], hb)
    })
}

fn pages_for(tables: &[&[u64]]) -> u64 {
    tables
        .iter()
        .flat_map(|t| t.iter())
        .max()
        .map_or(1, |m| m + 1)
}

proptest! {
    #![proptest_config(config())]

    /// Prefill DCP 1 → decode DCP `d`: target and draft entries, chunks, prefixes.
    #[test]
    fn dcp_plan_ranges_expand_to_the_reference(
        (p, d) in (1u64..=8, 1u64..=6),
        rank_seed in any::<u64>(),
        prefix_pages in 0u64..=2,
        chunk_pages in 0u64..=3,
        n in 1u64..=100,
        toks in proptest::collection::vec(1u64..=3, 1..=3),
        (sa, da) in (alloc(), alloc()),
    ) {
        let r = rank_seed % d;
        let chunk_start = chunk_pages * p;
        let src_pages = table(sa, n.div_ceil(p));
        let dst_pages = table(da, (chunk_start + n).div_ceil(p * d));
        let plan = DcpPlanInput {
            src_pages: &src_pages,
            dst_pages: SendPages::after_prefix(&dst_pages),
            page_size: p,
            dcp_size: d,
            dcp_rank: r,
            chunk_start,
            decode_prefix_len: prefix_pages * p * d,
            num_kv_tokens: Some(n),
        }
        .plan()
        .unwrap();
        let items: Vec<u64> = toks.iter().map(|t| t * 8 * p).collect();
        let src = PoolGeometry::builder(p)
            .num_pages(pages_for(&[&src_pages]))
            .target_entries(&items)
            .draft_entries(&[toks[0] * 8 * p])
            .build()
            .unwrap();
        let dst = PoolGeometry::builder(p)
            .num_pages(pages_for(&[&dst_pages]))
            .target_entries(&items)
            .draft_entries(&[toks[0] * 8 * p * d])
            .build()
            .unwrap();
        let pairs = identity_pairs(items.len() + 1);
        let got = plan.byte_ranges(&src, &dst, &pairs).unwrap();
        let mut want = Reference::default();
        for &pair in &pairs {
            let w = src.entries()[pair.src].item_len / p;
            if src.entries()[pair.src].role == EntryRole::Draft {
                want.push_runs(pair, whole(w), plan.draft_runs());
            } else {
                want.push_runs(pair, whole(w), plan.target_runs());
            }
        }
        check(&got, &want, &src, &dst);
    }

    /// Any prefill DCP `a` → any decode DCP `b` (including `a > b`), different page sizes,
    /// chunks, prefixes, whole token rows and head slices.
    #[test]
    fn reshard_ranges_expand_to_the_reference(
        (a, b) in (1u64..=6, 1u64..=6),
        (p1, p2) in (1u64..=8, 1u64..=8),
        prefix_pages in 0u64..=2,
        total in 1u64..=120,
        chunks in 1u64..=3,
        (sa, da) in (alloc(), alloc()),
        (sharding, tp_dst, hb) in head_sharding(),
        layers in 1usize..=3,
    ) {
        let prefix = prefix_pages * p2 * b;
        let mut cuts: Vec<u64> = (1..chunks).map(|k| k * total / chunks).collect();
        cuts.dedup();
        cuts.retain(|&c| c > 0);
        let w = World {
            a,
            b,
            p1,
            p2,
            prefix,
            total,
            cuts,
            prefill_tables: (0..a).map(|_| table(sa, (prefix + total).div_ceil(a).div_ceil(p1))).collect(),
            dst: table(da, total.div_ceil(p2 * b)),
        };
        let num_src_pages = pages_for(&w.prefill_tables.iter().map(Vec::as_slice).collect::<Vec<_>>());
        let num_dst_pages = pages_for(&[&w.dst]);
        let (hs, hd) = (sharding.heads_per_src_rank(), sharding.heads_per_dst_rank());
        let pool = |p: u64, pages: u64, tok: u64| {
            PoolGeometry::builder(p)
                .num_pages(pages)
                .target_entries(&vec![p * tok; layers])
                .build()
                .unwrap()
        };
        let (src, dst) = (pool(p1, num_src_pages, 8), pool(p2, num_dst_pages, 8));
        let (hsrc, hdst) = (pool(p1, num_src_pages, hs * hb), pool(p2, num_dst_pages, hd * hb));
        let pairs = identity_pairs(layers);
        for (c0, n) in w.chunks() {
            for ar in 0..a {
                for br in 0..b {
                    let plan = w.input(ar, br, c0, n).plan().unwrap();
                    let got = plan.byte_ranges(&src, &dst, &pairs).unwrap();
                    let mut want = Reference::default();
                    for &pair in &pairs {
                        want.push_runs(pair, whole(8), plan.runs());
                    }
                    check(&got, &want, &src, &dst);
                    // Head slices of the same rows, for one decode TP rank per rank pair.
                    let dst_tp_rank = (ar * b + br) % tp_dst;
                    for source in sharding.sources_for(dst_tp_rank).unwrap() {
                        let got = plan.head_byte_ranges(&hsrc, &hdst, &pairs, &sharding, source).unwrap();
                        let s = source.slice;
                        let geo = [hs * hb, hd * hb, s.src_head_start * hb, s.dst_head_start * hb, s.num_heads * hb];
                        let mut want = Reference::default();
                        for &pair in &pairs {
                            want.push_runs(pair, geo, plan.runs());
                        }
                        check(&got, &want, &hsrc, &hdst);
                    }
                }
            }
        }
    }

    /// The page path and head slices on it: page runs of any page tables, a source list
    /// longer than the destination's truncated.
    #[test]
    fn page_path_ranges_expand_to_the_reference(
        p in 1u64..=8,
        n in 0u64..=12,
        extra in 0u64..=2,
        (sa, da) in (alloc(), alloc()),
        (sharding, tp_dst, hb) in head_sharding(),
        layers in 1usize..=3,
    ) {
        let src_pages = table(sa, n + extra);
        let dst_pages = table(da, n);
        let pool = |pages: &[u64], tok: u64| {
            PoolGeometry::builder(p)
                .num_pages(pages_for(&[pages]))
                .target_entries(&vec![p * tok; layers])
                .build()
                .unwrap()
        };
        let (src, dst) = (pool(&src_pages, 8), pool(&dst_pages, 8));
        let pairs = identity_pairs(layers);
        let truncated = &src_pages[..n as usize];
        let got = page_path_ranges(&src, &dst, &pairs, &src_pages, &dst_pages).unwrap();
        let runs = group_concurrent_contiguous(truncated, &dst_pages).unwrap();
        let mut want = Reference::default();
        for &pair in &pairs {
            want.push_runs(pair, whole(8 * p), runs.iter().copied());
        }
        check(&got, &want, &src, &dst);

        let (hs, hd) = (sharding.heads_per_src_rank(), sharding.heads_per_dst_rank());
        let (hsrc, hdst) = (pool(&src_pages, hs * hb), pool(&dst_pages, hd * hb));
        let row_runs = || runs.iter().map(|r| Run::new(r.src_start * p, r.dst_start * p, r.len * p));
        for dst_rank in 0..tp_dst {
            for source in sharding.sources_for(dst_rank).unwrap() {
                let got = sharding.page_ranges(source, &hsrc, &hdst, &pairs, &src_pages, &dst_pages).unwrap();
                let same = head_slice_ranges(&hsrc, &hdst, &pairs, source.slice, hd, &src_pages, &dst_pages).unwrap();
                prop_assert_eq!(&got, &same);
                let s = source.slice;
                let geo = [hs * hb, hd * hb, s.src_head_start * hb, s.dst_head_start * hb, s.num_heads * hb];
                let mut want = Reference::default();
                for &pair in &pairs {
                    want.push_runs(pair, geo, row_runs());
                }
                check(&got, &want, &hsrc, &hdst);
            }
        }
    }

    /// Pushing arbitrary rows: the expansion is the reference's, and region placement keeps
    /// every row.
    #[test]
    fn pushed_rows_expand_to_the_reference(
        rows in proptest::collection::vec((0usize..2, 0u64..64, 0usize..2, 0u64..64, 0u64..6), 0..40),
    ) {
        let mut got = ByteRanges::new();
        let mut want = Reference::default();
        for &(se, so, de, d, len) in &rows {
            got.push(ByteRange::new(se, so, de, d, len));
            want.push((se, so, de, d, len));
        }
        let expanded: Vec<Row> = got
            .iter()
            .flat_map(ByteRange::rows)
            .map(|r| (r.src_entry, r.src_offset, r.dst_entry, r.dst_offset, r.len))
            .collect();
        prop_assert_eq!(&expanded, &want.0);
        for r in &got {
            prop_assert!(r.count == 1 || r.dst_stride >= r.len, "{:?}", r);
        }
        let placed = got.to_region_ranges(&[0, 1000], &[0, 1000]).unwrap();
        let mut region = Reference::default();
        for r in &want.0 {
            region.push((0, r.1 + 1000 * r.0 as u64, 0, r.3 + 1000 * r.2 as u64, r.4));
        }
        let expanded: Vec<Row> = placed
            .iter()
            .flat_map(|r| (0..r.count).map(move |i| (0, r.src_offset + i * r.src_stride, 0, r.dst_offset + i * r.dst_stride, r.len)))
            .collect();
        prop_assert_eq!(expanded, region.0);
    }
}

#[test]
fn push_folds_rows_into_progressions() {
    let mut r = ByteRanges::new();
    // Rows every 4 rows on the source, consecutive on the destination.
    for i in 0..16 {
        r.push(ByteRange::new(0, i * 4 * 1152, 3, i * 1152, 1152));
    }
    assert_eq!(
        r.as_slice(),
        [ByteRange::new(0, 0, 3, 0, 1152).with_rows(16, 4 * 1152, 1152)]
    );
    assert_eq!(
        (r.len(), r.row_count(), r.total_bytes()),
        (1, 16, 16 * 1152)
    );
    // Another entry pair starts a new range; a different length too.
    r.push(ByteRange::new(1, 64 * 1152, 3, 16 * 1152, 1152));
    r.push(ByteRange::new(1, 68 * 1152, 3, 17 * 1152, 100));
    assert_eq!((r.len(), r.row_count()), (3, 18));
}

#[test]
fn contiguous_rows_still_extend_and_leave_a_progression() {
    let mut r = ByteRanges::new();
    r.push(ByteRange::new(0, 0, 0, 0, 10));
    r.push(ByteRange::new(0, 10, 0, 10, 10));
    assert_eq!(r.as_slice(), [ByteRange::new(0, 0, 0, 0, 20)]);
    // A progression of 20-byte rows, then a row continuing its last row contiguously: the
    // last row leaves the progression and merges with it (as a contiguous-only list would).
    r.push(ByteRange::new(0, 100, 0, 40, 20));
    r.push(ByteRange::new(0, 200, 0, 80, 20));
    r.push(ByteRange::new(0, 220, 0, 100, 5));
    assert_eq!(
        r.as_slice(),
        [
            ByteRange::new(0, 0, 0, 0, 20).with_rows(2, 100, 40),
            ByteRange::new(0, 200, 0, 80, 25),
        ]
    );
    // Back to one row: strides reset.
    let mut r = ByteRanges::new();
    r.push(ByteRange::new(0, 0, 0, 0, 4));
    r.push(ByteRange::new(0, 8, 0, 8, 4));
    r.push(ByteRange::new(0, 12, 0, 12, 4));
    assert_eq!(
        r.as_slice(),
        [ByteRange::new(0, 0, 0, 0, 4), ByteRange::new(0, 8, 0, 8, 8)]
    );
}

#[test]
fn progressions_never_overlap_destination_rows_or_go_backwards() {
    let mut r = ByteRanges::new();
    // Destination stride 2 < len 4: the rows would overlap, so no progression.
    r.push(ByteRange::new(0, 0, 0, 0, 4));
    r.push(ByteRange::new(0, 16, 0, 2, 4));
    assert_eq!(r.len(), 2);
    // Descending offsets (negative strides) are not progressions.
    let mut r = ByteRanges::new();
    r.push(ByteRange::new(0, 64, 0, 0, 4));
    r.push(ByteRange::new(0, 0, 0, 8, 4));
    assert_eq!(r.len(), 2);
    // A third row off the progression starts a new range.
    let mut r = ByteRanges::new();
    for (s, d) in [(0, 0), (10, 4), (21, 8)] {
        r.push(ByteRange::new(0, s, 0, d, 4));
    }
    assert_eq!(
        r.as_slice(),
        [
            ByteRange::new(0, 0, 0, 0, 4).with_rows(2, 10, 4),
            ByteRange::new(0, 21, 0, 8, 4),
        ]
    );
    // Empty pushes are dropped.
    r.push(ByteRange::new(0, 40, 0, 12, 0));
    r.push(ByteRange::new(0, 40, 0, 12, 4).with_rows(0, 1, 4));
    assert_eq!(r.row_count(), 3);
}

#[test]
fn multi_row_pushes_fold_as_a_whole() {
    let mut r = ByteRanges::new();
    let a = ByteRange::new(0, 0, 0, 0, 8).with_rows(4, 32, 8);
    // The next four rows of the same progression.
    let b = ByteRange::new(0, 128, 0, 32, 8).with_rows(4, 32, 8);
    r.push(a);
    r.push(b);
    assert_eq!(r.as_slice(), [a.with_rows(8, 32, 8)]);
    // Same strides but not continuing: its first row cannot fold, the rest stays together.
    let c = ByteRange::new(0, 1000, 0, 100, 8).with_rows(3, 16, 8);
    r.push(c);
    assert_eq!(r.len(), 2);
    assert_eq!(r.as_slice()[1], c);
    // Different strides: its first row continues the previous progression and folds in,
    // the rest is appended.
    let d = ByteRange::new(0, 1000 + 3 * 16, 0, 124, 8).with_rows(2, 64, 8);
    r.push(d);
    assert_eq!((r.len(), r.row_count()), (3, 13));
    assert_eq!(r.as_slice()[1], c.with_rows(4, 16, 8));
    assert_eq!(r.as_slice()[2], ByteRange::new(0, 1048 + 64, 0, 132, 8));
    assert_eq!(
        a.rows().map(|x| x.src_offset).collect::<Vec<_>>(),
        [0, 32, 64, 96]
    );
    assert_eq!(a.total_bytes(), 32);
}

#[test]
fn region_ranges_keep_progressions_across_entries() {
    // Two layers of 4 rows each every 2 rows, entries back to back in one region.
    let mut r = ByteRanges::new();
    for e in 0..2 {
        for i in 0..4 {
            r.push(ByteRange::new(e, i * 16, e, i * 8, 8));
        }
    }
    assert_eq!(r.len(), 2);
    let placed = r.to_region_ranges(&[0, 64], &[0, 32]).unwrap();
    assert_eq!(placed.len(), 1);
    assert_eq!(
        (placed[0].count, placed[0].src_stride, placed[0].dst_stride),
        (8, 16, 8)
    );
    // A last row past u64 is refused.
    let mut far = ByteRanges::new();
    far.push(ByteRange::new(0, 0, 0, 0, 8).with_rows(3, u64::MAX / 2, 8));
    assert_eq!(far.len(), 1);
    assert!(far.to_region_ranges(&[0], &[0]).is_err());
}

/// A page-id allocation from a seed.
type Allocator = fn(u64) -> Alloc;

/// `(rows moved, strided ranges, rows they cover)` summed over every (prefill rank, decode
/// rank) pair of one MLA request of `total` tokens in chunks of 4096 tokens, 1152-byte rows,
/// with prefill page ids allocated by `src` (each prefill rank its own table) and decode
/// virtual page ids by `dst`.
fn descriptors(
    (src, dst): (Allocator, Allocator),
    total: u64,
    layers: usize,
    (a, b): (u64, u64),
    (p1, p2): (u64, u64),
) -> (u64, usize, u64) {
    const CHUNK: u64 = 4096;
    let w = World {
        a,
        b,
        p1,
        p2,
        prefix: 0,
        total,
        cuts: (CHUNK..total).step_by(CHUNK as usize).collect(),
        prefill_tables: (0..a)
            .map(|r| table(src(1031 + r), total.div_ceil(a).div_ceil(p1)))
            .collect(),
        dst: table(dst(257), total.div_ceil(p2 * b)),
    };
    let pool = |p: u64| {
        PoolGeometry::builder(p)
            .num_pages(4099)
            .target_entries(&vec![p * 1152; layers])
            .build()
            .unwrap()
    };
    let (src_pool, dst_pool) = (pool(p1), pool(p2));
    let (mut rows, mut ranges, mut covered) = (0, 0, 0);
    for (c0, n) in w.chunks() {
        for ar in 0..a {
            for br in 0..b {
                let plan = w.input(ar, br, c0, n).plan().unwrap();
                rows += plan.len();
                let r = plan
                    .byte_ranges(&src_pool, &dst_pool, &identity_pairs(layers))
                    .unwrap();
                ranges += r.len();
                covered += r.row_count();
            }
        }
    }
    (rows, ranges, covered)
}

/// The descriptor table of docs/planning.md: one request of the demo's geometry (8192 tokens,
/// 61 MLA layers of 1152-byte rows, chunks of 4096 tokens).
#[test]
fn descriptor_counts_for_documented_geometries() {
    let ascending: Allocator = |_| Alloc::Ascending(0);
    // `kvbridge-lab demo`'s page tables: a slot's pages in reverse order.
    let reversed: Allocator = |_| Alloc::Descending(0);
    let scattered: Allocator = Alloc::Shuffled;
    let layouts = [
        (ascending, ascending),
        (reversed, reversed),
        (ascending, reversed),
        (scattered, scattered),
    ];
    // (DCP a → b, P1 → P2): (strided ranges, rows they cover) per layout, as above.
    type Row = ((u64, u64), (u64, u64), [(usize, u64); 4]);
    let table: [Row; 6] = [
        (
            (1, 4),
            (64, 64),
            [
                (488, 499_712),
                (31_232, 499_712),
                (7_808, 499_712),
                (31_232, 499_712),
            ],
        ),
        (
            (2, 4),
            (16, 64),
            [
                (488, 499_712),
                (62_464, 499_712),
                (7_808, 499_712),
                (62_342, 499_712),
            ],
        ),
        (
            (4, 1),
            (64, 64),
            [
                (488, 499_712),
                (31_232, 499_712),
                (31_232, 499_712),
                (31_232, 499_712),
            ],
        ),
        (
            (1, 1),
            (64, 64),
            [(122, 122), (7_808, 7_808), (7_808, 7_808), (5_978, 7_808)],
        ),
        (
            (4, 4),
            (64, 64),
            [(488, 488), (7_808, 7_808), (7_808, 7_808), (5_795, 7_808)],
        ),
        (
            (1, 1),
            (16, 64),
            [
                (122, 122),
                (31_232, 31_232),
                (7_808, 7_808),
                (20_618, 31_171),
            ],
        ),
    ];
    for (dcp, pages, want) in table {
        for (layout, (ranges, rows)) in layouts.into_iter().zip(want) {
            assert_eq!(
                descriptors(layout, 8192, 61, dcp, pages),
                (8192, ranges, rows),
                "DCP {dcp:?}, pages {pages:?}"
            );
        }
    }
}
