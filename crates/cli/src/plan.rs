//! `kvbridge plan`: the DCP token plan of one chunk, JSON in, JSON out.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use kvbridge_geometry::{DcpPlanInput, GeometryError, SendPages};
use serde::{Deserialize, Serialize};

const INPUT_HELP: &str = "\
The plan follows SGLang 0.5.23's build_dcp_token_transfer_plan, with explicit errors.

INPUT is a JSON file, or - for standard input, holding one object:

  {\"src_pages\": [5, 2, 11, 4],   prefill page ids of this chunk
   \"dst_pages\": [7],             decode virtual page ids of the whole send range
   \"page_size\": 2,               physical page size P (tokens per page), 1..=1048576
   \"dcp_size\": 4,                decode DCP size d, 1..=1024
   \"dcp_rank\": 1,                destination DCP rank r, < d
   \"src_page_offset\": 0,         optional: pages of the send range sent before this chunk
                                (SGLang's parameter; the library takes chunk_start in tokens)
   \"decode_prefix_len\": 0,       optional: tokens the decode already holds (multiple of P*d)
   \"num_kv_tokens\": 8}           optional: tokens in the chunk; null or absent = len(src_pages)*P;
                                at most 4194304 (plan a longer range as several chunks)

All numbers are non-negative integers; unknown fields are refused. The output is one JSON
object on one line:

  {\"target_src\": [..], \"target_dst\": [..], \"draft_src\": [..], \"draft_dst\": [..],
   \"target_runs\": [[src_start, dst_start, len], ..]}

target_* are token rows of the DCP-sharded KV owned by rank r (destination rows in the rank's
pool of page size P); draft_* are the replicated draft-model rows (destination page size P*d);
target_runs coalesces the target pairs into runs of consecutive rows on both sides.

Exit codes: 0 success; 2 invalid input (unreadable file, bad JSON, missing field, negative
number, a value above its maximum, or any planner error), with the message on stderr and
nothing on stdout.";

/// Arguments of `kvbridge plan`.
#[derive(Debug, clap::Args)]
#[command(after_help = INPUT_HELP)]
pub(crate) struct PlanArgs {
    /// JSON input file, or `-` for standard input.
    #[arg(value_name = "INPUT")]
    input: PathBuf,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanRequest {
    src_pages: Vec<u64>,
    dst_pages: Vec<u64>,
    page_size: u64,
    dcp_size: u64,
    dcp_rank: u64,
    #[serde(default)]
    src_page_offset: u64,
    #[serde(default)]
    decode_prefix_len: u64,
    #[serde(default)]
    num_kv_tokens: Option<u64>,
}

#[derive(Debug, Serialize)]
struct PlanResponse {
    target_src: Vec<u64>,
    target_dst: Vec<u64>,
    draft_src: Vec<u64>,
    draft_dst: Vec<u64>,
    target_runs: Vec<[u64; 3]>,
}

fn read_input(path: &PathBuf) -> Result<String, String> {
    if path.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| format!("cannot read standard input: {e}"))?;
        Ok(text)
    } else {
        std::fs::read_to_string(path).map_err(|e| {
            format!(
                "cannot read {}: {e}; pass a JSON file or - for stdin",
                path.display()
            )
        })
    }
}

fn plan(args: &PlanArgs) -> Result<String, String> {
    let text = read_input(&args.input)?;
    let req: PlanRequest =
        serde_json::from_str(&text).map_err(|e| format!("invalid plan input: {e}"))?;
    // SGLang's interface counts the chunk offset in pages; the planner counts tokens.
    let chunk_start = req
        .src_page_offset
        .checked_mul(req.page_size)
        .ok_or_else(|| {
            GeometryError::Overflow {
                what: "src_page_offset x page_size",
            }
            .to_string()
        })?;
    let input = DcpPlanInput {
        src_pages: &req.src_pages,
        dst_pages: SendPages::after_prefix(&req.dst_pages),
        page_size: req.page_size,
        dcp_size: req.dcp_size,
        dcp_rank: req.dcp_rank,
        chunk_start,
        decode_prefix_len: req.decode_prefix_len,
        num_kv_tokens: req.num_kv_tokens,
    };
    let plan = input.plan().map_err(|e| e.to_string())?;
    let tokens = plan.to_token_plan();
    let response = PlanResponse {
        target_runs: plan
            .target_runs()
            .map(|r| [r.src_start, r.dst_start, r.len])
            .collect(),
        target_src: tokens.target_src,
        target_dst: tokens.target_dst,
        draft_src: tokens.draft_src,
        draft_dst: tokens.draft_dst,
    };
    serde_json::to_string(&response).map_err(|e| format!("cannot encode the plan: {e}"))
}

pub(crate) fn run(args: PlanArgs) -> ExitCode {
    match plan(&args) {
        Ok(json) => {
            let mut out = std::io::stdout().lock();
            if writeln!(out, "{json}").and_then(|()| out.flush()).is_err() {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("kvbridge plan: {message}");
            ExitCode::from(2)
        }
    }
}
