//! The problem catalog: complete, well-formed, consistent with what `check` emits, and equal to
//! `docs/errors.md`.
//!
//! Regenerate the document after changing the catalog:
//! `KVBRIDGE_BLESS=1 cargo test -p kvbridge-handshake --test errors_doc`.

mod common;

use std::path::PathBuf;

use common::{gqa, mla, with};
use kvbridge_handshake::{
    CheckOptions, Compat, DetectedBy, ProblemCode as C, Severity, catalog, catalog_markdown,
    check_with, explain,
};
use serde_json::json;

const ALL: &[C] = C::ALL;

#[test]
fn every_code_has_exactly_one_well_formed_entry() {
    assert_eq!(catalog().len(), ALL.len());
    for &c in ALL {
        let info = c.info();
        assert_eq!(info.code, c);
        assert_eq!(catalog().iter().filter(|i| i.code == c).count(), 1, "{c:?}");
        let id = info.id;
        let kind = if info.severity == Severity::Warning {
            'W'
        } else {
            'E'
        };
        assert!(
            id.len() == 8 && id.starts_with("KVB-") && id[4..].starts_with(kind),
            "{id}"
        );
        assert!(id[5..].chars().all(|ch| ch.is_ascii_digit()), "{id}");
        for (name, text) in [
            ("title", info.title),
            ("message", info.message),
            ("meaning", info.meaning),
            ("when", info.when),
            ("fix", info.fix),
            ("example", info.example),
            ("sglang", info.sglang),
        ] {
            assert!(!text.trim().is_empty(), "{id} {name}");
        }
        assert!(
            info.example.contains("before") || info.example.contains("slower"),
            "{id} example"
        );
    }
    let mut ids: Vec<&str> = catalog().iter().map(|i| i.id).collect();
    let sorted = {
        let mut s = ids.clone();
        s.sort_unstable();
        s
    };
    assert_eq!(ids, sorted, "catalog is in code order");
    ids.dedup();
    assert_eq!(ids.len(), catalog().len());
}

#[test]
fn codes_parse_in_short_forms() {
    for text in ["KVB-E007", "kvb-e007", "E007", "e7", "7"] {
        assert_eq!(
            explain(text).map(|i| i.code),
            Some(C::DcpNeedsMlaPool),
            "{text}"
        );
    }
    assert_eq!(explain("W2").map(|i| i.code), Some(C::AuxCount));
    assert!(explain("KVB-E999").is_none());
    assert!(explain("").is_none());
}

#[test]
fn out_of_scope_codes_are_marked_not_checked() {
    for c in [C::MiniMaxTp, C::Dspark, C::Mxfp8Tp] {
        assert_eq!(c.info().detected_by, DetectedBy::NotChecked);
    }
    assert_eq!(C::PrefixMisaligned.info().detected_by, DetectedBy::Planner);
    assert!(C::PrefixMisaligned.info().meaning.contains("planner"));
}

/// Whether `message` fits one line of the catalog template (`{...}` = any text).
fn fits(template: &str, message: &str) -> bool {
    template.lines().any(|line| {
        let mut pieces = Vec::new();
        let mut rest = line;
        while let Some(open) = rest.find('{') {
            pieces.push(&rest[..open]);
            let close = rest[open..].find('}').map_or(rest.len(), |c| open + c + 1);
            rest = &rest[close..];
        }
        pieces.push(rest);
        let mut at = 0;
        for (n, piece) in pieces.iter().enumerate() {
            match message[at..].find(piece) {
                Some(pos) if n > 0 || pos == 0 => at += pos + piece.len(),
                _ => return false,
            }
        }
        true
    })
}

#[test]
fn messages_check_emits_fit_their_catalog_templates() {
    let p = mla("prefill", 4, 1, 0);
    let cases = [
        (
            p.clone(),
            with(
                &mla("decode", 4, 1, 0),
                json!({"page_size": 16, "kv_item_lens": [18432, 18432],
            "kv_cache_dtype": "fp8", "kv_layout": "x", "pp_size": 2, "attn_cp_size": 2}),
            ),
        ),
        (
            with(
                &p,
                json!({"kv_layout": "y", "attn_cp_size": 2, "kv_cache_sharding": true}),
            ),
            with(&mla("decode", 4, 4, 1), json!({"kv_layout": "x"})),
        ),
        (
            gqa("prefill", 4, 8, 0),
            with(
                &gqa("decode", 4, 8, 1),
                json!({"dcp_size": 2, "dcp_rank": 1}),
            ),
        ),
        (mla("prefill", 2, 2, 0), mla("decode", 4, 2, 1)),
        (
            mla("prefill", 4, 2, 0),
            with(&mla("decode", 4, 4, 0), json!({"kv_item_lens": [73728]})),
        ),
        (
            mla("prefill", 4, 1, 0),
            with(
                &mla("decode", 4, 4, 0),
                json!({"kv_item_lens": [73728, 36864],
            "aux_item_lens": [4]}),
            ),
        ),
        (
            with(&p, json!({"aux_item_lens": [4, 8]})),
            with(&mla("decode", 4, 1, 0), json!({"aux_item_lens": [4]})),
        ),
        (
            with(&p, json!({"aux_item_lens": [4]})),
            with(&mla("decode", 4, 1, 0), json!({"aux_item_lens": [8]})),
        ),
        (
            with(
                &gqa("prefill", 2, 8, 0),
                json!({"kv_item_lens": [65536, 65536, 65536, 65536, 16384, 16384], "num_draft_entries": 2}),
            ),
            with(
                &gqa("decode", 4, 8, 0),
                json!({"kv_item_lens": [32768, 32768, 32768, 32768, 8192, 8192], "num_draft_entries": 2}),
            ),
        ),
        (mla("decode", 4, 1, 0), mla("prefill", 4, 1, 0)),
        (p.clone(), mla("prefill", 4, 1, 0)),
        (
            p.clone(),
            with(&mla("decode", 4, 1, 0), json!({"pp_size": 0})),
        ),
        (
            p.clone(),
            with(
                &mla("decode", 4, 1, 0),
                json!({"attn_tp_rank": 9, "dcp_size": 3}),
            ),
        ),
        (
            p.clone(),
            with(&mla("decode", 4, 4, 1), json!({"dcp_rank": 3})),
        ),
        (gqa("prefill", 4, 8, 0), gqa("decode", 6, 12, 0)),
        (
            gqa("prefill", 4, 8, 0),
            with(
                &gqa("decode", 4, 8, 0),
                json!({"total_kv_heads": null, "kv_item_lens": [32768, 32768, 32768]}),
            ),
        ),
        (
            gqa("prefill", 4, 8, 0),
            with(&gqa("decode", 3, 8, 0), json!({"kv_item_lens": [1, 2]})),
        ),
        (
            gqa("prefill", 4, 8, 0),
            with(
                &gqa("decode", 4, 8, 0),
                json!({"kv_item_lens": [65536, 65536, 65536, 65536]}),
            ),
        ),
        (
            p.clone(),
            with(&mla("decode", 4, 1, 0), json!({"kv_pool": "hybrid_mla"})),
        ),
        (
            p.clone(),
            with(
                &mla("decode", 4, 1, 0),
                json!({"kv_item_lens": [73728, 16384, 4096]}),
            ),
        ),
        (
            with(&p, json!({"kv_cache_sharding": true, "attn_tp_size": 2})),
            mla("decode", 4, 1, 0),
        ),
        (
            with(&p, json!({"protocol_version": "0.9"})),
            mla("decode", 4, 1, 0),
        ),
        (
            with(&p, json!({"protocol_version": "1.2", "kv_zones": 4})),
            mla("decode", 4, 1, 0),
        ),
        (gqa("prefill", 2, 8, 0), gqa("decode", 4, 8, 0)),
        (mla("prefill", 4, 4, 0), mla("decode", 4, 2, 0)),
        (
            with(&gqa("prefill", 4, 8, 0), json!({"dcp_size": 2})),
            gqa("decode", 4, 8, 0),
        ),
        (
            with(&mla("prefill", 4, 2, 0), json!({"attn_cp_size": 2})),
            mla("decode", 4, 1, 0),
        ),
        (
            with(&p, json!({"pp_size": 4294967295u64})),
            with(
                &mla("decode", 4, 1, 0),
                json!({"kv_item_lens": [1u64 << 41]}),
            ),
        ),
    ];
    let mut seen = std::collections::BTreeSet::new();
    for (prefill, decode) in &cases {
        for compat in [Compat::Sglang, Compat::Kvbridge] {
            let r = check_with(prefill, decode, &CheckOptions::new(compat));
            for pr in r.problems.iter().chain(&r.warnings) {
                assert!(
                    fits(pr.code.info().message, &pr.message),
                    "{} message does not fit its catalog template:\n  {}\n  {}",
                    pr.code,
                    pr.message,
                    pr.code.info().message
                );
                assert_eq!(pr.severity, pr.code.info().severity);
                seen.insert(pr.code);
            }
        }
    }
    // Every code `check` can emit was exercised here.
    for &c in ALL {
        let info = c.info();
        if matches!(
            info.detected_by,
            DetectedBy::Check | DetectedBy::CheckSglangOnly
        ) {
            assert!(seen.contains(&c), "{} never produced", info.id);
        }
    }
}

fn errors_md() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/errors.md")
}

/// `docs/errors.md` is exactly `catalog_markdown()`. With `KVBRIDGE_BLESS=1` the test rewrites
/// the file instead.
#[test]
fn docs_errors_md_matches_catalog() {
    let want = catalog_markdown();
    let path = errors_md();
    if std::env::var_os("KVBRIDGE_BLESS").is_some() {
        std::fs::write(&path, &want).expect("write docs/errors.md");
        return;
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "docs/errors.md is out of date with kvbridge_handshake::catalog(); regenerate it with \
         `KVBRIDGE_BLESS=1 cargo test -p kvbridge-handshake --test errors_doc`"
    );
}

#[test]
fn markdown_contains_every_entry_and_the_index() {
    let md = catalog_markdown();
    for i in catalog() {
        assert!(md.contains(&i.to_markdown()), "{}", i.id);
        assert!(md.contains(&format!("| [{}](#", i.id)), "{}", i.id);
    }
    assert!(md.contains("## Out of scope"));
    assert!(md.contains("## Descriptor format"));
    assert!(md.contains("(#kvb-e007--dcp-requires-an-mla-or-hybrid-mla-kv-pool)"));
}
