//! The one seeded generator of the workspace's tests, benches and fuzz drivers.
//!
//! Hand-written (SplitMix64) rather than taken from `rand`: no dependency, and a fixed, documented algorithm keeps every seeded run (suite batches, bench
//! layouts, fuzz mutations) the same across releases of any third-party crate. Predictable by
//! design: never for secrets, nonces or session ids.

/// SplitMix64 (Steele, Lea and Flood): a 64-bit state advanced by the golden-ratio increment,
/// each output passed through [`mix64`]. The same seed gives the same sequence on every run.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

/// The increment of [`SplitMix64`]'s state: 2^64 / φ, odd.
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijective mix of the 64 bits of `z`, good as a hash of
/// small inputs (offsets, ids) into well-spread words.
#[must_use]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SplitMix64 {
    /// A generator whose sequence is fixed by `seed`.
    #[must_use]
    pub const fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        mix64(self.0)
    }

    /// Uniform-ish in `0..n` (modulo bias is negligible for the small `n` of tests).
    ///
    /// # Panics
    /// If `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "SplitMix64::below(0): the range 0..0 is empty");
        self.next_u64() % n
    }

    /// [`below`](Self::below) for lengths and indices.
    ///
    /// # Panics
    /// If `n` is 0.
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// Fills `buf` with random bytes (8 per step, little endian).
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    /// `len` random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.fill(&mut v);
        v
    }

    /// Shuffles `v` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.index(i + 1);
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_is_fixed_by_the_seed() {
        let mut a = SplitMix64::new(1);
        let mut b = SplitMix64::new(1);
        assert_eq!(a.bytes(13), b.bytes(13));
        assert_ne!(SplitMix64::new(1).next_u64(), SplitMix64::new(2).next_u64());
        // The published first output of SplitMix64 seeded with 0.
        assert_eq!(SplitMix64::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut v: Vec<u32> = (0..100).collect();
        SplitMix64::new(7).shuffle(&mut v);
        assert_ne!(v, (0..100).collect::<Vec<_>>());
        v.sort_unstable();
        assert_eq!(v, (0..100).collect::<Vec<_>>());
    }
}
