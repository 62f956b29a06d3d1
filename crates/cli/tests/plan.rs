//! `kvbridge plan`: JSON in, JSON out; exit 2 with the library's message on invalid input.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::{Value, json};

mod fuzzing;
use fuzzing::mutate;
use kvbridge_conformance::SplitMix64;

fn plan_stdin(input: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args(["plan", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvbridge runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn ok_json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

fn assert_invalid(out: &Output, message: &str) {
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "stdout must be empty on error");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(message),
        "stderr {stderr:?} lacks {message:?}"
    );
}

#[test]
fn the_readme_example_file_plans_rank_one() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/plan/dcp4_rank1.json"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args(["plan", path])
        .output()
        .unwrap();
    assert_eq!(
        ok_json(&out),
        json!({
            "target_src": [11, 23],
            "target_dst": [14, 15],
            "draft_src": [10, 11, 4, 5, 22, 23, 8, 9],
            "draft_dst": [56, 57, 58, 59, 60, 61, 62, 63],
            "target_runs": [[11, 14, 1], [23, 15, 1]]
        })
    );
}

#[test]
fn optional_fields_default_and_null_tokens_mean_whole_pages() {
    let out = plan_stdin(
        r#"{"src_pages":[3,1],"dst_pages":[0,2],"page_size":2,"dcp_size":2,"dcp_rank":0,"num_kv_tokens":null}"#,
    );
    let v = ok_json(&out);
    assert_eq!(v["target_src"], json!([6, 2]));
    assert_eq!(v["target_dst"], json!([0, 1]));
    assert_eq!(v["draft_dst"], json!([0, 1, 2, 3]));
    assert_eq!(v["target_runs"], json!([[6, 0, 1], [2, 1, 1]]));
}

#[test]
fn contiguous_rows_coalesce_into_one_run() {
    let out = plan_stdin(
        r#"{"src_pages":[3],"dst_pages":[8,6],"page_size":64,"dcp_size":1,"dcp_rank":0,"src_page_offset":1,"num_kv_tokens":8}"#,
    );
    let v = ok_json(&out);
    assert_eq!(v["target_runs"], json!([[192, 384, 8]]));
    assert_eq!(v["target_src"], v["draft_src"]);
}

#[test]
fn planner_errors_exit_2_with_the_spec_text() {
    let out = plan_stdin(
        r#"{"src_pages":[0],"dst_pages":[0],"page_size":16,"dcp_size":4,"dcp_rank":0,"decode_prefix_len":100}"#,
    );
    assert_invalid(
        &out,
        "PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size (64), got 100",
    );
    let out = plan_stdin(
        r#"{"src_pages":[1,2,3,4],"dst_pages":[7],"page_size":2,"dcp_size":2,"dcp_rank":0,"num_kv_tokens":8}"#,
    );
    assert_invalid(
        &out,
        "Insufficient destination DCP pages: required=2, provided=1, src_page_offset=0, dcp_rank=0",
    );
    let out = plan_stdin(
        r#"{"src_pages":[0],"dst_pages":[0],"page_size":2,"dcp_size":4,"dcp_rank":0,"num_kv_tokens":3}"#,
    );
    assert_invalid(
        &out,
        "num_kv_tokens must fit in the provided source pages, got tokens=3, capacity=2",
    );
    let out =
        plan_stdin(r#"{"src_pages":[0],"dst_pages":[0],"page_size":2,"dcp_size":4,"dcp_rank":4}"#);
    assert_invalid(&out, "dcp_rank must be below dcp_size");
    let out =
        plan_stdin(r#"{"src_pages":[0],"dst_pages":[0],"page_size":0,"dcp_size":4,"dcp_rank":0}"#);
    assert_invalid(&out, "page_size must be positive, got 0");
}

#[test]
fn malformed_input_exits_2() {
    assert_invalid(&plan_stdin("{not json"), "invalid plan input");
    assert_invalid(&plan_stdin(""), "invalid plan input");
    assert_invalid(
        &plan_stdin(r#"{"src_pages":[0],"dst_pages":[0],"dcp_size":4,"dcp_rank":0}"#),
        "missing field `page_size`",
    );
    assert_invalid(
        &plan_stdin(
            r#"{"src_pages":[-1],"dst_pages":[0],"page_size":2,"dcp_size":4,"dcp_rank":0}"#,
        ),
        "-1",
    );
    assert_invalid(
        &plan_stdin(
            r#"{"src_pages":[0],"dst_pages":[0],"page_size":2,"dcp_size":4,"dcp_rank":0,"num_kv_tokens":-1}"#,
        ),
        "-1",
    );
    assert_invalid(
        &plan_stdin(
            r#"{"src_pages":[0],"dst_pages":[0],"page_size":2.5,"dcp_size":4,"dcp_rank":0}"#,
        ),
        "invalid plan input",
    );
    assert_invalid(
        &plan_stdin(
            r#"{"src_pages":[0],"dst_pages":[0],"page_size":2,"dcp_size":4,"dcp_rank":0,"page_sise":2}"#,
        ),
        "unknown field `page_sise`",
    );
    assert_invalid(&plan_stdin("[1, 2]"), "invalid plan input");
}

#[test]
fn unreadable_file_exits_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args(["plan", "/nonexistent/kvbridge-plan.json"])
        .output()
        .unwrap();
    assert_invalid(&out, "cannot read /nonexistent/kvbridge-plan.json");
}

#[test]
fn help_explains_the_input_format() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args(["plan", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "src_pages",
        "dst_pages",
        "num_kv_tokens",
        "target_runs",
        "standard input",
    ] {
        assert!(help.contains(needle), "help lacks {needle}: {help}");
    }
    // The maxima the help states are the planner's.
    use kvbridge_geometry::{MAX_CHUNK_TOKENS, MAX_GROUP_SIZE, MAX_PAGE_SIZE};
    for needle in [
        format!("1..={MAX_PAGE_SIZE}"),
        format!("1..={MAX_GROUP_SIZE}"),
        format!("at most {MAX_CHUNK_TOKENS}"),
    ] {
        assert!(help.contains(&needle), "help lacks {needle}: {help}");
    }
}

/// Before the bounds, page size 2^32 aborted allocating 32 GiB of per-token arrays, and 2^62
/// panicked with "capacity overflow"; both are refused up front now.
#[test]
fn huge_page_sizes_and_chunks_exit_2_without_allocating() {
    for page_size in [1u64 << 32, 1 << 62, u64::MAX] {
        let out = plan_stdin(
            &json!({"src_pages": [0], "dst_pages": [0], "page_size": page_size,
                "dcp_size": 4, "dcp_rank": 1})
            .to_string(),
        );
        assert_invalid(
            &out,
            &format!("kvbridge plan: page_size={page_size} is above the maximum of 1048576"),
        );
    }
    let out = plan_stdin(
        &json!({"src_pages": [0], "dst_pages": [0], "page_size": 2, "dcp_size": 1u64 << 32,
            "dcp_rank": 1})
        .to_string(),
    );
    assert_invalid(&out, "dcp_size=4294967296 is above the maximum of 1024");
    // 2^23 tokens the source pages do hold: above the chunk maximum.
    let pages: Vec<u64> = (0..8).collect();
    let out = plan_stdin(
        &json!({"src_pages": pages, "dst_pages": pages, "page_size": 1 << 20, "dcp_size": 1,
            "dcp_rank": 0})
        .to_string(),
    );
    assert_invalid(
        &out,
        "num_kv_tokens=8388608 is above the maximum of 4194304; plan a longer send range as \
         several chunks",
    );
}

/// What `mutated_plan_inputs_exit_0_or_2_with_a_message` sets plan fields to.
const PLAN_FIELDS: [&str; 9] = [
    "src_pages",
    "dst_pages",
    "page_size",
    "dcp_size",
    "dcp_rank",
    "src_page_offset",
    "decode_prefix_len",
    "num_kv_tokens",
    "unknown_field",
];

/// Fuzzing the JSON `kvbridge plan` reads: seeds from `tests/corpus/plan/*.json`, 1–3
/// mutations each, a bounded number of cases. Every outcome is exit 0 with one JSON plan on
/// stdout, or exit 2 with one message on stderr and nothing on stdout; never a panic or an
/// abort.
#[test]
fn mutated_plan_inputs_exit_0_or_2_with_a_message() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/plan");
    let mut seeds: Vec<String> = std::fs::read_dir(&dir)
        .expect("tests/corpus/plan exists")
        .map(|e| std::fs::read_to_string(e.expect("entry").path()).expect("seed"))
        .collect();
    seeds.sort();
    assert!(seeds.len() >= 4);
    let mut rng = SplitMix64::new(0x6b76_6272_6964_6765);
    let (mut planned, mut refused) = (0, 0);
    for case in 0..96 {
        let mut text = seeds[case % seeds.len()].clone();
        for _ in 0..=rng.index(3) {
            text = mutate(&text, &PLAN_FIELDS, &["src_pages", "dst_pages"], &mut rng);
        }
        let out = plan_stdin(&text);
        let stderr = String::from_utf8_lossy(&out.stderr);
        match out.status.code() {
            Some(0) => {
                let v: Value = serde_json::from_slice(&out.stdout)
                    .unwrap_or_else(|e| panic!("case {case}: {e}; input {text}"));
                assert!(v["target_runs"].is_array(), "case {case}: {v}");
                assert!(stderr.is_empty(), "case {case}: {stderr}");
                planned += 1;
            }
            Some(2) => {
                assert!(out.stdout.is_empty(), "case {case}: input {text}");
                assert!(
                    stderr.starts_with("kvbridge plan: ") && stderr.trim_end().lines().count() == 1,
                    "case {case}: {stderr:?}; input {text}"
                );
                refused += 1;
            }
            other => panic!("case {case}: exit {other:?}, stderr {stderr}; input {text}"),
        }
    }
    // Both outcomes were exercised.
    assert!(
        planned > 0 && refused > 0,
        "planned {planned}, refused {refused}"
    );
}
