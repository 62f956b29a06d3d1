//! All 90 conformance cases of `tests/data/dcp_plan_vectors.json`: inputs of SGLang 0.5.23's
//! DCP token plan with the arrays or the error text SGLang produces for them
//! (docs/planning.md, "Prefill DCP 1 → decode DCP d").

use kvbridge_geometry::{
    DcpPlanInput, Run, SendPages, build_dcp_token_transfer_plan, group_concurrent_contiguous,
};
use serde_json::Value;

const VECTORS: &str = include_str!("data/dcp_plan_vectors.json");

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("unsigned"))
        .collect()
}

fn cases() -> Vec<Value> {
    let doc: Value = serde_json::from_str(VECTORS).expect("vector file parses");
    doc["cases"].as_array().expect("cases").clone()
}

#[test]
fn the_file_has_ninety_cases() {
    assert_eq!(cases().len(), 90);
}

#[test]
fn every_case_matches_arrays_or_error_text() {
    let mut ok = 0;
    let mut errors = 0;
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let inp = &case["inputs"];
        let src = u64s(&inp["src_page_indices"]);
        let dst = u64s(&inp["dst_page_indices"]);
        let page_size = inp["physical_page_size"].as_u64().unwrap();
        // SGLang counts the chunk offset in pages; kvbridge's inputs count tokens.
        let src_page_offset = inp["src_page_offset"].as_u64().unwrap();
        let input = DcpPlanInput {
            src_pages: &src,
            dst_pages: SendPages::after_prefix(&dst),
            page_size,
            dcp_size: inp["dcp_size"].as_u64().unwrap(),
            dcp_rank: inp["dcp_rank"].as_u64().unwrap(),
            chunk_start: src_page_offset * page_size,
            decode_prefix_len: inp["decode_prefix_len"].as_u64().unwrap(),
            num_kv_tokens: inp["num_kv_tokens"].as_u64(),
        };
        let result = build_dcp_token_transfer_plan(&input);
        if let Some(exp) = case.get("expected") {
            let plan = result.unwrap_or_else(|e| panic!("{name}: unexpected error {e}"));
            assert_eq!(
                plan.target_src,
                u64s(&exp["target_src"]),
                "{name} target_src"
            );
            assert_eq!(
                plan.target_dst,
                u64s(&exp["target_dst"]),
                "{name} target_dst"
            );
            assert_eq!(plan.draft_src, u64s(&exp["draft_src"]), "{name} draft_src");
            assert_eq!(plan.draft_dst, u64s(&exp["draft_dst"]), "{name} draft_dst");
            // The lazy run form agrees with coalescing the arrays.
            let lazy = input.plan().unwrap();
            let runs: Vec<Run> = lazy.target_runs().collect();
            assert_eq!(
                runs,
                group_concurrent_contiguous(&plan.target_src, &plan.target_dst).unwrap(),
                "{name} target runs"
            );
            let runs: Vec<Run> = lazy.draft_runs().collect();
            assert_eq!(
                runs,
                group_concurrent_contiguous(&plan.draft_src, &plan.draft_dst).unwrap(),
                "{name} draft runs"
            );
            ok += 1;
        } else {
            let want = case["error_substring"].as_str().unwrap();
            let err = result.expect_err(name).to_string();
            assert!(
                err.contains(want),
                "{name}: {err:?} does not contain {want:?}"
            );
            errors += 1;
        }
    }
    assert_eq!((ok, errors), (81, 9));
}
