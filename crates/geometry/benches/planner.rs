//! Planner benchmarks (divan): page size 64, DCP 8, one 131072-token chunk (2048 source pages,
//! 256 destination virtual pages), every destination rank per iteration.
//!
//! Run with `cargo xtask bench planner`. `python -m kvbridge.bench planner` (the Python package,
//! `crates/python`) times SGLang 0.5.23's numpy planner on the same inputs.

use divan::{Bencher, black_box};
use kvbridge_geometry::{
    DcpPlanInput, PoolGeometry, Run, SendPages, group_concurrent_contiguous, identity_pairs,
};

const PAGE_SIZE: u64 = 64;
const DCP: u64 = 8;
const TOKENS: u64 = 131_072;

fn main() {
    divan::main();
}

/// Scattered but deterministic page ids (same formulas as the Python script).
fn pages() -> (Vec<u64>, Vec<u64>) {
    let src = (0..TOKENS / PAGE_SIZE).map(|i| (i * 1031) % 4096).collect();
    let dst = (0..TOKENS / (PAGE_SIZE * DCP))
        .map(|i| (i * 257 + 3) % 1024)
        .collect();
    (src, dst)
}

fn input<'a>(src: &'a [u64], dst: &'a [u64], rank: u64) -> DcpPlanInput<'a> {
    DcpPlanInput {
        src_pages: src,
        dst_pages: SendPages::after_prefix(dst),
        page_size: PAGE_SIZE,
        dcp_size: DCP,
        dcp_rank: rank,
        num_kv_tokens: Some(TOKENS),
        ..DcpPlanInput::default()
    }
}

/// (a) Per-token target arrays `(target_src, target_dst)` for all 8 ranks.
#[divan::bench]
fn a_target_arrays_all_ranks(bencher: Bencher<'_, '_>) {
    let (src, dst) = pages();
    bencher.bench(|| {
        for rank in 0..DCP {
            let plan = input(black_box(&src), black_box(&dst), rank)
                .plan()
                .unwrap();
            black_box(plan.target_arrays());
        }
    });
}

/// (a') SGLang's full output (target and draft arrays) for all 8 ranks.
#[divan::bench]
fn a_full_token_plan_all_ranks(bencher: Bencher<'_, '_>) {
    let (src, dst) = pages();
    bencher.bench(|| {
        for rank in 0..DCP {
            let plan = input(black_box(&src), black_box(&dst), rank)
                .plan()
                .unwrap();
            black_box(plan.to_token_plan());
        }
    });
}

/// (a'') The full output written into reused buffers (no allocation per iteration).
#[divan::bench]
fn a_full_token_plan_reused_all_ranks(bencher: Bencher<'_, '_>) {
    let (src, dst) = pages();
    let mut out = kvbridge_geometry::DcpTokenPlan::default();
    bencher.bench_local(|| {
        for rank in 0..DCP {
            let plan = input(black_box(&src), black_box(&dst), rank)
                .plan()
                .unwrap();
            plan.fill_token_plan(&mut out);
            black_box(&out);
        }
    });
}

/// (b) Plan plus coalesced target runs collected into a `Vec<Run>`, for all 8 ranks, no
/// per-token arrays.
#[divan::bench]
fn b_target_runs_all_ranks(bencher: Bencher<'_, '_>) {
    let (src, dst) = pages();
    bencher.bench(|| {
        for rank in 0..DCP {
            let plan = input(black_box(&src), black_box(&dst), rank)
                .plan()
                .unwrap();
            black_box(plan.target_runs_vec());
        }
    });
}

/// (b') Plan plus runs, iterated without collecting (a caller emitting descriptors directly).
#[divan::bench]
fn b_target_runs_streamed_all_ranks(bencher: Bencher<'_, '_>) {
    let (src, dst) = pages();
    bencher.bench(|| {
        for rank in 0..DCP {
            let plan = input(black_box(&src), black_box(&dst), rank)
                .plan()
                .unwrap();
            black_box(
                plan.target_runs()
                    .fold(0u64, |acc, r| acc ^ r.src_start ^ r.len),
            );
        }
    });
}

/// (b''') Runs pulled one by one with `Iterator::next` and collected.
#[divan::bench]
fn b_target_runs_collect_all_ranks(bencher: Bencher<'_, '_>) {
    let (src, dst) = pages();
    bencher.bench(|| {
        for rank in 0..DCP {
            let plan = input(black_box(&src), black_box(&dst), rank)
                .plan()
                .unwrap();
            black_box(plan.target_runs().collect::<Vec<Run>>());
        }
    });
}

/// (b'') The array route: per-token arrays, then `group_concurrent_contiguous`.
#[divan::bench]
fn b_arrays_then_group_all_ranks(bencher: Bencher<'_, '_>) {
    let (src, dst) = pages();
    bencher.bench(|| {
        for rank in 0..DCP {
            let plan = input(black_box(&src), black_box(&dst), rank)
                .plan()
                .unwrap();
            let (s, d) = plan.target_arrays();
            black_box(group_concurrent_contiguous(&s, &d).unwrap());
        }
    });
}

/// (c) General resharding, prefill DCP 2 (page 32) → decode DCP 8 (page 64), same chunk:
/// runs of every (prefill rank, decode rank) pair that holds rows.
#[divan::bench]
fn c_reshard_2_to_8_runs_all_pairs(bencher: Bencher<'_, '_>) {
    let src: Vec<u64> = (0..TOKENS / 2 / 32).map(|i| (i * 1031) % 4096).collect();
    let (_, dst) = pages();
    bencher.bench(|| {
        for ar in 0..2 {
            for br in kvbridge_geometry::reshard_targets(2, DCP, ar).unwrap() {
                let plan = kvbridge_geometry::ReshardInput {
                    src_pages: black_box(&src),
                    dst_pages: SendPages::after_prefix(black_box(&dst)),
                    src_page_size: 32,
                    dst_page_size: PAGE_SIZE,
                    src_dcp_size: 2,
                    src_dcp_rank: ar,
                    dst_dcp_size: DCP,
                    dst_dcp_rank: br,
                    num_tokens: TOKENS,
                    ..kvbridge_geometry::ReshardInput::default()
                }
                .plan()
                .unwrap();
                black_box(plan.runs().fold(0u64, |acc, r| acc ^ r.src_start ^ r.len));
            }
        }
    });
}

/// Plan plus strided byte ranges of `layers` MLA layers (1152-byte rows) for all 8 ranks
/// (source page ids below 4096, destination virtual page ids below 1024).
fn strided_byte_ranges(bencher: Bencher<'_, '_>, layers: usize) {
    let (src, dst) = pages();
    let pool = |pages| {
        PoolGeometry::builder(PAGE_SIZE)
            .num_pages(pages)
            .target_entries(&vec![PAGE_SIZE * 1152; layers])
            .build()
            .unwrap()
    };
    let (src_pool, dst_pool) = (pool(4096), pool(1024));
    let pairs = identity_pairs(layers);
    bencher.bench(|| {
        for rank in 0..DCP {
            let plan = input(black_box(&src), black_box(&dst), rank)
                .plan()
                .unwrap();
            black_box(plan.byte_ranges(&src_pool, &dst_pool, &pairs).unwrap());
        }
    });
}

/// (d) Strided byte ranges of one MLA layer: what a transport posts, comparable to SGLang's
/// plan plus grouping.
#[divan::bench]
fn d_strided_byte_ranges_all_ranks(bencher: Bencher<'_, '_>) {
    strided_byte_ranges(bencher, 1);
}

/// (d') The same for 61 MLA layers (the demo's model).
#[divan::bench]
fn d_strided_byte_ranges_61_layers_all_ranks(bencher: Bencher<'_, '_>) {
    strided_byte_ranges(bencher, 61);
}
