//! Compatibility fingerprint: a stable hash over the fields `check` compares, for a cheap
//! "nothing changed" fast path. A mismatch is explained field by field ([`fingerprint_diff`]).

use std::fmt;

use kvbridge_geometry::PoolKind;
use serde::{Serialize, Serializer};

use crate::descriptor::PeerDescriptor;

/// FNV-1a 64 over the canonical encoding of a descriptor's compatibility-relevant fields.
///
/// Stable across builds and platforms (the encoding is versioned: `kvbridge-fingerprint-v1`).
/// Covers everything `check` reads except the rank coordinates (`attn_tp_rank`,
/// `attn_cp_rank`, `pp_rank`, `dcp_rank`) and the protocol minor version, so all ranks of one
/// deployment stage share a fingerprint. Two descriptors with equal fingerprints (and valid
/// rank fields) get the same answer from `check` against a given peer rank, so a cached result
/// can be reused; when fingerprints differ, [`fingerprint_diff`] says which fields changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub u64);

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fnv1a64:{:016x}", self.0)
    }
}

impl Serialize for Fingerprint {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// One field that differs between two descriptors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FieldDiff {
    /// JSON field name.
    pub field: &'static str,
    /// Canonical value in the first descriptor.
    pub left: String,
    /// Canonical value in the second descriptor.
    pub right: String,
}

impl fmt::Display for FieldDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} != {}", self.field, self.left, self.right)
    }
}

const DOMAIN: &str = "kvbridge-fingerprint-v1";

/// 64-bit FNV-1a.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn list(v: &[u64]) -> String {
    let items: Vec<String> = v.iter().map(u64::to_string).collect();
    format!("[{}]", items.join(","))
}

fn opt<T: fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "null".to_owned(), |v| v.to_string())
}

/// The canonical `(field, value)` list the fingerprint hashes, in hashing order.
/// Strings are JSON-quoted so `null` and `"null"` differ.
pub fn compat_fields(d: &PeerDescriptor) -> Vec<(&'static str, String)> {
    let quote = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
    vec![
        ("role", d.role.as_str().to_owned()),
        ("protocol_major", d.protocol_version.major.to_string()),
        ("page_size", d.page_size.to_string()),
        ("kv_cache_dtype", quote(&d.kv_cache_dtype)),
        (
            "kv_layout",
            d.kv_layout
                .as_deref()
                .map_or_else(|| "null".to_owned(), quote),
        ),
        (
            "kv_pool",
            match d.kv_pool {
                PoolKind::Mha => "mha",
                PoolKind::Mla => "mla",
                PoolKind::HybridMla => "hybrid_mla",
            }
            .to_owned(),
        ),
        ("attn_tp_size", d.attn_tp_size.to_string()),
        ("attn_cp_size", d.attn_cp_size.to_string()),
        ("pp_size", d.pp_size.to_string()),
        ("dcp_size", d.dcp_size.to_string()),
        ("kv_cache_sharding", d.kv_cache_sharding.to_string()),
        ("total_kv_heads", opt(d.total_kv_heads)),
        ("head_dim", opt(d.head_dim)),
        ("kv_item_lens", list(&d.kv_item_lens)),
        ("num_draft_entries", d.num_draft_entries.to_string()),
        ("aux_item_lens", list(&d.aux_item_lens)),
    ]
}

/// The canonical byte encoding: `DOMAIN 0x1E (name 0x1F value 0x1E)*`.
pub fn canonical_encoding(d: &PeerDescriptor) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(DOMAIN.as_bytes());
    out.push(0x1E);
    for (name, value) in compat_fields(d) {
        out.extend_from_slice(name.as_bytes());
        out.push(0x1F);
        out.extend_from_slice(value.as_bytes());
        out.push(0x1E);
    }
    out
}

/// The fingerprint of a descriptor.
pub fn fingerprint(d: &PeerDescriptor) -> Fingerprint {
    Fingerprint(fnv1a64(&canonical_encoding(d)))
}

/// Every compatibility-relevant field that differs between two descriptors (empty iff the
/// canonical encodings are equal).
pub fn fingerprint_diff(left: &PeerDescriptor, right: &PeerDescriptor) -> Vec<FieldDiff> {
    compat_fields(left)
        .into_iter()
        .zip(compat_fields(right))
        .filter(|((_, a), (_, b))| a != b)
        .map(|((field, a), (_, b))| FieldDiff {
            field,
            left: a,
            right: b,
        })
        .collect()
}
