//! Descriptor builders shared by the integration tests.
#![allow(dead_code, unreachable_pub)]

use kvbridge_handshake::PeerDescriptor;
use serde_json::{Value, json};

/// A descriptor from a JSON object, on top of `page_size 64` and `kv_cache_dtype "auto"`.
pub fn desc(v: Value) -> PeerDescriptor {
    let mut base = json!({"page_size": 64, "kv_cache_dtype": "auto"});
    for (k, val) in v.as_object().expect("object") {
        base[k] = val.clone();
    }
    serde_json::from_value(base).expect("valid descriptor")
}

/// An MLA rank (2 layers of 576·2 B per token, page 64) with TP `tp`, DCP `dcp`, TP rank `rank`.
pub fn mla(role: &str, tp: u32, dcp: u32, rank: u32) -> PeerDescriptor {
    desc(
        json!({"role": role, "kv_pool": "mla", "attn_tp_size": tp, "attn_tp_rank": rank,
        "dcp_size": dcp, "dcp_rank": rank % dcp, "kv_item_lens": [73728, 73728]}),
    )
}

/// A GQA rank: `heads` KV heads of dim 128, bf16, 2 layers (4 entries), page 64.
pub fn gqa(role: &str, tp: u32, heads: u32, rank: u32) -> PeerDescriptor {
    let hpr = (heads / tp).max(1);
    let item = 64 * u64::from(hpr) * 128 * 2;
    desc(
        json!({"role": role, "kv_pool": "mha", "attn_tp_size": tp, "attn_tp_rank": rank,
        "total_kv_heads": heads, "head_dim": 128, "kv_cache_dtype": "bfloat16",
        "kv_item_lens": [item, item, item, item]}),
    )
}

/// `d` with the JSON fields of `v` replaced.
pub fn with(d: &PeerDescriptor, v: Value) -> PeerDescriptor {
    let mut base = serde_json::to_value(d).expect("serialise");
    for (k, val) in v.as_object().expect("object") {
        base[k] = val.clone();
    }
    serde_json::from_value(base).expect("valid descriptor")
}
