//! DCP geometry check and pack-buffer sizing (docs/planning.md, "DCP geometry check" and
//! "Pack buffers").

use crate::error::{GeometryError, Result};

/// `prepare_dcp_token_item_lens`: checks that the decode registered one entry per prefill
/// entry with the same bytes per token, and returns the prefill token widths
/// (`src_item_len div page_size`) used as row widths on the DCP path.
///
/// `dst_item_lens[i] = None` means "unknown" (skipped). Draft entries (the last `num_draft`)
/// hold `page_size · dcp_size` rows per decode page, target entries `page_size`.
///
/// # Errors
/// [`GeometryError::ZeroPageSize`], [`GeometryError::ZeroDcpSize`],
/// [`GeometryError::DcpEntryCount`] and [`GeometryError::DcpGeometryDiffers`] (SGLang's texts).
pub fn prepare_dcp_token_item_lens(
    src_item_lens: &[u64],
    num_draft: usize,
    page_size: u64,
    dst_item_lens: &[Option<u64>],
    dcp_size: u64,
) -> Result<Vec<u64>> {
    if page_size == 0 {
        return Err(GeometryError::ZeroPageSize { page_size });
    }
    if dcp_size == 0 {
        return Err(GeometryError::ZeroDcpSize { dcp_size });
    }
    let n = src_item_lens.len();
    //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.prepare_dcp_token_item_lens test: e015_dcp_entry_count
    //# if len(dst_page_item_lens) != num_entries:
    if dst_item_lens.len() != n || num_draft > n {
        return Err(GeometryError::DcpEntryCount {
            n_src: n,
            n_draft: num_draft,
            n_dst: dst_item_lens.len(),
        });
    }
    //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.prepare_dcp_token_item_lens test: dcp_geometry_check_examples
    //# item_len // page_size for item_len in self.kv_args.kv_item_lens
    let src_tok: Vec<u64> = src_item_lens.iter().map(|l| l / page_size).collect();
    for (i, dst) in dst_item_lens.iter().enumerate() {
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.prepare_dcp_token_item_lens test: dcp_geometry_check_examples
        //# if dst_item_len is None:
        //# continue
        let Some(dst_item_len) = *dst else { continue };
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.prepare_dcp_token_item_lens test: e016_dcp_geometry_sglang_example
        //# dst_page_scale = page_size * (
        //# dst_dcp_size if i >= num_entries - num_draft else 1
        let scale = if i >= n - num_draft {
            page_size.saturating_mul(dcp_size)
        } else {
            page_size
        };
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.prepare_dcp_token_item_lens test: e016_dcp_geometry_sglang_example, dcp_geometry_check_examples
        //# if dst_item_len // dst_page_scale != src_token_lens[i]:
        if dst_item_len / scale != src_tok[i] {
            return Err(GeometryError::DcpGeometryDiffers {
                entry: i,
                src_token_bytes: src_tok[i],
                dst_token_bytes: dst_item_len / scale,
                dst_item_len,
                page_scale: scale,
            });
        }
    }
    Ok(src_tok)
}

/// [`prepare_dcp_token_item_lens`] for two pool geometries (every decode length known).
///
/// # Errors
/// As [`prepare_dcp_token_item_lens`].
pub fn dcp_token_item_lens(
    src: &crate::PoolGeometry,
    dst: &crate::PoolGeometry,
    dcp_size: u64,
) -> Result<Vec<u64>> {
    let dst_lens: Vec<Option<u64>> = dst.entries().iter().map(|e| Some(e.item_len)).collect();
    prepare_dcp_token_item_lens(
        &src.item_lens(),
        src.num_draft(),
        src.page_size(),
        &dst_lens,
        dcp_size,
    )
}

/// `dcp_pack_buffer_bytes`: bytes of a pack buffer holding up to `max_tokens` tokens of every
/// entry, `d · ceil(max_tokens / d) · Σ (item_len div P)`; an empty list gives 0.
///
/// ```
/// use kvbridge_geometry::dcp_pack_buffer_bytes;
/// assert_eq!(dcp_pack_buffer_bytes(&[1024, 1024], 64, 10, 4).unwrap(), 384);
/// ```
///
/// # Errors
/// SGLang's texts: `page_size must be positive, got {P}`, `dcp_size must be positive, got {d}`,
/// `PD DCP pack requires each kv_item_len to span at least one page, …`,
/// `PD DCP pack requires page-aligned kv_item_lens, …`; [`GeometryError::Overflow`].
pub fn dcp_pack_buffer_bytes(
    item_lens: &[u64],
    page_size: u64,
    max_tokens: u64,
    dcp_size: u64,
) -> Result<u64> {
    //= sglang 0.5.23 sglang/srt/disaggregation/common/dcp_pack.py dcp_pack_buffer_bytes test: pack_buffer_sizing_examples
    //# if page_size <= 0:
    //# raise ValueError(f"page_size must be positive, got {page_size}")
    if page_size == 0 {
        return Err(GeometryError::ZeroPageSize { page_size });
    }
    //= sglang 0.5.23 sglang/srt/disaggregation/common/dcp_pack.py dcp_pack_buffer_bytes test: pack_buffer_sizing_examples
    //# if dcp_size <= 0:
    //# raise ValueError(f"dcp_size must be positive, got {dcp_size}")
    if dcp_size == 0 {
        return Err(GeometryError::ZeroDcpSize { dcp_size });
    }
    //= sglang 0.5.23 sglang/srt/disaggregation/common/dcp_pack.py dcp_pack_buffer_bytes test: pack_buffer_sizing_examples
    //# if any(item_len < page_size for item_len in kv_item_lens):
    if item_lens.iter().any(|&l| l < page_size) {
        return Err(GeometryError::PackItemLenTooSmall {
            item_lens: item_lens.to_vec(),
            page_size,
        });
    }
    //= sglang 0.5.23 sglang/srt/disaggregation/common/dcp_pack.py dcp_pack_buffer_bytes test: pack_buffer_sizing_examples
    //# if any(item_len % page_size != 0 for item_len in kv_item_lens):
    if item_lens.iter().any(|&l| l % page_size != 0) {
        return Err(GeometryError::PackItemLenUnaligned {
            item_lens: item_lens.to_vec(),
            page_size,
        });
    }
    let overflow = GeometryError::Overflow {
        what: "pack buffer size",
    };
    let per_token = item_lens
        .iter()
        .try_fold(0u64, |acc, l| acc.checked_add(l / page_size))
        .ok_or(overflow.clone())?;
    max_tokens
        //= sglang 0.5.23 sglang/srt/disaggregation/common/dcp_pack.py dcp_pack_buffer_bytes test: pack_buffer_sizing_examples
        //# rank_tokens = (max_tokens + dcp_size - 1) // dcp_size
        //# return dcp_size * rank_tokens * sum(token_item_lens)
        .div_ceil(dcp_size)
        .checked_mul(dcp_size)
        .and_then(|t| t.checked_mul(per_token))
        .ok_or(overflow)
}
