//! SplitMix64: a tiny seeded generator, so a schedule is a function of its seed alone.

use std::time::Duration;

#[derive(Debug, Clone)]
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`0` when `n` is 0).
    pub(super) fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// Uniform in `lo..=hi`.
    pub(super) fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }

    /// Uniform in `[0, 1)`.
    pub(super) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(super) fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.unit() < p
    }

    /// A duration uniform in `lo_ms..=hi_ms` milliseconds, at microsecond resolution.
    pub(super) fn millis(&mut self, lo_ms: u64, hi_ms: u64) -> Duration {
        Duration::from_micros(self.between(lo_ms * 1000, hi_ms * 1000))
    }

    /// A probability: 0 with chance `off`, otherwise uniform in `[0, max)`.
    pub(super) fn probability(&mut self, off: f64, max: f64) -> f64 {
        if self.chance(off) {
            0.0
        } else {
            self.unit() * max
        }
    }

    pub(super) fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}
