//! The JSON contract of `PeerDescriptor`: field names, defaults, strictness, versions.

use kvbridge_handshake::{HandshakeError, PeerDescriptor, PoolKind, ProtocolVersion, Role};

const MINIMAL: &str = r#"{
  "role": "decode",
  "page_size": 64,
  "kv_cache_dtype": "auto",
  "kv_pool": "hybrid_mla",
  "attn_tp_size": 4,
  "kv_item_lens": [73728, 73728]
}"#;

#[test]
fn defaults_of_omitted_fields() {
    let d = PeerDescriptor::from_json(MINIMAL).expect("parse");
    assert_eq!(d.role, Role::Decode);
    assert_eq!(d.protocol_version, ProtocolVersion::CURRENT);
    assert_eq!(d.kv_layout, None);
    assert_eq!(d.kv_pool, PoolKind::HybridMla);
    assert_eq!((d.attn_tp_rank, d.attn_cp_size, d.attn_cp_rank), (0, 1, 0));
    assert_eq!((d.pp_size, d.pp_rank, d.dcp_size, d.dcp_rank), (1, 0, 1, 0));
    assert!(!d.kv_cache_sharding);
    assert_eq!((d.total_kv_heads, d.head_dim), (None, None));
    assert_eq!(d.num_draft_entries, 0);
    assert!(d.aux_item_lens.is_empty());
}

#[test]
fn round_trip_keeps_every_field_name() {
    let d = PeerDescriptor::from_json(MINIMAL).expect("parse");
    let text = d.to_json_pretty();
    for field in [
        "role",
        "protocol_version",
        "page_size",
        "kv_cache_dtype",
        "kv_layout",
        "kv_pool",
        "attn_tp_size",
        "attn_tp_rank",
        "attn_cp_size",
        "attn_cp_rank",
        "pp_size",
        "pp_rank",
        "dcp_size",
        "dcp_rank",
        "kv_cache_sharding",
        "kv_item_lens",
        "num_draft_entries",
        "aux_item_lens",
    ] {
        assert!(
            text.contains(&format!("\"{field}\"")),
            "{field} missing in {text}"
        );
    }
    assert!(text.contains("\"protocol_version\": \"1.0\""));
    assert_eq!(PeerDescriptor::from_json(&text).expect("reparse"), d);
}

#[test]
fn unknown_field_is_rejected_with_position() {
    let text = MINIMAL.replace("\"page_size\"", "\"page_sise\"");
    match PeerDescriptor::from_json(&text) {
        Err(HandshakeError::Json {
            line,
            column,
            message,
        }) => {
            assert_eq!(line, 3);
            assert!(column > 0);
            assert!(message.contains("unknown field `page_sise`"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn missing_required_field_and_bad_values() {
    let text = MINIMAL.replace("  \"page_size\": 64,\n", "");
    let e = PeerDescriptor::from_json(&text).expect_err("missing page_size");
    assert!(e.to_string().contains("missing field `page_size`"), "{e}");
    let e = PeerDescriptor::from_json(&MINIMAL.replace("hybrid_mla", "gqa")).expect_err("bad pool");
    assert!(e.to_string().contains("unknown variant `gqa`"), "{e}");
    let e = PeerDescriptor::from_json(&MINIMAL.replace("\"decode\"", "\"sender\""))
        .expect_err("bad role");
    assert!(e.to_string().contains("unknown variant `sender`"), "{e}");
    let e = PeerDescriptor::from_json("{ not json").expect_err("syntax");
    assert!(matches!(e, HandshakeError::Json { line: 1, .. }), "{e:?}");
}

#[test]
fn protocol_versions() {
    let with =
        |v: &str| MINIMAL.replace("\"role\"", &format!("\"protocol_version\": {v}, \"role\""));
    assert_eq!(
        PeerDescriptor::from_json(&with("\"1.7\""))
            .expect("newer minor")
            .protocol_version,
        ProtocolVersion { major: 1, minor: 7 }
    );
    assert_eq!(
        PeerDescriptor::from_json(&with("1"))
            .expect("bare major")
            .protocol_version,
        ProtocolVersion::CURRENT
    );
    match PeerDescriptor::from_json(&with("\"2.0\"")) {
        Err(e @ HandshakeError::UnsupportedProtocolVersion { .. }) => {
            let t = e.to_string();
            assert!(t.contains("protocol_version 2.0"), "{t}");
            assert!(t.contains("speaks protocol 1.0"), "{t}");
            assert!(t.contains("upgrade kvbridge"), "{t}");
        }
        other => panic!("{other:?}"),
    }
    let e = PeerDescriptor::from_json(&with("\"one\"")).expect_err("garbage version");
    assert!(e.to_string().contains("MAJOR.MINOR"), "{e}");
}

#[test]
fn newer_major_is_refused_for_its_version_not_its_new_fields() {
    let text = MINIMAL.replace(
        "\"role\"",
        "\"protocol_version\": \"3.1\", \"kv_zones\": 4, \"role\"",
    );
    assert!(matches!(
        PeerDescriptor::from_json(&text),
        Err(HandshakeError::UnsupportedProtocolVersion {
            seen: ProtocolVersion { major: 3, minor: 1 },
            ..
        })
    ));
}

#[test]
fn newer_minor_with_new_field_says_so() {
    let text = MINIMAL.replace(
        "\"role\"",
        "\"protocol_version\": \"1.4\", \"kv_zones\": 4, \"role\"",
    );
    let e = PeerDescriptor::from_json(&text).expect_err("unknown field");
    let t = e.to_string();
    assert!(t.contains("unknown field `kv_zones`"), "{t}");
    assert!(t.contains("newer than this build's 1.0"), "{t}");
}

#[test]
fn heads_per_rank_follows_sglang() {
    let mut d = PeerDescriptor::from_json(MINIMAL).expect("parse");
    d.total_kv_heads = Some(2);
    d.attn_tp_size = 8;
    assert_eq!(d.heads_per_rank(), Some(1));
    d.attn_tp_size = 1;
    assert_eq!(d.heads_per_rank(), Some(2));
}
