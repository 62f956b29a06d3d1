//! Entry pairing between peers, including pipeline-parallel (PP) entry slicing (docs/planning.md, "Entry
//! pairing").

use std::collections::{HashMap, VecDeque};

use crate::bytes::EntryPair;
use crate::error::{GeometryError, Result};
use crate::limits;

/// `build_transfer_entry_pairs`: pairs entries by published layer ids.
///
/// * `n_src == 0` → no pairs;
/// * ids on one side only → error, unless `positional_fallback` (then both are ignored);
/// * with ids: lengths must equal the entry counts, and the k-th occurrence of a layer id on
///   the source pairs with its k-th occurrence on the destination (ids repeat across K/V);
/// * without ids: `n_dst < n_src`, or `n_src ≠ n_dst` without fallback, is refused; else
///   `i ↔ i`.
///
/// An empty id list counts as "not published".
///
/// # Errors
/// [`GeometryError::LayerMetadataOneSided`], [`GeometryError::LayerMetadataLength`],
/// [`GeometryError::MissingLayer`], [`GeometryError::PpNeedsLayerIds`] (SGLang's texts);
/// [`GeometryError::TooLarge`] for an entry count above [`crate::MAX_ENTRIES`].
pub fn pair_entries_by_layer_ids(
    src_layer_ids: &[u64],
    dst_layer_ids: &[u64],
    n_src: usize,
    n_dst: usize,
    positional_fallback: bool,
) -> Result<Vec<EntryPair>> {
    //= sglang 0.5.23 sglang/srt/disaggregation/utils.py build_transfer_entry_pairs test: layer_id_pairing_and_its_errors
    //# if n_src == 0:
    //# return []
    if n_src == 0 {
        return Ok(Vec::new());
    }
    check_counts(n_src, n_dst, 0)?;
    let (mut src_ids, mut dst_ids) = (src_layer_ids, dst_layer_ids);
    //= sglang 0.5.23 sglang/srt/disaggregation/utils.py build_transfer_entry_pairs test: layer_id_pairing_and_its_errors
    //# if bool(src_layer_ids) != bool(dst_layer_ids):
    //# if not allow_positional_fallback:
    if src_ids.is_empty() != dst_ids.is_empty() {
        if !positional_fallback {
            return Err(GeometryError::LayerMetadataOneSided);
        }
        src_ids = &[];
        dst_ids = &[];
    }
    if !src_ids.is_empty() {
        //= sglang 0.5.23 sglang/srt/disaggregation/utils.py build_transfer_entry_pairs test: layer_id_pairing_and_its_errors
        //# if len(src_layer_ids) != n_src or len(dst_layer_ids) != n_dst:
        if src_ids.len() != n_src || dst_ids.len() != n_dst {
            return Err(GeometryError::LayerMetadataLength {
                src_ids: src_ids.len(),
                n_src,
                dst_ids: dst_ids.len(),
                n_dst,
            });
        }
        //= sglang 0.5.23 sglang/srt/disaggregation/utils.py build_transfer_entry_pairs test: layer_id_pairing_and_its_errors
        //# dst_pos.setdefault(lid, deque()).append(j)
        let mut positions: HashMap<u64, VecDeque<usize>> = HashMap::new();
        for (j, &lid) in dst_ids.iter().enumerate() {
            positions.entry(lid).or_default().push_back(j);
        }
        return src_ids
            .iter()
            .enumerate()
            .map(|(i, &lid)| {
                positions
                    .get_mut(&lid)
                    .and_then(VecDeque::pop_front)
                    .map(|j| EntryPair::new(i, j))
                    .ok_or(GeometryError::MissingLayer { layer_id: lid })
            })
            .collect();
    }
    //= sglang 0.5.23 sglang/srt/disaggregation/utils.py build_transfer_entry_pairs test: pp_entry_pairing_examples
    //# if n_dst < n_src or (n_src != n_dst and not allow_positional_fallback):
    if n_dst < n_src || (n_src != n_dst && !positional_fallback) {
        return Err(GeometryError::PpNeedsLayerIds { n_src, n_dst });
    }
    Ok(crate::bytes::identity_pairs(n_src))
}

/// Entry counts and the start layer are bounded before pairs are allocated or indices added.
fn check_counts(n_src: usize, n_dst: usize, start_layer: usize) -> Result<()> {
    limits::entries("n_src", n_src)?;
    limits::entries("n_dst", n_dst)?;
    limits::entries("start_layer", start_layer)
}

fn slice_out_of_range(what: &str, need: usize, n_dst: usize) -> GeometryError {
    GeometryError::InvalidGeometry {
        reason: format!(
            "PP entry slicing needs decode entries up to index {need} for the {what}, but the \
             decode registered {n_dst}; check prefill_start_layer and that the decode holds \
             every layer of this stage"
        ),
    }
}

/// PP slicing without layer ids for MLA / hybrid-MLA ("flat") pools: the prefill stage owns
/// global layers `[start_layer, start_layer + n_src − num_draft)`, followed by `num_draft`
/// draft entries; the decode may hold the whole model.
///
/// * `n_src == n_dst` → identity;
/// * else source entry `i < n_src − num_draft` pairs with decode `start_layer + i`, and the
///   draft entries pair with the decode's last `num_draft` entries.
///
/// # Errors
/// [`GeometryError::InvalidGeometry`] when the slice would run past the decode's entries
/// (SGLang's list slicing would silently shorten it) or `num_draft > n_src`;
/// [`GeometryError::TooLarge`] for a count or start layer above [`crate::MAX_ENTRIES`].
pub fn pair_entries_flat_pp(
    n_src: usize,
    n_dst: usize,
    start_layer: usize,
    num_draft: usize,
) -> Result<Vec<EntryPair>> {
    check_counts(n_src, n_dst, start_layer)?;
    if n_src == n_dst {
        return Ok(crate::bytes::identity_pairs(n_src));
    }
    if num_draft > n_src || num_draft > n_dst {
        return Err(GeometryError::InvalidGeometry {
            reason: format!(
                "num_draft={num_draft} exceeds the entry count (src={n_src}, dst={n_dst}); \
                 draft entries are counted inside each side's entry list"
            ),
        });
    }
    let n_target = n_src - num_draft;
    let end = start_layer + n_target;
    if end > n_dst - num_draft {
        return Err(slice_out_of_range("target layers", end, n_dst - num_draft));
    }
    let target = (0..n_target).map(|i| EntryPair::new(i, start_layer + i));
    let draft = (0..num_draft).map(|k| EntryPair::new(n_target + k, n_dst - num_draft + k));
    Ok(target.chain(draft).collect())
}

/// PP slicing without layer ids for MHA pools, whose entries are `[K_0.., V_0..]`: `n =
/// n_src / 2` layers in this stage, `ld = n_dst / 2` on the decode.
///
/// * `n == ld` → K with K, V with V, positionally;
/// * `n < ld` and `ld mod n ≠ 0` (decode has draft layers the prefill lacks):
///   `m = ld div n`, decode K = `[start, start + n)`, V = `[n·m + start, n·m + start + n)`;
/// * otherwise (PP): K = `[start, start + n)`, V = `[ld + start, ld + start + n)`.
///
/// Returns the K pairs followed by the V pairs.
///
/// # Errors
/// [`GeometryError::InvalidGeometry`] for odd entry counts or slices past the decode entries;
/// [`GeometryError::TooLarge`] for a count or start layer above [`crate::MAX_ENTRIES`].
pub fn pair_entries_mha_pp(
    n_src: usize,
    n_dst: usize,
    start_layer: usize,
) -> Result<Vec<EntryPair>> {
    check_counts(n_src, n_dst, start_layer)?;
    if n_src % 2 != 0 || n_dst % 2 != 0 {
        return Err(GeometryError::InvalidGeometry {
            reason: format!(
                "MHA pools register K and V per layer, so entry counts must be even, got \
                 src={n_src} dst={n_dst}"
            ),
        });
    }
    let (n, ld) = (n_src / 2, n_dst / 2);
    if n == 0 {
        return Ok(Vec::new());
    }
    let (k0, v0) = if n == ld {
        (0, ld)
    } else if n < ld && ld % n != 0 {
        (start_layer, n * (ld / n) + start_layer)
    } else {
        (start_layer, ld + start_layer)
    };
    if k0 + n > n_dst || v0 + n > n_dst {
        return Err(slice_out_of_range(
            "K/V layers",
            (k0 + n).max(v0 + n),
            n_dst,
        ));
    }
    let k = (0..n).map(|i| EntryPair::new(i, k0 + i));
    let v = (0..n).map(|i| EntryPair::new(n + i, v0 + i));
    Ok(k.chain(v).collect())
}
