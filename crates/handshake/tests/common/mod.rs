//! Descriptor builders shared by the integration tests.
#![allow(dead_code, unreachable_pub)]

use kvbridge_handshake::PeerDescriptor;
use serde_json::Value;

/// An MLA rank (2 layers of 576·2 B per token, page 64) with TP `tp`, DCP `dcp`, TP rank `rank`.
pub fn mla(role: &str, tp: u32, dcp: u32, rank: u32) -> PeerDescriptor {
    PeerDescriptor::mla(role.parse().expect("role"), 64, 2, 1152)
        .attn_tp(tp, rank)
        .dcp(dcp)
        .build()
        .expect("valid descriptor")
}

/// A GQA rank: `heads` KV heads of dim 128, bf16, 2 layers (4 entries), page 64.
pub fn gqa(role: &str, tp: u32, heads: u32, rank: u32) -> PeerDescriptor {
    PeerDescriptor::mha(role.parse().expect("role"), 64, 2, heads, 128)
        .kv_cache_dtype("bfloat16")
        .attn_tp(tp, rank)
        .build()
        .expect("valid descriptor")
}

/// `d` with the JSON fields of `v` replaced.
pub fn with(d: &PeerDescriptor, v: Value) -> PeerDescriptor {
    let mut base = serde_json::to_value(d).expect("serialise");
    for (k, val) in v.as_object().expect("object") {
        base[k] = val.clone();
    }
    serde_json::from_value(base).expect("valid descriptor")
}
