//! Fuzzing plan inputs: the 90 inputs of `tests/data/dcp_plan_vectors.json` are the seed
//! corpus; each case takes one, sets some fields (and page ids) to extremes, and plans it as a
//! DCP token plan and as a resharding plan with mutated DCP sizes and ranks. Never a panic, an
//! abort or a hang: an error with a message, or a plan whose rows are all addressable. Work per
//! case is bounded by construction (every size above its maximum is refused before work;
//! per-token arrays are only built for plans of at most `ROWS` rows).

use kvbridge_geometry::{DcpPlanInput, MAX_CHUNK_TOKENS, ReshardInput, SendPages};
use proptest::prelude::*;
use serde_json::Value;

const VECTORS: &str = include_str!("data/dcp_plan_vectors.json");

/// Plans of up to this many rows are also materialised as arrays and runs.
const ROWS: u64 = 1 << 12;

/// The case count: `default`, or `PROPTEST_CASES` for a longer run.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Debug, Clone)]
struct Seed {
    src: Vec<u64>,
    dst: Vec<u64>,
    p: u64,
    d: u64,
    r: u64,
    o: u64,
    l: u64,
    n: Option<u64>,
}

fn seeds() -> Vec<Seed> {
    let doc: Value = serde_json::from_str(VECTORS).expect("vector file parses");
    let u = |v: &Value| v.as_u64().expect("u64");
    let list = |v: &Value| -> Vec<u64> { v.as_array().expect("array").iter().map(u).collect() };
    doc["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let i = &c["inputs"];
            Seed {
                src: list(&i["src_page_indices"]),
                dst: list(&i["dst_page_indices"]),
                p: u(&i["physical_page_size"]),
                d: u(&i["dcp_size"]),
                r: u(&i["dcp_rank"]),
                o: u(&i["src_page_offset"]),
                l: u(&i["decode_prefix_len"]),
                n: i["num_kv_tokens"].as_u64(),
            }
        })
        .collect()
}

/// Integer extremes, the maxima and their neighbours.
fn extreme(i: usize) -> u64 {
    const E: [u64; 12] = [
        0,
        1,
        2,
        1 << 20,
        (1 << 20) + 1,
        1024,
        1025,
        1 << 31,
        1 << 32,
        1 << 62,
        u64::MAX - 1,
        u64::MAX,
    ];
    E[i % E.len()]
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Field `f` (0 = page size, 1 = DCP size, 2 = rank, 3 = page offset, 4 = prefix,
    /// 5 = tokens) to `extreme(v)`.
    Field(usize, usize),
    /// Source (`true`) or destination page `i` to `extreme(v)`.
    Page(bool, usize, usize),
    /// Keep the first `k` source (`true`) or destination pages.
    Truncate(bool, usize),
    /// Repeat the page list (up to 4096 ids): long lists are data, planned linearly.
    Grow(bool),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (0..6usize, 0..12usize).prop_map(|(f, v)| Mutation::Field(f, v)),
        2 => (any::<bool>(), any::<usize>(), 0..12usize).prop_map(|(s, i, v)| Mutation::Page(s, i, v)),
        1 => (any::<bool>(), 0..8usize).prop_map(|(s, k)| Mutation::Truncate(s, k)),
        1 => any::<bool>().prop_map(Mutation::Grow),
    ]
}

fn apply(s: &mut Seed, m: &Mutation) {
    match *m {
        Mutation::Field(f, v) => {
            let x = extreme(v);
            match f {
                0 => s.p = x,
                1 => s.d = x,
                2 => s.r = x,
                3 => s.o = x,
                4 => s.l = x,
                _ => s.n = Some(x),
            }
        }
        Mutation::Page(src, i, v) => {
            let pages = if src { &mut s.src } else { &mut s.dst };
            if !pages.is_empty() {
                let n = pages.len();
                pages[i % n] = extreme(v);
            }
        }
        Mutation::Truncate(src, k) => {
            let pages = if src { &mut s.src } else { &mut s.dst };
            pages.truncate(k);
        }
        Mutation::Grow(src) => {
            let pages = if src { &mut s.src } else { &mut s.dst };
            let copy = pages.clone();
            while !copy.is_empty() && pages.len() < 4096 {
                pages.extend_from_slice(&copy);
            }
        }
    }
}

fn assert_message(e: &kvbridge_geometry::GeometryError) {
    let text = e.to_string();
    assert!(text.len() > 20, "{text}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(512)))]

    #[test]
    fn mutated_plan_inputs_plan_or_fail_cleanly(
        seed in any::<usize>(),
        ms in prop::collection::vec(mutation(), 0..4),
        a in 0..20usize,
        ar in 0..20usize,
        p1 in 0..20usize,
    ) {
        let all = seeds();
        let mut s = all[seed % all.len()].clone();
        for m in &ms {
            apply(&mut s, m);
        }
        let input = DcpPlanInput {
            src_pages: &s.src,
            dst_pages: SendPages::after_prefix(&s.dst),
            page_size: s.p,
            dcp_size: s.d,
            dcp_rank: s.r,
            chunk_start: s.o.saturating_mul(s.p),
            decode_prefix_len: s.l,
            num_kv_tokens: s.n,
        };
        match input.plan() {
            Ok(plan) => {
                prop_assert!(plan.num_tokens() <= MAX_CHUNK_TOKENS);
                if plan.draft_len() <= ROWS {
                    let tokens = plan.to_token_plan();
                    prop_assert_eq!(tokens.target_src.len() as u64, plan.target_len());
                    prop_assert_eq!(tokens.draft_dst.len() as u64, plan.draft_len());
                    let rows: u64 = plan.target_runs().map(|r| r.len).sum();
                    prop_assert_eq!(rows, plan.target_len());
                }
            }
            Err(e) => assert_message(&e),
        }
        // The same pages as a resharding plan: small DCP sizes and ranks mostly (so some plans
        // succeed), extremes sometimes.
        let pick = |i: usize, small: u64| if i < 8 { small } else { extreme(i) };
        let src_dcp_size = pick(a, a as u64 % 4 + 1);
        let reshard = ReshardInput {
            src_pages: &s.src,
            dst_pages: SendPages::after_prefix(&s.dst),
            src_page_size: pick(p1, s.p),
            dst_page_size: s.p,
            src_dcp_size,
            src_dcp_rank: pick(ar, ar as u64 % src_dcp_size.max(1)),
            dst_dcp_size: s.d,
            dst_dcp_rank: s.r,
            decode_prefix_len: s.l,
            chunk_start: s.o.saturating_mul(s.p),
            num_tokens: s.n.unwrap_or(s.src.len() as u64 * s.p.min(1 << 20)),
        };
        match reshard.plan() {
            Ok(plan) => {
                if plan.len() <= ROWS {
                    let (src, dst) = plan.arrays();
                    prop_assert_eq!(src.len() as u64, plan.len());
                    prop_assert_eq!(dst.len() as u64, plan.len());
                    prop_assert_eq!(plan.positions().count() as u64, plan.len());
                }
            }
            Err(e) => assert_message(&e),
        }
    }
}
