//! Helpers shared by the geometry's integration tests.

#![allow(dead_code, unreachable_pub, missing_docs)]

use kvbridge_geometry::{ReshardInput, SendPages};
use proptest::prelude::*;

/// `n` distinct page ids out of `0..2n+1` in a deterministic shuffle (xorshift from `state`,
/// which advances, so successive calls give different tables).
pub fn shuffled(state: &mut u64, n: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..2 * n + 1).collect();
    for i in (1..v.len()).rev() {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        v.swap(i, (*state % (i as u64 + 1)) as usize);
    }
    v.truncate(n as usize);
    v
}

/// A whole request on both sides: DCP sizes, page sizes, prefix, tokens to send, chunk cuts,
/// one page table per prefill rank (covering rank-local rows from 0) and the decode's
/// virtual page list of the send range.
#[derive(Debug, Clone)]
pub struct World {
    pub a: u64,
    pub b: u64,
    pub p1: u64,
    pub p2: u64,
    pub prefix: u64,
    pub total: u64,
    pub cuts: Vec<u64>,
    pub prefill_tables: Vec<Vec<u64>>,
    pub dst: Vec<u64>,
}

pub fn world() -> impl Strategy<Value = World> {
    (
        1u64..=6,
        1u64..=6,
        1u64..=8,
        1u64..=8,
        0u64..=2,
        1u64..=120,
        1u64..=4,
        any::<u64>(),
    )
        .prop_map(|(a, b, p1, p2, prefix_pages, total, chunks, seed)| {
            let prefix = prefix_pages * p2 * b;
            let end = prefix + total;
            // Deterministic shuffles from the seed (distinct ids per table).
            let mut state = seed | 1;
            let mut shuffled = |n: u64| shuffled(&mut state, n);
            let local_rows = end.div_ceil(a);
            let prefill_tables = (0..a).map(|_| shuffled(local_rows.div_ceil(p1))).collect();
            let dst = shuffled(total.div_ceil(p2 * b));
            let mut cuts: Vec<u64> = (1..chunks).map(|k| k * total / chunks).collect();
            cuts.dedup();
            cuts.retain(|&c| c > 0 && c < total);
            World {
                a,
                b,
                p1,
                p2,
                prefix,
                total,
                cuts,
                prefill_tables,
                dst,
            }
        })
}

impl World {
    pub fn chunks(&self) -> Vec<(u64, u64)> {
        let mut bounds = vec![0];
        bounds.extend(&self.cuts);
        bounds.push(self.total);
        bounds.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
    }

    pub fn src_row(&self, ar: u64, p: u64) -> u64 {
        let y = p / self.a;
        self.prefill_tables[ar as usize][(y / self.p1) as usize] * self.p1 + y % self.p1
    }

    pub fn dst_row(&self, p: u64) -> u64 {
        let x = (p - self.prefix) / self.b;
        self.dst[(x / self.p2) as usize] * self.p2 + x % self.p2
    }

    pub fn input(&self, ar: u64, br: u64, c0: u64, n: u64) -> ReshardInput<'_> {
        let first_page = ((self.prefix + c0) / self.a / self.p1) as usize;
        ReshardInput {
            src_pages: &self.prefill_tables[ar as usize][first_page..],
            dst_pages: SendPages::after_prefix(&self.dst),
            src_page_size: self.p1,
            dst_page_size: self.p2,
            src_dcp_size: self.a,
            src_dcp_rank: ar,
            dst_dcp_size: self.b,
            dst_dcp_rank: br,
            decode_prefix_len: self.prefix,
            chunk_start: c0,
            num_tokens: n,
        }
    }
}
