//! Run coalescing: `group_concurrent_contiguous` semantics as `(src_start, dst_start, len)` runs.

use crate::error::{GeometryError, Result};

/// A run of `len` consecutive indices on both sides: `src_start + i → dst_start + i` for
/// `i in 0..len`. Indices are pages on the page path and token rows on the token paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Run {
    /// First source index.
    pub src_start: u64,
    /// First destination index.
    pub dst_start: u64,
    /// Number of indices (always ≥ 1 in runs produced by this crate).
    pub len: u64,
}

impl Run {
    /// A run.
    #[must_use]
    pub const fn new(src_start: u64, dst_start: u64, len: u64) -> Self {
        Self {
            src_start,
            dst_start,
            len,
        }
    }

    /// The `(src, dst)` index pairs of the run, in order.
    pub fn pairs(self) -> impl DoubleEndedIterator<Item = (u64, u64)> {
        (0..self.len).map(move |i| (self.src_start + i, self.dst_start + i))
    }

    /// Whether `next` continues this run on both sides (so the two can be one run).
    #[must_use]
    pub fn continues_with(&self, next: &Run) -> bool {
        self.src_start.checked_add(self.len) == Some(next.src_start)
            && self.dst_start.checked_add(self.len) == Some(next.dst_start)
    }
}

/// SGLang's `group_concurrent_contiguous`, returning runs instead of lists of lists.
///
/// * either side empty → no runs (no error, even if the other side is not empty);
/// * different lengths → [`GeometryError::UnequalIndexArrays`] (SGLang's text);
/// * otherwise a run is cut before every position `k ≥ 1` where `src[k] − src[k−1] ≠ 1` **or**
///   `dst[k] − dst[k−1] ≠ 1` (duplicates and descending steps always cut).
///
/// ```
/// use kvbridge_geometry::{group_concurrent_contiguous, Run};
/// let runs = group_concurrent_contiguous(&[1, 2, 3, 7, 8], &[10, 11, 13, 14, 15]).unwrap();
/// assert_eq!(runs, [Run::new(1, 10, 2), Run::new(3, 13, 1), Run::new(7, 14, 2)]);
/// ```
///
/// # Errors
/// [`GeometryError::UnequalIndexArrays`] when both sides are non-empty and lengths differ.
pub fn group_concurrent_contiguous(src: &[u64], dst: &[u64]) -> Result<Vec<Run>> {
    //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py group_concurrent_contiguous test: group_concurrent_contiguous_example_and_edges, test_group_odd_inputs_behave_as_in_sglang
    //# if src_indices.size == 0 or dst_indices.size == 0:
    //# return [], []
    if src.is_empty() || dst.is_empty() {
        return Ok(Vec::new());
    }
    //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py group_concurrent_contiguous test: group_concurrent_contiguous_example_and_edges
    //# if src_indices.size != dst_indices.size:
    if src.len() != dst.len() {
        return Err(GeometryError::UnequalIndexArrays {
            len_src: src.len(),
            len_dst: dst.len(),
        });
    }
    //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py group_concurrent_contiguous test: test_group_matches_sglang_on_random_inputs, coalescing_is_lossless_and_maximal
    //# brk = np.where((np.diff(src_indices) != 1) | (np.diff(dst_indices) != 1))[0] + 1
    Ok(coalesce_pairs(src.iter().copied().zip(dst.iter().copied())).collect())
}

/// Single-index runs of `(src, dst)` pairs, the input [`coalesce_pairs`] coalesces.
pub type PairRuns<I> = std::iter::Map<I, fn((u64, u64)) -> Run>;

/// Coalesces `(src, dst)` index pairs into runs lazily; allocates nothing.
pub fn coalesce_pairs<I>(pairs: I) -> Coalesce<PairRuns<I::IntoIter>>
where
    I: IntoIterator<Item = (u64, u64)>,
{
    fn one((s, d): (u64, u64)) -> Run {
        Run::new(s, d, 1)
    }
    coalesce_runs(pairs.into_iter().map(one as fn((u64, u64)) -> Run))
}

/// Merges consecutive runs that continue each other ([`Run::continues_with`]); zero-length
/// runs are dropped. Lazy, allocates nothing.
pub fn coalesce_runs<I>(runs: I) -> Coalesce<I::IntoIter>
where
    I: IntoIterator<Item = Run>,
{
    Coalesce {
        inner: runs.into_iter(),
        pending: None,
    }
}

/// Iterator returned by [`coalesce_runs`] and [`coalesce_pairs`].
#[derive(Debug, Clone)]
pub struct Coalesce<I> {
    inner: I,
    pending: Option<Run>,
}

impl<I: Iterator<Item = Run>> Iterator for Coalesce<I> {
    type Item = Run;

    #[inline]
    fn next(&mut self) -> Option<Run> {
        for run in self.inner.by_ref() {
            if run.len == 0 {
                continue;
            }
            match &mut self.pending {
                Some(cur) if cur.continues_with(&run) => cur.len += run.len,
                Some(cur) => return Some(std::mem::replace(cur, run)),
                None => self.pending = Some(run),
            }
        }
        self.pending.take()
    }
}
