//! `kvbridge check PREFILL.json DECODE.json`: every compatibility problem at once, or the rank
//! mapping.
//!
//! Exit codes: 0 compatible (mapping printed), 1 incompatible (every problem printed with code,
//! message and remedy), 2 a file cannot be read or parsed (which file, line and column).

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use kvbridge_handshake::{
    CheckOptions, Compat, HandshakeError, PeerDescriptor, PoolKind, Problem, ProblemCode,
    RankMapping, RankReport, Report, check_all_ranks, check_with,
};
use serde_json::{Value, json};

/// Arguments of `kvbridge check`.
#[derive(Debug, clap::Args)]
pub(crate) struct CheckArgs {
    /// The prefill rank's descriptor (JSON `PeerDescriptor`).
    prefill: PathBuf,
    /// The decode rank's descriptor (JSON `PeerDescriptor`).
    decode: PathBuf,
    /// Print one JSON object: {"compatible", "problems": [{"code","message","remedy"}],
    /// "mapping": {..} | null, "warnings"} (with --all-ranks also "ranks").
    #[arg(long)]
    json: bool,
    /// Check every rank of the decode deployment (varying attn_tp_rank, pp_rank and dcp_rank)
    /// and report per rank.
    #[arg(long)]
    all_ranks: bool,
    /// Which setups to accept: what kvbridge's planner supports, or exactly SGLang 0.5.23's.
    #[arg(long, value_enum, default_value_t = CompatArg::Kvbridge)]
    compat: CompatArg,
    /// The decode pulls KV from every prefill CP rank
    /// (SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER).
    #[arg(long)]
    all_cp_ranks: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CompatArg {
    /// Everything kvbridge's planner supports (any DCP sizes for MLA, different page sizes).
    Kvbridge,
    /// Exactly what SGLang 0.5.23 accepts, refused with SGLang's texts.
    Sglang,
}

pub(crate) fn run(args: CheckArgs) -> ExitCode {
    let prefill = match load(&args.prefill, "PREFILL") {
        Ok(d) => d,
        Err(msg) => return input_error(&msg),
    };
    let decode = match load(&args.decode, "DECODE") {
        Ok(d) => d,
        Err(msg) => return input_error(&msg),
    };
    let compat = match args.compat {
        CompatArg::Kvbridge => Compat::Kvbridge,
        CompatArg::Sglang => Compat::Sglang,
    };
    let options = CheckOptions::new(compat).with_all_cp_ranks_transfer(args.all_cp_ranks);

    let compatible = if args.all_ranks {
        let ranks = check_all_ranks(&prefill, &decode, &options);
        let own = check_with(&prefill, &decode, &options);
        let ok = ranks.iter().all(|r| r.report.is_compatible()) && own.is_compatible();
        if args.json {
            print_json(&all_ranks_json(&own, &ranks, ok, compat));
        } else {
            print!(
                "{}",
                all_ranks_text(&args, &prefill, &decode, &ranks, ok, compat)
            );
        }
        ok
    } else {
        let report = check_with(&prefill, &decode, &options);
        if args.json {
            print_json(&report_json(&report, compat));
        } else {
            print!("{}", report_text(&args, &prefill, &decode, &report, compat));
        }
        report.is_compatible()
    };
    if compatible {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn input_error(msg: &str) -> ExitCode {
    eprintln!("kvbridge check: {msg}");
    ExitCode::from(2)
}

fn load(path: &Path, which: &str) -> Result<PeerDescriptor, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the {which} file {}: {e}", path.display()))?;
    PeerDescriptor::from_json(&text).map_err(|e| match e {
        HandshakeError::Json {
            line,
            column,
            message,
        } => format!(
            "cannot parse the {which} file {} at line {line}, column {column}: {message}; \
             see docs/errors.md (\"Descriptor format\") for the fields",
            path.display()
        ),
        other => format!("cannot use the {which} file {}: {other}", path.display()),
    })
}

fn print_json(v: &Value) {
    // Serialising a `Value` cannot fail.
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

fn problem_json(p: &Problem) -> Value {
    json!({"code": p.code.as_str(), "message": p.message, "remedy": p.remedy})
}

fn mapping_json(m: Option<&RankMapping>) -> Value {
    m.map_or(Value::Null, |m| {
        serde_json::to_value(m).unwrap_or(Value::Null)
    })
}

fn report_json(r: &Report, compat: Compat) -> Value {
    json!({
        "compatible": r.is_compatible(),
        "problems": r.problems.iter().map(problem_json).collect::<Vec<_>>(),
        "mapping": mapping_json(r.mapping.as_ref()),
        "warnings": r.warnings.iter().map(problem_json).collect::<Vec<_>>(),
        "compat": compat.as_str(),
        "prefill_fingerprint": r.prefill_fingerprint.to_string(),
        "decode_fingerprint": r.decode_fingerprint.to_string(),
    })
}

/// Problems of all ranks, deduplicated, with the decode TP/PP ranks each one affects, in
/// order of first appearance (indexed by code and message: linear in the problems listed).
fn union(ranks: &[RankReport], warnings: bool) -> Vec<(&Problem, Vec<(u32, u32)>)> {
    let mut out: Vec<(&Problem, Vec<(u32, u32)>)> = Vec::new();
    let mut index: HashMap<(ProblemCode, &str), usize> = HashMap::new();
    for r in ranks {
        let list = if warnings {
            &r.report.warnings
        } else {
            &r.report.problems
        };
        for p in list {
            let rank = (r.decode_tp_rank, r.decode_pp_rank);
            match index.entry((p.code, p.message.as_str())) {
                Entry::Occupied(i) => out[*i.get()].1.push(rank),
                Entry::Vacant(v) => {
                    v.insert(out.len());
                    out.push((p, vec![rank]));
                }
            }
        }
    }
    out
}

fn all_ranks_json(own: &Report, ranks: &[RankReport], ok: bool, compat: Compat) -> Value {
    let per_rank: Vec<Value> = ranks
        .iter()
        .map(|r| {
            json!({
                "decode_tp_rank": r.decode_tp_rank,
                "decode_pp_rank": r.decode_pp_rank,
                "decode_dcp_rank": r.decode_dcp_rank,
                "compatible": r.report.is_compatible(),
                "problems": r.report.problems.iter().map(problem_json).collect::<Vec<_>>(),
                "warnings": r.report.warnings.iter().map(problem_json).collect::<Vec<_>>(),
                "mapping": mapping_json(r.report.mapping.as_ref()),
            })
        })
        .collect();
    // The descriptor's own problems, then each rank's, once each (what `problem_json` shows).
    let mut listed: HashSet<(ProblemCode, &str, &str)> = HashSet::new();
    let problems: Vec<Value> = own
        .problems
        .iter()
        .chain(union(ranks, false).into_iter().map(|(p, _)| p))
        .filter(|p| listed.insert((p.code, p.message.as_str(), p.remedy.as_str())))
        .map(problem_json)
        .collect();
    let warnings: Vec<Value> = union(ranks, true)
        .into_iter()
        .map(|(p, _)| problem_json(p))
        .collect();
    json!({
        "compatible": ok,
        "problems": problems,
        "mapping": mapping_json(own.mapping.as_ref()),
        "warnings": warnings,
        "compat": compat.as_str(),
        "ranks": per_rank,
    })
}

fn pool(k: PoolKind) -> &'static str {
    match k {
        PoolKind::Mha => "MHA/GQA",
        PoolKind::Mla => "MLA",
        PoolKind::HybridMla => "hybrid MLA",
    }
}

fn describe(d: &PeerDescriptor) -> String {
    let mut s = format!("{} pool, attn TP {}", pool(d.kv_pool), d.attn_tp_size);
    if d.attn_cp_size != 1 {
        s.push_str(&format!(", CP {}", d.attn_cp_size));
    }
    if d.pp_size != 1 {
        s.push_str(&format!(", PP {}", d.pp_size));
    }
    if d.dcp_size != 1 {
        s.push_str(&format!(", DCP {}", d.dcp_size));
    }
    if let Some(h) = d.total_kv_heads {
        s.push_str(&format!(", {h} KV heads"));
    }
    s.push_str(&format!(
        ", page {}, dtype {}, {} KV entries",
        d.page_size,
        d.kv_cache_dtype,
        d.kv_item_lens.len()
    ));
    if d.num_draft_entries > 0 {
        s.push_str(&format!(" ({} draft)", d.num_draft_entries));
    }
    s
}

fn problems_text(out: &mut String, problems: &[Problem], heading: &str) {
    if problems.is_empty() {
        return;
    }
    out.push_str(&format!("\n{heading}:\n"));
    for p in problems {
        out.push_str(&format!("\n{} {}\n", p.code, p.code.info().title));
        out.push_str(&format!("  {}\n", p.message.trim_end()));
        if !p.values.is_empty() {
            let seen: Vec<String> = p.values.iter().map(|(k, v)| format!("{k}={v}")).collect();
            out.push_str(&format!("  seen: {}\n", seen.join(", ")));
        }
        out.push_str(&format!("  fix:  {}\n", p.remedy));
    }
}

fn list(v: &[u32]) -> String {
    let items: Vec<String> = v.iter().map(u32::to_string).collect();
    format!("[{}]", items.join(", "))
}

fn mapping_text(out: &mut String, m: &RankMapping) {
    out.push_str(&format!("\ntransfer path: {}\n", m.path.describe()));
    if m.decode_dcp_size > 1 || m.prefill_dcp_size > 1 {
        out.push_str(&format!(
            "DCP: prefill DCP {} -> decode DCP {} (this decode rank is DCP rank {}); decode virtual page \
             {} tokens: decode prefixes must be multiples of it (else KVB-E040 from the planner)\n",
            m.prefill_dcp_size, m.decode_dcp_size, m.decode_dcp_rank, m.decode_virtual_page_size
        ));
        let mut from: Vec<u32> = m.senders().map(|s| s.dcp_rank).collect();
        from.sort_unstable();
        from.dedup();
        out.push_str(&format!(
            "owner rule: prefill DCP rank a_r holds positions p with p mod {} == a_r; this decode rank \
             needs p mod {} == {}, so it reads from prefill DCP rank{} {}\n",
            m.prefill_dcp_size,
            m.decode_dcp_size,
            m.decode_dcp_rank,
            if from.len() == 1 { "" } else { "s" },
            list(&from)
        ));
    }
    out.push_str(&format!(
        "\nrank mapping for decode attn_tp_rank {}, pp_rank {}:\n",
        m.decode_tp_rank, m.decode_pp_rank
    ));
    let tp = m
        .target_tp_rank
        .map_or_else(|| "None (all real)".to_owned(), |t| t.to_string());
    for (k, v) in [
        ("target_tp_rank", tp),
        ("target_tp_ranks", list(&m.target_tp_ranks)),
        ("target_cp_ranks", list(&m.target_cp_ranks)),
        ("target_pp_ranks", list(&m.target_pp_ranks)),
        ("required_dst_info_num", m.required_dst_info_num.to_string()),
        (
            "required_prefill_response_num",
            m.required_prefill_response_num.to_string(),
        ),
    ] {
        out.push_str(&format!("  {k:<30} {v}\n"));
    }
    out.push_str("  bootstrap peers, in registration order:\n");
    for p in &m.peers {
        let heads = p.head_slice.map_or_else(String::new, |h| {
            format!(
                ", its heads {}..{} -> decode heads {}..{}",
                h.src_head_start,
                h.src_head_start + h.num_heads,
                h.dst_head_start,
                h.dst_head_start + h.num_heads
            )
        });
        out.push_str(&format!(
            "    prefill tp {} cp {} pp {}  (status id {}, DCP rank {}, required_dst_info_num {}){heads}  {}\n",
            p.tp_rank,
            p.cp_rank,
            p.pp_rank,
            p.unique_rank,
            p.dcp_rank,
            p.required_dst_info_num,
            if p.is_dummy { "dummy: metadata only, sends nothing" } else { "sends KV" }
        ));
    }
}

fn header(args: &CheckArgs, p: &PeerDescriptor, d: &PeerDescriptor, compat: Compat) -> String {
    format!(
        "prefill  {}: {}\ndecode   {}: {}\ncompat   {}\n",
        args.prefill.display(),
        describe(p),
        args.decode.display(),
        describe(d),
        compat.as_str()
    )
}

fn report_text(
    args: &CheckArgs,
    p: &PeerDescriptor,
    d: &PeerDescriptor,
    r: &Report,
    compat: Compat,
) -> String {
    let mut out = header(args, p, d, compat);
    if let Some(m) = &r.mapping {
        out.push_str(&format!(
            "\nCOMPATIBLE  (fingerprints: prefill {}, decode {})\n",
            r.prefill_fingerprint, r.decode_fingerprint
        ));
        mapping_text(&mut out, m);
    } else {
        let n = r.problems.len();
        out.push_str(&format!(
            "\nINCOMPATIBLE: {n} problem{}\n",
            if n == 1 { "" } else { "s" }
        ));
        problems_text(&mut out, &r.problems, "problems");
    }
    problems_text(&mut out, &r.warnings, "warnings");
    if !r.problems.is_empty() || !r.warnings.is_empty() {
        out.push_str("\nRun `kvbridge explain CODE` for what a code means and how to fix it.\n");
    }
    out
}

fn ranks_str(rs: &[(u32, u32)], pp_size: u32) -> String {
    let items: Vec<String> = rs
        .iter()
        .map(|(tp, pp)| {
            if pp_size > 1 {
                format!("tp {tp} pp {pp}")
            } else {
                format!("{tp}")
            }
        })
        .collect();
    items.join(", ")
}

fn all_ranks_text(
    args: &CheckArgs,
    p: &PeerDescriptor,
    d: &PeerDescriptor,
    ranks: &[RankReport],
    ok: bool,
    compat: Compat,
) -> String {
    let mut out = header(args, p, d, compat);
    let good = ranks.iter().filter(|r| r.report.is_compatible()).count();
    out.push_str(&format!(
        "\n{} of {} decode ranks compatible{}\n\n",
        good,
        ranks.len(),
        if ok { "" } else { ": INCOMPATIBLE" }
    ));
    for r in ranks {
        let mut who = format!("decode tp {} pp {}", r.decode_tp_rank, r.decode_pp_rank);
        if d.dcp_size > 1 {
            who.push_str(&format!(" (DCP rank {})", r.decode_dcp_rank));
        }
        match &r.report.mapping {
            Some(m) => {
                let senders: Vec<u32> = m.senders().map(|s| s.tp_rank).collect();
                let dummies: Vec<u32> = m
                    .peers
                    .iter()
                    .filter(|s| s.is_dummy)
                    .map(|s| s.tp_rank)
                    .collect();
                let mut line = format!(
                    "  {who}: ok  prefill tp {} cp {} pp {}, senders {}",
                    list(&m.target_tp_ranks),
                    list(&m.target_cp_ranks),
                    list(&m.target_pp_ranks),
                    list(&dedup(senders))
                );
                if !dummies.is_empty() {
                    line.push_str(&format!(", dummies {}", list(&dedup(dummies))));
                }
                line.push_str(&format!(
                    ", dst_info {}, responses {}\n",
                    m.required_dst_info_num, m.required_prefill_response_num
                ));
                out.push_str(&line);
            }
            None => {
                let codes: Vec<String> = r
                    .report
                    .problems
                    .iter()
                    .map(|p| p.code.to_string())
                    .collect();
                out.push_str(&format!(
                    "  {who}: INCOMPATIBLE  {}\n",
                    dedup_str(codes).join(", ")
                ));
            }
        }
    }
    if let Some(m) = ranks.iter().find_map(|r| r.report.mapping.as_ref()) {
        out.push_str(&format!("\ntransfer path: {}\n", m.path.describe()));
    }
    for (heading, warnings) in [("problems", false), ("warnings", true)] {
        let items = union(ranks, warnings);
        if items.is_empty() {
            continue;
        }
        out.push_str(&format!("\n{heading}:\n"));
        for (p, rs) in items {
            let scope = if rs.len() == ranks.len() {
                "all decode ranks".to_owned()
            } else {
                format!("decode ranks {}", ranks_str(&rs, d.pp_size))
            };
            out.push_str(&format!("\n{} {} ({scope})\n", p.code, p.code.info().title));
            out.push_str(&format!("  {}\n", p.message.trim_end()));
            out.push_str(&format!("  fix:  {}\n", p.remedy));
        }
    }
    let mut by_prefill: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for r in ranks {
        if let Some(m) = &r.report.mapping {
            for s in m.senders() {
                by_prefill
                    .entry(s.tp_rank)
                    .or_default()
                    .push(r.decode_tp_rank);
            }
        }
    }
    if !by_prefill.is_empty() && ok {
        out.push_str("\nwho sends to whom (prefill tp -> decode tp):\n");
        for (t, ds) in by_prefill {
            out.push_str(&format!("  {t} -> {}\n", list(&dedup(ds))));
        }
    }
    out
}

fn dedup(mut v: Vec<u32>) -> Vec<u32> {
    v.sort_unstable();
    v.dedup();
    v
}

fn dedup_str(v: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in v {
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}
