//! `kvbridge explain`: every code, unknown codes, and agreement with docs/errors.md.

use std::path::PathBuf;
use std::process::{Command, Output};

use kvbridge_handshake::catalog;

fn kvbridge(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args(args)
        .output()
        .expect("kvbridge runs")
}

fn errors_md() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/errors.md");
    std::fs::read_to_string(path).expect("docs/errors.md exists")
}

#[test]
fn every_code_is_explained_exactly_as_in_docs_errors_md() {
    let doc = errors_md();
    assert!(!catalog().is_empty());
    for info in catalog() {
        let o = kvbridge(&["explain", info.id]);
        assert_eq!(o.status.code(), Some(0), "{}", info.id);
        let text = String::from_utf8(o.stdout).expect("utf-8");
        assert!(text.starts_with(&format!("## {} — ", info.id)), "{text}");
        for section in [
            "**What it means**",
            "**When it happens**",
            "**How to fix it**",
            "**Example fix**",
        ] {
            assert!(text.contains(section), "{} lacks {section}", info.id);
        }
        assert!(
            doc.contains(&text),
            "docs/errors.md disagrees with `kvbridge explain {}`",
            info.id
        );
    }
}

#[test]
fn explain_all_is_docs_errors_md() {
    let o = kvbridge(&["explain", "--all"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(
        String::from_utf8(o.stdout).unwrap() == errors_md(),
        "regenerate docs/errors.md (see its header)"
    );
}

#[test]
fn short_forms_and_seed_page_codes() {
    let o = kvbridge(&["explain", "e7"]);
    assert_eq!(o.status.code(), Some(0));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.contains("PD decode DCP requires an MLA or hybrid-MLA KV pool."));
    assert!(text.contains("--dcp-size 1"));
    let o = kvbridge(&["explain", "KVB-E040"]);
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.contains(
        "PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size ({virtual_page_size}), got {decode_prefix_len}"
    ));
    assert!(text.contains("planner"), "{text}");
    assert!(text.contains("examples/descriptors/misaligned-prefix/plan.json"));
}

#[test]
fn unknown_code_exits_2_and_lists_known_codes() {
    let o = kvbridge(&["explain", "KVB-E999"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stdout.is_empty());
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(err.contains("unknown problem code `KVB-E999`"));
    for info in catalog() {
        assert!(err.contains(info.id), "{} not listed", info.id);
    }
}

#[test]
fn no_code_lists_all_codes() {
    let o = kvbridge(&["explain"]);
    assert_eq!(o.status.code(), Some(0));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.contains("KVB-E001  Page size mismatch"));
    assert!(out.contains("KVB-W002"));
}
