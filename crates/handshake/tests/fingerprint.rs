//! The compatibility fingerprint: stable, rank-independent, and explained field by field.

mod common;

use common::{mla, with};
use kvbridge_handshake::{FieldDiff, Fingerprint, check, fingerprint, fingerprint_diff, fnv1a64};
use serde_json::json;

#[test]
fn fnv1a64_reference_values() {
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
}

/// The fingerprint of a fixed descriptor never changes (other builds compare it).
#[test]
fn fingerprint_is_stable() {
    let fp = fingerprint(&mla("prefill", 4, 1, 0));
    assert_eq!(fp.to_string(), format!("fnv1a64:{:016x}", fp.0));
    assert_eq!(fp, Fingerprint(GOLDEN));
}

/// Computed independently (Python FNV-1a over the canonical encoding below).
const GOLDEN: u64 = 0x0a1d_63d7_aad3_12f3;

#[test]
fn canonical_encoding_is_documented_form() {
    let expected = [
        ("role", "prefill"),
        ("protocol_major", "1"),
        ("page_size", "64"),
        ("kv_cache_dtype", "\"auto\""),
        ("kv_layout", "null"),
        ("kv_pool", "mla"),
        ("attn_tp_size", "4"),
        ("attn_cp_size", "1"),
        ("pp_size", "1"),
        ("dcp_size", "1"),
        ("kv_cache_sharding", "false"),
        ("total_kv_heads", "null"),
        ("head_dim", "null"),
        ("kv_item_lens", "[73728,73728]"),
        ("num_draft_entries", "0"),
        ("aux_item_lens", "[]"),
    ];
    let mut bytes = b"kvbridge-fingerprint-v1\x1e".to_vec();
    for (n, v) in expected {
        bytes.extend_from_slice(n.as_bytes());
        bytes.push(0x1f);
        bytes.extend_from_slice(v.as_bytes());
        bytes.push(0x1e);
    }
    assert_eq!(
        kvbridge_handshake::canonical_encoding(&mla("prefill", 4, 1, 0)),
        bytes
    );
}

#[test]
fn ranks_do_not_change_the_fingerprint_but_sizes_do() {
    let a = mla("decode", 4, 4, 0);
    let b = mla("decode", 4, 4, 3);
    assert_eq!(fingerprint(&a), fingerprint(&b));
    assert!(fingerprint_diff(&a, &b).is_empty());
    let c = with(&a, json!({"dcp_size": 2, "dcp_rank": 0, "kv_layout": "x"}));
    assert_ne!(fingerprint(&a), fingerprint(&c));
    assert_eq!(
        fingerprint_diff(&a, &c),
        [
            FieldDiff {
                field: "kv_layout",
                left: "null".into(),
                right: "\"x\"".into()
            },
            FieldDiff {
                field: "dcp_size",
                left: "4".into(),
                right: "2".into()
            },
        ]
    );
}

#[test]
fn null_and_the_string_null_differ() {
    let a = mla("decode", 4, 1, 0);
    let b = with(&a, json!({"kv_layout": "null"}));
    assert_ne!(fingerprint(&a), fingerprint(&b));
}

#[test]
fn report_carries_both_fingerprints() {
    let p = mla("prefill", 4, 1, 0);
    let d = mla("decode", 4, 1, 0);
    let r = check(&p, &d);
    assert_eq!(
        (r.prefill_fingerprint, r.decode_fingerprint),
        (fingerprint(&p), fingerprint(&d))
    );
}
