//! Maxima on what a descriptor may claim.
//!
//! Descriptors arrive from peers. Every size and count in one is bounded before `check`
//! computes anything from it (rank lists, per-entry checks, the mapping), so a hostile or
//! corrupt value is reported as `KVB-E033` instead of an allocation of its size or a loop over
//! it. Each bound is far above any real deployment; `docs/errors.md` ("Descriptor format")
//! lists them.

use crate::descriptor::PeerDescriptor;
pub use kvbridge_geometry::{MAX_ENTRIES, MAX_GROUP_SIZE, MAX_KV_HEADS, MAX_PAGE_SIZE};

/// Largest deployment one descriptor may describe: `attn_tp_size · attn_cp_size · pp_size`
/// ranks. A decode rank's bootstrap list has at most this many prefill peers.
pub const MAX_DEPLOYMENT_RANKS: u64 = 1 << 16;

/// Largest `head_dim`.
pub const MAX_HEAD_DIM: u64 = 1 << 16;

/// Largest entry of `kv_item_lens` (bytes per page) or `aux_item_lens` (bytes per row).
pub const MAX_ITEM_LEN: u64 = 1 << 40;

/// Largest number of aux (metadata) buffers.
pub const MAX_AUX_BUFFERS: u64 = 64;

/// One field above its maximum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Excess {
    pub(crate) field: String,
    pub(crate) value: u64,
    pub(crate) max: u64,
}

fn len(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// The first entry of `lens` above [`MAX_ITEM_LEN`], as an excess of `field[i]`; only the first
/// is named, so a long hostile list yields one short report.
fn first_long_item(field: &str, lens: &[u64]) -> Option<Excess> {
    let (i, &value) = lens.iter().enumerate().find(|(_, l)| **l > MAX_ITEM_LEN)?;
    Some(Excess {
        field: format!("{field}[{i}]"),
        value,
        max: MAX_ITEM_LEN,
    })
}

/// Every field of `d` above its maximum, in descriptor order (work linear in the lists'
/// lengths, which the parser already read).
pub(crate) fn excesses(d: &PeerDescriptor) -> Vec<Excess> {
    let mut out = Vec::new();
    let mut at_most = |field: &str, value: u64, max: u64| {
        if value > max {
            out.push(Excess {
                field: field.to_owned(),
                value,
                max,
            });
        }
    };
    at_most("page_size", d.page_size, MAX_PAGE_SIZE);
    at_most("attn_tp_size", u64::from(d.attn_tp_size), MAX_GROUP_SIZE);
    at_most("attn_cp_size", u64::from(d.attn_cp_size), MAX_GROUP_SIZE);
    at_most("pp_size", u64::from(d.pp_size), MAX_GROUP_SIZE);
    at_most("dcp_size", u64::from(d.dcp_size), MAX_GROUP_SIZE);
    let sizes = [d.attn_tp_size, d.attn_cp_size, d.pp_size].map(u64::from);
    // Named only when each size is within its own maximum (which bounds the product).
    if sizes.iter().all(|&s| s <= MAX_GROUP_SIZE) {
        let ranks = sizes.iter().product();
        at_most(
            "attn_tp_size x attn_cp_size x pp_size",
            ranks,
            MAX_DEPLOYMENT_RANKS,
        );
    }
    at_most(
        "total_kv_heads",
        u64::from(d.total_kv_heads.unwrap_or(0)),
        MAX_KV_HEADS,
    );
    at_most("head_dim", u64::from(d.head_dim.unwrap_or(0)), MAX_HEAD_DIM);
    at_most("kv_item_lens.len", len(d.kv_item_lens.len()), MAX_ENTRIES);
    at_most(
        "aux_item_lens.len",
        len(d.aux_item_lens.len()),
        MAX_AUX_BUFFERS,
    );
    out.extend(first_long_item("kv_item_lens", &d.kv_item_lens));
    out.extend(first_long_item("aux_item_lens", &d.aux_item_lens));
    out
}

/// Whether every size of `d` the rank loops of `check_all_ranks` use is within its maximum.
pub(crate) fn sizes_within(d: &PeerDescriptor) -> bool {
    excesses(d).is_empty()
}
