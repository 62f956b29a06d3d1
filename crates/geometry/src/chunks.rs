//! Chunks of a prefill's send: how a scheduler splits a request's KV into the pieces it sends
//! as they are computed (chunked prefill), each a run of whole pages but the last.

use std::ops::Range;

/// Splits the send range `[start, end)` into chunks the way a prefill scheduler does: at most
/// `max_pages` pages of `page_tokens` tokens each, every chunk but the last ending on a page
/// boundary (the first may start mid-page). Returns `(page indices into the request's page
/// table, num_kv_tokens)` per chunk; an empty range gives one empty (last) chunk. A
/// `page_tokens` or `max_pages` of 0 counts as 1. Under decode DCP, `page_tokens` is the
/// virtual page ([`virtual_page_size`](crate::virtual_page_size)). Its input is the prefill's
/// own request, not a peer's: it returns one entry per chunk.
///
/// ```
/// use kvbridge_geometry::chunk_plan;
/// // Tokens 20..70 in pages of 16, two pages per chunk: pages 1-2 (tokens 20..48), 3-4 (48..70).
/// assert_eq!(chunk_plan(20, 70, 16, 2), vec![(1..3, 28), (3..5, 22)]);
/// ```
pub fn chunk_plan(
    start: u64,
    end: u64,
    page_tokens: u64,
    max_pages: u64,
) -> Vec<(Range<u64>, u64)> {
    let v = page_tokens.max(1);
    let first = start / v;
    if end <= start {
        return vec![(first..first, 0)];
    }
    let last = end.div_ceil(v);
    let mut out = Vec::new();
    let mut page = first;
    while page < last {
        let stop = page.saturating_add(max_pages.max(1)).min(last);
        let tokens = end.min(stop * v) - start.max(page * v);
        out.push((page..stop, tokens));
        page = stop;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_plan_floors_non_last_chunks() {
        assert_eq!(
            chunk_plan(0, 100, 16, 2),
            vec![(0..2, 32), (2..4, 32), (4..6, 32), (6..7, 4)]
        );
        assert_eq!(chunk_plan(64, 64, 16, 2), vec![(4..4, 0)]);
        assert_eq!(chunk_plan(0, 32, 16, 4), vec![(0..2, 32)]);
        assert_eq!(chunk_plan(48, 100, 64, 1), vec![(0..1, 16), (1..2, 36)]);
    }

    proptest::proptest! {
        #[test]
        fn chunks_cover_the_range_once_in_whole_pages_but_the_last(
            start in 0u64..5_000, len in 0u64..5_000, page in 1u64..130, max in 1u64..9,
        ) {
            let end = start + len;
            let plan = chunk_plan(start, end, page, max);
            if len == 0 {
                // Nothing to send: one empty last chunk at the start's page.
                proptest::prop_assert_eq!(plan, vec![(start / page..start / page, 0)]);
                return Ok(());
            }
            let mut at = start;
            for (i, (pages, tokens)) in plan.iter().enumerate() {
                proptest::prop_assert!(pages.end - pages.start <= max);
                let stop = end.min(pages.end * page);
                proptest::prop_assert_eq!(at.max(pages.start * page), at);
                proptest::prop_assert_eq!(*tokens, stop - at);
                if i + 1 < plan.len() {
                    proptest::prop_assert_eq!(stop % page, 0, "a chunk but the last ends mid-page");
                }
                at = stop;
            }
            proptest::prop_assert_eq!(at, end);
        }
    }
}
