//! `kvbridge check`: exit codes, text and JSON output on the example descriptors.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::{Value, json};

mod fuzzing;
use fuzzing::mutate;
use kvbridge_conformance::SplitMix64;

fn example(path: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/descriptors")
        .join(path)
        .display()
        .to_string()
}

fn kvbridge(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args(args)
        .output()
        .expect("kvbridge runs")
}

fn check(dir: &str, extra: &[&str]) -> Output {
    let p = example(&format!("{dir}/prefill.json"));
    let d = example(&format!("{dir}/decode.json"));
    let mut args = vec!["check", p.as_str(), d.as_str()];
    args.extend_from_slice(extra);
    kvbridge(&args)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

#[test]
fn deepseek_mla_dcp4_is_compatible_and_prints_the_mapping() {
    let o = check("deepseek-mla-dcp4", &[]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("COMPATIBLE"));
    assert!(out.contains("DCP token plan"));
    assert!(out.contains("decode virtual page 256 tokens"));
    assert!(out.contains("target_tp_ranks                [1]"), "{out}");
    assert!(out.contains("required_prefill_response_num  1"), "{out}");
}

#[test]
fn deepseek_json_shape() {
    let v = json(&check("deepseek-mla-dcp4", &["--json"]));
    assert_eq!(v["compatible"], true);
    assert_eq!(v["problems"], serde_json::json!([]));
    let m = &v["mapping"];
    assert_eq!(m["target_tp_ranks"], serde_json::json!([1]));
    assert_eq!(m["target_cp_ranks"], serde_json::json!([0]));
    assert_eq!(m["target_pp_ranks"], serde_json::json!([0]));
    assert_eq!(m["required_dst_info_num"], 1);
    assert_eq!(m["required_prefill_response_num"], 1);
    assert_eq!(m["path"]["kind"], "dcp_token_plan");
    assert_eq!(m["peers"][0]["tp_rank"], 1);
}

#[test]
fn all_ranks_reports_every_decode_rank() {
    let o = check("deepseek-mla-dcp4", &["--all-ranks", "--json"]);
    assert_eq!(o.status.code(), Some(0));
    let v = json(&o);
    let ranks = v["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 4);
    for (r, entry) in ranks.iter().enumerate() {
        assert_eq!(entry["decode_tp_rank"], r);
        assert_eq!(entry["decode_dcp_rank"], r);
        assert_eq!(entry["mapping"]["target_tp_ranks"], serde_json::json!([r]));
    }
    let text = stdout(&check("deepseek-mla-dcp4", &["--all-ranks"]));
    assert!(text.contains("4 of 4 decode ranks compatible"), "{text}");
}

#[test]
fn qwen_gqa_different_tp_with_replication_is_compatible_with_a_warning() {
    let o = check("qwen-gqa-tp2-to-tp8", &["--all-ranks"]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let out = stdout(&o);
    assert!(out.contains("KVB-W001"));
    assert!(out.contains(
        "Performance is NOT guaranteed when using different TP sizes for non-MLA models."
    ));
    assert!(out.contains("1 -> [4, 5, 6, 7]"), "{out}");
    let v = json(&check("qwen-gqa-tp2-to-tp8", &["--json"]));
    assert_eq!(v["compatible"], true);
    assert_eq!(v["warnings"][0]["code"], "KVB-W001");
    assert_eq!(v["mapping"]["required_dst_info_num"], 4);
    // Decode rank 5 holds KV head 2 = the first of prefill rank 1's heads 2..4.
    let peer = &v["mapping"]["peers"][0];
    assert_eq!(peer["tp_rank"], 1);
    assert_eq!(
        peer["head_slice"],
        serde_json::json!({"src_head_start": 0, "num_heads": 1, "dst_head_start": 0})
    );
}

#[test]
fn broken_gqa_dcp2_is_refused_with_the_sglang_text() {
    let o = check("broken-gqa-dcp2", &[]);
    assert_eq!(o.status.code(), Some(1));
    let out = stdout(&o);
    assert!(out.contains("KVB-E007"));
    assert!(out.contains("PD decode DCP requires an MLA or hybrid-MLA KV pool."));
    assert!(out.contains("--dcp-size 1"));
    let v = json(&check("broken-gqa-dcp2", &["--json"]));
    assert_eq!(v["compatible"], false);
    assert_eq!(v["mapping"], Value::Null);
    let p = &v["problems"][0];
    let mut keys: Vec<&str> = p
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, ["code", "message", "remedy"]);
    assert_eq!(p["code"], "KVB-E007");
}

#[test]
fn three_problems_are_all_reported() {
    for compat in ["kvbridge", "sglang"] {
        let o = check("three-problems", &["--compat", compat]);
        assert_eq!(o.status.code(), Some(1));
        let out = stdout(&o);
        assert!(out.contains("INCOMPATIBLE: 3 problems"), "{out}");
        for text in [
            "KVB-E002",
            "KV cache dtype mismatch: prefill server has kv_cache_dtype=fp8_e4m3, but decode server has kv_cache_dtype=auto.",
            "KVB-E024",
            "prefill attn_tp_size=4 and decode attn_tp_size=6",
            "KVB-E012",
            "Decode pp size (2) should be equal to prefill pp size (4) or 1",
        ] {
            assert!(out.contains(text), "{text} missing from {out}");
        }
        assert_eq!(out.matches("  fix:  ").count(), 3);
    }
    let v = json(&check("three-problems", &["--json"]));
    let codes: Vec<&str> = v["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["code"].as_str().unwrap())
        .collect();
    assert_eq!(codes, ["KVB-E002", "KVB-E024", "KVB-E012"]);
}

#[test]
fn dcp2_to_dcp4_kvbridge_accepts_sglang_refuses() {
    let o = check("mla-dcp2-to-dcp4", &["--all-ranks"]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let out = stdout(&o);
    assert!(
        out.contains("0 -> [0, 2]") && out.contains("1 -> [1, 3]"),
        "{out}"
    );
    let text = stdout(&check("mla-dcp2-to-dcp4", &[]));
    assert!(
        text.contains("needs p mod 4 == 3, so it reads from prefill DCP rank [1]"),
        "{text}"
    );
    let o = check("mla-dcp2-to-dcp4", &["--compat", "sglang"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("Unsupported PD DCP topology: 2 -> 4"));
}

#[test]
fn page16_to_page64_kvbridge_accepts_sglang_refuses() {
    let v = json(&check("mla-page16-to-page64", &["--json"]));
    assert_eq!(v["compatible"], true);
    assert_eq!(v["mapping"]["path"]["kind"], "rows");
    let o = check("mla-page16-to-page64", &["--compat", "sglang"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains(
        "Page size mismatch: prefill server has page_size=16, but decode server has page_size=64."
    ));
}

#[test]
fn misaligned_prefix_pair_passes_check_and_fails_in_the_planner() {
    let o = check("misaligned-prefix", &[]);
    assert_eq!(o.status.code(), Some(0));
    assert!(stdout(&o).contains("decode virtual page 64 tokens"));
    let o = kvbridge(&["plan", &example("misaligned-prefix/plan.json")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains(
        "PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size (64), got 100"
    ), "{}", stderr(&o));
    let o = kvbridge(&["plan", &example("misaligned-prefix/plan-aligned.json")]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn unreadable_and_unparsable_files_exit_2_naming_the_file() {
    let good = example("deepseek-mla-dcp4/decode.json");
    let o = kvbridge(&["check", "/nonexistent/prefill.json", &good]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("cannot read the PREFILL file /nonexistent/prefill.json"),
        "{}",
        stderr(&o)
    );

    let dir = std::env::temp_dir().join(format!("kvbridge-check-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let typo = dir.join("typo.json");
    std::fs::write(
        &typo,
        "{\n  \"role\": \"decode\",\n  \"page_sise\": 64\n}\n",
    )
    .unwrap();
    let o = kvbridge(&[
        "check",
        &example("deepseek-mla-dcp4/prefill.json"),
        typo.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("cannot parse the DECODE file"), "{err}");
    assert!(err.contains("typo.json at line 3, column"), "{err}");
    assert!(err.contains("unknown field `page_sise`"), "{err}");
    assert!(o.stdout.is_empty());

    let newer = dir.join("newer.json");
    std::fs::write(
        &newer,
        "{\"protocol_version\": \"2.0\", \"role\": \"decode\"}",
    )
    .unwrap();
    let o = kvbridge(&[
        "check",
        &example("deepseek-mla-dcp4/prefill.json"),
        newer.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("protocol_version 2.0"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn swapped_arguments_are_a_problem_not_a_parse_error() {
    let o = kvbridge(&[
        "check",
        &example("deepseek-mla-dcp4/decode.json"),
        &example("deepseek-mla-dcp4/prefill.json"),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("KVB-E020"));
}

/// Writes `v` (the JSON of an example descriptor with fields replaced) to a file of its own.
fn edited(example_file: &str, fields: Value, name: &str) -> String {
    let text = std::fs::read_to_string(example(example_file)).expect("example");
    let mut d: Value = serde_json::from_str(&text).expect("example JSON");
    for (k, v) in fields.as_object().expect("object") {
        d[k] = v.clone();
    }
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("check-{name}.json"));
    std::fs::write(&path, d.to_string()).expect("write");
    path.display().to_string()
}

/// Before the bounds, prefill `pp_size` 4294967295 aborted allocating 16 GiB in the rank
/// mapping, and a prefill `attn_tp_size` of 1,048,576 took about 20 s (quadratic mapping); both
/// are refused as KVB-E033 now, before the mapping, in text, JSON and `--all-ranks` form.
#[test]
fn huge_sizes_are_refused_as_e033_without_a_crash() {
    let decode = example("deepseek-mla-dcp4/decode.json");
    for (name, fields, seen) in [
        (
            "pp-u32-max",
            json!({"pp_size": 4294967295u64}),
            "pp_size=4294967295 (max 1024)",
        ),
        (
            "tp-million",
            json!({"attn_tp_size": 1_048_576}),
            "attn_tp_size=1048576 (max 1024)",
        ),
    ] {
        let prefill = edited("deepseek-mla-dcp4/prefill.json", fields, name);
        for extra in [
            &[][..],
            &["--all-ranks"],
            &["--json"],
            &["--all-ranks", "--json"],
        ] {
            let mut args = vec!["check", prefill.as_str(), decode.as_str()];
            args.extend_from_slice(extra);
            let o = kvbridge(&args);
            assert_eq!(
                o.status.code(),
                Some(1),
                "{extra:?}: {}{}",
                stdout(&o),
                stderr(&o)
            );
            assert!(stderr(&o).is_empty(), "{}", stderr(&o));
            let out = stdout(&o);
            assert!(out.contains("KVB-E033"), "{extra:?}: {out}");
            assert!(out.contains(seen), "{extra:?}: {out}");
        }
    }
    // On the decode side `--all-ranks` checks the descriptor as given instead of 2^32 ranks.
    let prefill = example("deepseek-mla-dcp4/prefill.json");
    let decode = edited(
        "deepseek-mla-dcp4/decode.json",
        json!({"pp_size": 4294967295u64}),
        "decode-pp-u32-max",
    );
    let v = json(&kvbridge(&[
        "check",
        &prefill,
        &decode,
        "--all-ranks",
        "--json",
    ]));
    assert_eq!(v["compatible"], false);
    assert_eq!(v["ranks"].as_array().map(Vec::len), Some(1));
    assert_eq!(v["problems"][0]["code"], "KVB-E033");
}

/// What `mutated_descriptors_exit_0_1_or_2_with_a_report_or_a_message` mutates.
const DESCRIPTOR_FIELDS: [&str; 14] = [
    "role",
    "page_size",
    "kv_pool",
    "attn_tp_size",
    "attn_tp_rank",
    "attn_cp_size",
    "pp_size",
    "pp_rank",
    "dcp_size",
    "dcp_rank",
    "total_kv_heads",
    "kv_item_lens",
    "num_draft_entries",
    "aux_item_lens",
];

/// Fuzzing `kvbridge check` end to end: descriptor pairs from the handshake corpus
/// (`crates/handshake/tests/corpus`, `NAME.decode.json` / `NAME.prefill.json`), 1–3 mutations
/// on one or both sides, every output form. Exit 0 or 1 with a report on stdout and nothing on
/// stderr, or exit 2 with one message on stderr naming the file and nothing on stdout; never a
/// panic or an abort. The library harness (`crates/handshake/tests/fuzz.rs`) runs many more
/// cases in-process.
#[test]
fn mutated_descriptors_exit_0_1_or_2_with_a_report_or_a_message() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../handshake/tests/corpus");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("the handshake corpus exists")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    let seeds: Vec<String> = files
        .iter()
        .map(|p| std::fs::read_to_string(p).expect("seed"))
        .collect();
    assert!(seeds.len() >= 10 && seeds.len() % 2 == 0);
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let mut rng = SplitMix64::new(0x6368_6563_6b5f_667a);
    let mut seen = [0usize; 3];
    for case in 0..48 {
        let k = rng.index(seeds.len() / 2);
        let (mut p, mut d) = (seeds[2 * k + 1].clone(), seeds[2 * k].clone());
        for _ in 0..=rng.index(3) {
            let side = if rng.index(2) == 0 { &mut p } else { &mut d };
            *side = mutate(
                side,
                &DESCRIPTOR_FIELDS,
                &["kv_item_lens", "aux_item_lens"],
                &mut rng,
            );
        }
        let (pf, df) = (tmp.join("fuzz-prefill.json"), tmp.join("fuzz-decode.json"));
        std::fs::write(&pf, &p).expect("write");
        std::fs::write(&df, &d).expect("write");
        let forms: [&[&str]; 4] = [
            &[],
            &["--json"],
            &["--all-ranks"],
            &["--compat", "sglang", "--json"],
        ];
        let extra = forms[case % forms.len()];
        let (ps, ds) = (pf.display().to_string(), df.display().to_string());
        let mut args = vec!["check", ps.as_str(), ds.as_str()];
        args.extend_from_slice(extra);
        let o = kvbridge(&args);
        let (out, err) = (stdout(&o), stderr(&o));
        let why = || {
            format!("case {case} {extra:?}\nprefill {p}\ndecode {d}\nstdout {out}\nstderr {err}")
        };
        match o.status.code() {
            Some(code @ (0 | 1)) => {
                assert!(err.is_empty() && !out.is_empty(), "{}", why());
                if extra.contains(&"--json") {
                    assert_eq!(json(&o)["compatible"], code == 0, "{}", why());
                }
                seen[code as usize] += 1;
            }
            Some(2) => {
                assert!(out.is_empty(), "{}", why());
                assert!(
                    err.starts_with("kvbridge check: cannot ") && err.contains("fuzz-"),
                    "{}",
                    why()
                );
                seen[2] += 1;
            }
            _ => panic!("unexpected exit: {}", why()),
        }
    }
    // Reports and refusals were both exercised.
    assert!(seen[1] > 0 && seen[2] > 0, "{seen:?}");
}
