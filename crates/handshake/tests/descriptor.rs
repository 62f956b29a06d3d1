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

/// A descriptor read as a field of another message, as control messages carry it.
fn inside_a_message(descriptor: &str) -> Result<PeerDescriptor, serde_json::Error> {
    #[derive(serde::Deserialize)]
    struct Message {
        descriptor: PeerDescriptor,
    }
    serde_json::from_str::<Message>(&format!("{{\"descriptor\": {descriptor}}}"))
        .map(|m| m.descriptor)
}

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
    let mut d = PeerDescriptor::from_json(MINIMAL).expect("parse");
    (d.total_kv_heads, d.head_dim) = (Some(8), Some(128));
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
        "total_kv_heads",
        "head_dim",
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
fn newer_minor_fields_are_read_around_and_listed() {
    let text = MINIMAL.replace(
        "\"role\"",
        "\"protocol_version\": \"1.4\", \"kv_zones\": 4, \"zone_names\": [\"a\"], \"role\"",
    );
    let d = PeerDescriptor::from_json(&text).expect("a newer minor version is readable");
    assert_eq!(d.unknown_fields(), ["kv_zones", "zone_names"]);
    assert_eq!(d.protocol_version, ProtocolVersion { major: 1, minor: 4 });
    // Every known field is read as if the new ones were absent.
    let without = PeerDescriptor::from_json(
        &MINIMAL.replace("\"role\"", "\"protocol_version\": \"1.4\", \"role\""),
    )
    .expect("parse");
    assert!(without.unknown_fields().is_empty());
    assert_eq!(
        d.to_json_pretty(),
        without.to_json_pretty(),
        "unknown fields are not written back"
    );
    // The same rules hold where a descriptor arrives inside another message.
    assert_eq!(inside_a_message(&text).expect("embedded newer minor"), d);
}

#[test]
fn a_newer_minor_version_keeps_every_field_this_build_knows() {
    let mut full = PeerDescriptor::mha(Role::Decode, 32, 2, 8, 128)
        .kv_cache_dtype("bfloat16")
        .kv_layout("NHD")
        .attn_tp(4, 3)
        .attn_cp(1, 0)
        .pp(2, 1)
        .dcp(2)
        .kv_cache_sharding(true)
        .num_draft_entries(1)
        .aux_item_lens(vec![4, 8])
        .protocol_version(ProtocolVersion { major: 1, minor: 9 })
        .build()
        .expect("complete");
    let mut value: serde_json::Value = serde_json::from_str(&full.to_json_pretty()).expect("json");
    value["kv_zones"] = serde_json::json!(4);
    let read = PeerDescriptor::from_json(&value.to_string()).expect("newer minor");
    assert_eq!(read.unknown_fields(), ["kv_zones"]);
    assert_eq!(read.to_json_pretty(), full.to_json_pretty());
    full.kv_layout = None;
    assert_ne!(read, full);
}

#[test]
fn unknown_fields_at_this_or_an_older_minor_are_still_typos() {
    for version in [
        "",
        "\"protocol_version\": \"1.0\", ",
        "\"protocol_version\": 1, ",
    ] {
        let text = MINIMAL.replace("\"role\"", &format!("{version}\"kv_zones\": 4, \"role\""));
        let e = PeerDescriptor::from_json(&text).expect_err("unknown field");
        assert!(
            matches!(&e, HandshakeError::Json { message, .. } if message.contains("unknown field `kv_zones`")),
            "{e:?}"
        );
        let e = inside_a_message(&text).expect_err("embedded typo");
        assert!(e.to_string().contains("unknown field `kv_zones`"), "{e}");
    }
}

#[test]
fn newer_major_is_refused_with_the_upgrade_to_make() {
    let text = MINIMAL.replace(
        "\"role\"",
        "\"protocol_version\": \"2.0\", \"kv_zones\": 4, \"role\"",
    );
    let e = PeerDescriptor::from_json(&text).expect_err("newer major");
    assert!(
        matches!(
            e,
            HandshakeError::UnsupportedProtocolVersion {
                seen: ProtocolVersion { major: 2, minor: 0 },
                supported: ProtocolVersion::CURRENT,
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("upgrade kvbridge on this side to a release that speaks protocol 2.x"),
        "{e}"
    );
    let e = inside_a_message(&text).expect_err("embedded newer major");
    assert!(e.to_string().contains("protocol_version 2.0"), "{e}");
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

// ---- the builder ----

#[test]
fn builder_defaults_equal_the_json_defaults() {
    let built = PeerDescriptor::builder(Role::Decode)
        .page_size(64)
        .kv_pool(PoolKind::HybridMla)
        .attn_tp(4, 0)
        .kv_item_lens(vec![73728, 73728])
        .build()
        .expect("complete");
    assert_eq!(built, PeerDescriptor::from_json(MINIMAL).expect("parse"));
}

#[test]
fn mla_and_mha_shapes_derive_entries_and_the_dcp_rank() {
    let d = PeerDescriptor::mla(Role::Decode, 64, 3, 1152)
        .attn_tp(8, 6)
        .dcp(4)
        .aux_item_lens(vec![64])
        .build()
        .expect("complete");
    assert_eq!(d.kv_pool, PoolKind::Mla);
    assert_eq!(d.kv_item_lens, vec![64 * 1152; 3]);
    assert_eq!(
        (d.attn_tp_size, d.attn_tp_rank, d.dcp_size, d.dcp_rank),
        (8, 6, 4, 2)
    );
    assert_eq!(d.aux_item_lens, [64]);

    // 8 KV heads over TP 16: each rank holds one (replicated), K and V per layer.
    let d = PeerDescriptor::mha(Role::Prefill, 32, 2, 8, 128)
        .kv_cache_dtype("fp8_e4m3")
        .attn_tp(16, 3)
        .build()
        .expect("complete");
    assert_eq!((d.total_kv_heads, d.head_dim), (Some(8), Some(128)));
    assert_eq!(d.kv_item_lens, vec![32 * 128; 4]);
    assert_eq!(d.heads_per_rank(), Some(1));
    let d = PeerDescriptor::mha(Role::Prefill, 32, 1, 8, 128)
        .element_bytes(2)
        .attn_tp(2, 1)
        .build()
        .expect("complete");
    assert_eq!(d.kv_item_lens, vec![32 * 4 * 128 * 2; 2]);
    assert_eq!(d.kv_cache_dtype, "auto");
}

#[test]
fn builder_refuses_incomplete_input_with_what_to_call() {
    let err = |b: kvbridge_handshake::PeerDescriptorBuilder| match b.build() {
        Err(e @ HandshakeError::DescriptorBuild { .. }) => e.to_string(),
        other => panic!("expected DescriptorBuild, got {other:?}"),
    };
    let t = err(PeerDescriptor::builder(Role::Prefill));
    assert!(
        t.contains("page_size is not set") && t.contains(".page_size("),
        "{t}"
    );
    let t = err(PeerDescriptor::builder(Role::Prefill).page_size(64));
    assert!(
        t.contains("kv_pool is not set") && t.contains("PeerDescriptor::mla"),
        "{t}"
    );
    let t = err(PeerDescriptor::builder(Role::Prefill)
        .page_size(64)
        .kv_pool(PoolKind::Mla));
    assert!(
        t.contains("kv_item_lens is not set") && t.contains(".kv_item_lens("),
        "{t}"
    );
    let t = err(PeerDescriptor::builder(Role::Prefill)
        .page_size(64)
        .kv_pool(PoolKind::Mha));
    assert!(
        t.contains("total_kv_heads and head_dim") && t.contains(".heads("),
        "{t}"
    );
    let t = err(PeerDescriptor::mha(Role::Prefill, 64, 2, 8, 128));
    assert!(
        t.contains(r#"kv_cache_dtype "auto""#) && t.contains(".element_bytes("),
        "{t}"
    );
    let t = err(PeerDescriptor::mla(Role::Decode, 0, 2, 1152));
    assert!(t.contains("page_size is 0"), "{t}");
    let t = err(PeerDescriptor::mla(Role::Decode, 64, 2, 1152).attn_tp(4, 4));
    assert!(
        t.contains("attn_tp size 4, rank 4") && t.contains(".attn_tp(size, rank)"),
        "{t}"
    );
    let t = err(PeerDescriptor::mla(Role::Decode, 64, 2, 1152).pp(0, 0));
    assert!(t.contains("pp size 0"), "{t}");
    let t = err(PeerDescriptor::mla(Role::Decode, 64, 2, 1152)
        .attn_tp(4, 0)
        .dcp(3));
    assert!(
        t.contains("dcp_size 3 does not divide attn_tp_size 4"),
        "{t}"
    );
    let t = err(PeerDescriptor::mla(Role::Decode, 64, 2, 1152).num_draft_entries(3));
    assert!(
        t.contains("num_draft_entries 3 exceeds the 2 KV entries"),
        "{t}"
    );
}

#[test]
fn roles_parse_as_in_the_json_form() {
    assert_eq!("prefill".parse::<Role>(), Ok(Role::Prefill));
    assert_eq!("decode".parse::<Role>(), Ok(Role::Decode));
    let e = "Decode".parse::<Role>().unwrap_err();
    assert!(e.contains(r#"got "Decode""#), "{e}");
}
