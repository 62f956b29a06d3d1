//! Property tests of the DCP token plan, run coalescing and byte ranges.

use std::collections::HashSet;

use kvbridge_geometry::{
    ByteRange, DcpPlanInput, PoolGeometry, Run, SendPages, coalesce_pairs,
    group_concurrent_contiguous, identity_pairs,
};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    ProptestConfig::with_cases(if cfg!(miri) { 4 } else { 256 })
}

/// A send range: page size, DCP size, prefix, total tokens, the prefill pages of the whole
/// range and the decode virtual pages of the whole range (distinct, shuffled ids).
#[derive(Debug, Clone)]
struct Range {
    p: u64,
    d: u64,
    prefix: u64,
    total: u64,
    src: Vec<u64>,
    dst: Vec<u64>,
}

fn send_range() -> impl Strategy<Value = Range> {
    (1u64..=8, 1u64..=6, 0u64..=3, 1u64..=160)
        .prop_flat_map(|(p, d, prefix_pages, total)| {
            let n_src = total.div_ceil(p) as usize;
            let n_dst = total.div_ceil(p * d) as usize;
            (
                Just((p, d, prefix_pages * p * d, total)),
                Just((0..(2 * n_src as u64)).collect::<Vec<_>>()).prop_shuffle(),
                Just((0..(2 * n_dst as u64 + 1)).collect::<Vec<_>>()).prop_shuffle(),
                Just((n_src, n_dst)),
            )
        })
        .prop_map(|((p, d, prefix, total), src, dst, (n_src, n_dst))| Range {
            p,
            d,
            prefix,
            total,
            src: src[..n_src].to_vec(),
            dst: dst[..n_dst].to_vec(),
        })
}

impl Range {
    /// The plan of the chunk made of source pages `[o, o + c)` (the last chunk may be partial).
    fn chunk(&self, o: usize, c: usize, r: u64) -> DcpPlanInput<'_> {
        let end = (o + c).min(self.src.len());
        let n = (end as u64 * self.p).min(self.total) - o as u64 * self.p;
        DcpPlanInput {
            src_pages: &self.src[o..end],
            dst_pages: SendPages::after_prefix(&self.dst),
            page_size: self.p,
            dcp_size: self.d,
            dcp_rank: r,
            chunk_start: o as u64 * self.p,
            decode_prefix_len: self.prefix,
            num_kv_tokens: Some(n),
        }
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn target_rows_of_all_ranks_partition_the_chunk(range in send_range(), o in 0usize..40, c in 1usize..40) {
        let o = o % range.src.len();
        let mut seen = Vec::new();
        let mut draft = None;
        for r in 0..range.d {
            let plan = range.chunk(o, c, r).plan().unwrap().to_token_plan();
            // Each rank's destination rows are distinct.
            let dsts: HashSet<u64> = plan.target_dst.iter().copied().collect();
            prop_assert_eq!(dsts.len(), plan.target_dst.len());
            seen.extend(plan.target_src.iter().copied());
            if let Some(d) = &draft {
                prop_assert_eq!(d, &plan.draft_src);
            }
            draft = Some(plan.draft_src);
        }
        let mut chunk_rows = draft.unwrap();
        prop_assert_eq!(seen.len(), chunk_rows.len());
        seen.sort_unstable();
        chunk_rows.sort_unstable();
        prop_assert_eq!(seen, chunk_rows);
    }

    #[test]
    fn runs_expand_back_to_the_per_token_plan(range in send_range(), o in 0usize..40, c in 1usize..40, r in 0u64..6) {
        let o = o % range.src.len();
        let r = r % range.d;
        let plan = range.chunk(o, c, r).plan().unwrap();
        let tokens = plan.to_token_plan();
        let target: Vec<Run> = plan.target_runs().collect();
        let draft: Vec<Run> = plan.draft_runs().collect();
        prop_assert_eq!(&target, &group_concurrent_contiguous(&tokens.target_src, &tokens.target_dst).unwrap());
        prop_assert_eq!(&draft, &group_concurrent_contiguous(&tokens.draft_src, &tokens.draft_dst).unwrap());
        let expanded: Vec<(u64, u64)> = target.iter().flat_map(|r| r.pairs()).collect();
        let pairs: Vec<(u64, u64)> = tokens.target_src.iter().copied().zip(tokens.target_dst.iter().copied()).collect();
        prop_assert_eq!(&expanded, &pairs);
        prop_assert_eq!(plan.target_pairs().collect::<Vec<_>>(), pairs);
        prop_assert_eq!(plan.target_len(), tokens.target_src.len() as u64);
        prop_assert_eq!(plan.target_runs_vec(), target);
    }

    #[test]
    fn chunking_is_invariant(range in send_range(), cut in 1usize..10, r in 0u64..6) {
        let r = r % range.d;
        let whole = range.chunk(0, range.src.len(), r).plan().unwrap().to_token_plan();
        let mut joined = kvbridge_geometry::DcpTokenPlan::default();
        let mut o = 0;
        while o < range.src.len() {
            let part = range.chunk(o, cut, r).plan().unwrap().to_token_plan();
            joined.target_src.extend(part.target_src);
            joined.target_dst.extend(part.target_dst);
            joined.draft_src.extend(part.draft_src);
            joined.draft_dst.extend(part.draft_dst);
            o += cut;
        }
        prop_assert_eq!(joined, whole);
    }

    #[test]
    fn dcp_one_is_a_plain_token_copy(range in send_range()) {
        let range = Range { d: 1, dst: range.src.iter().map(|&p| p + 1000).collect(), ..range };
        let plan = range.chunk(0, range.src.len(), 0).plan().unwrap().to_token_plan();
        prop_assert_eq!(&plan.target_src, &plan.draft_src);
        prop_assert_eq!(&plan.target_dst, &plan.draft_dst);
    }

    #[test]
    fn no_byte_range_leaves_its_entry(range in send_range(), o in 0usize..40, c in 1usize..40, r in 0u64..6, toks in proptest::collection::vec(1u64..64, 1..4)) {
        let o = o % range.src.len();
        let r = r % range.d;
        let plan = range.chunk(o, c, r).plan().unwrap();
        let (p, d) = (range.p, range.d);
        let items: Vec<u64> = toks.iter().map(|t| t * p).collect();
        let src = PoolGeometry::builder(p)
            .num_pages(range.src.iter().max().unwrap() + 1)
            .target_entries(&items)
            .draft_entries(&[toks[0] * p])
            .build()
            .unwrap();
        let dst = PoolGeometry::builder(p)
            .num_pages(range.dst.iter().max().unwrap() + 1)
            .target_entries(&items)
            .draft_entries(&[toks[0] * p * d])
            .build()
            .unwrap();
        let ranges = plan.byte_ranges(&src, &dst, &identity_pairs(items.len() + 1)).unwrap();
        let mut bytes = 0;
        for br in ranges.iter().flat_map(ByteRange::rows) {
            prop_assert!(br.len > 0);
            prop_assert!(br.src_offset + br.len <= src.entry_bytes(br.src_entry).unwrap());
            prop_assert!(br.dst_offset + br.len <= dst.entry_bytes(br.dst_entry).unwrap());
            bytes += br.len;
        }
        let target_row_bytes: u64 = toks.iter().sum();
        prop_assert_eq!(bytes, plan.target_len() * target_row_bytes + plan.draft_len() * toks[0]);
    }

    #[test]
    fn coalescing_is_lossless_and_maximal(pairs in proptest::collection::vec((0u64..20, 0u64..20), 0..60)) {
        let (src, dst): (Vec<u64>, Vec<u64>) = pairs.iter().copied().unzip();
        let runs = group_concurrent_contiguous(&src, &dst).unwrap();
        let expanded: Vec<(u64, u64)> = runs.iter().flat_map(|r| r.pairs()).collect();
        prop_assert_eq!(&expanded, &pairs);
        for w in runs.windows(2) {
            prop_assert!(!w[0].continues_with(&w[1]));
        }
        prop_assert_eq!(coalesce_pairs(pairs.iter().copied()).collect::<Vec<_>>(), runs);
    }
}
