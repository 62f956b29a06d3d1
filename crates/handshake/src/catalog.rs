//! The problem catalog: one table behind `kvbridge explain` and `docs/errors.md`, and the
//! lookups into it.

use crate::problem::DetectedBy::{Check, CheckSglangOnly, NotChecked, Planner};
use crate::problem::Severity::{Error, Warning};
use crate::problem::{ProblemCode, ProblemCode as C, ProblemInfo, Severity};

// The lookups live beside the table, so the problem types need nothing from this file.
impl ProblemCode {
    /// The catalog entry of this code.
    pub fn info(self) -> &'static ProblemInfo {
        // Every variant has exactly one entry (tested), so the fallback is unreachable in
        // practice; it keeps this function total without a panic.
        CATALOG
            .iter()
            .find(|i| i.code == self)
            .unwrap_or(&CATALOG[0])
    }

    /// Look a code up by its string form (case-insensitive; `E007` and `7` are accepted too).
    pub fn parse(text: &str) -> Option<ProblemCode> {
        let t = text.trim().to_ascii_uppercase();
        let t = t.strip_prefix("KVB-").unwrap_or(&t);
        let (letter, digits) = match t.chars().next()? {
            c @ ('E' | 'W') => (c, &t[1..]),
            _ => ('E', t),
        };
        if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        let id = format!("KVB-{letter}{:03}", digits.parse::<u32>().ok()?);
        CATALOG.iter().find(|i| i.id == id).map(|i| i.code)
    }
}

/// Every catalog entry, in code order.
pub fn catalog() -> &'static [ProblemInfo] {
    CATALOG
}

/// Look up one entry by its string form (see [`ProblemCode::parse`]).
pub fn explain(code: &str) -> Option<&'static ProblemInfo> {
    ProblemCode::parse(code).map(ProblemCode::info)
}

/// The whole catalog as Markdown: exactly the content of `docs/errors.md`.
pub fn catalog_markdown() -> String {
    let mut out = String::from(DOC_HEADER);
    out.push_str("\n## Index\n\n| code | severity | title |\n|---|---|---|\n");
    for i in CATALOG {
        out.push_str(&format!(
            "| [{}](#{}) | {} | {} |\n",
            i.id,
            anchor(i),
            match i.severity {
                Severity::Error => "error",
                Severity::Warning => "warning",
            },
            i.title
        ));
    }
    for i in CATALOG {
        out.push('\n');
        out.push_str(&i.to_markdown());
    }
    out
}

/// GitHub-style anchor of an entry's heading.
fn anchor(i: &ProblemInfo) -> String {
    let heading = format!("{} — {}", i.id, i.title);
    let mut out = String::new();
    for c in heading.chars() {
        if c.is_alphanumeric() {
            out.extend(c.to_lowercase());
        } else if c == ' ' || c == '-' {
            out.push('-');
        } else if c == '_' {
            out.push('_');
        }
    }
    out
}

/// The part of `docs/errors.md` before the entries.
pub(crate) const DOC_HEADER: &str = r#"# kvbridge problem catalog

<!-- Generated from `kvbridge_handshake::catalog()`; do not edit by hand. Regenerate with
     `KVBRIDGE_BLESS=1 cargo test -p kvbridge-handshake --test errors_doc`. -->

`kvbridge check PREFILL.json DECODE.json` compares what a prefill rank and a decode rank
advertise and lists **every** problem at once, each with a stable code. `kvbridge explain CODE`
prints the entry below for one code (`kvbridge explain KVB-E007`, `explain E7` works too).

Codes `KVB-E001`–`KVB-E018` are checks SGLang 0.5.23 performs itself (E001–E012 numbered after
the order its decode side runs them), with SGLang's message word for word;
`KVB-E020`–`KVB-E033` catch setups SGLang lets through but that fail later (a hang, a 404, a
dead control thread, an allocation of a peer-claimed size) or silently corrupt the KV cache;
`KVB-E040`–`KVB-E042` are raised by the planner per request; `KVB-Wnnn` are warnings (the
pair is still accepted). Every planner error ends with its code in parentheses, e.g.
`... (KVB-E041)`; errors about sizes, ranks or item lengths carry the code of the matching
`check` problem (`KVB-E021`, `KVB-E022`, `KVB-E027`, ...).

## Descriptor format

Each file holds one `PeerDescriptor` (JSON); omitted optional fields take the defaults below.

Versions (`protocol_version`, `MAJOR.MINOR`): a newer minor version only adds optional fields
whose defaults keep the old meaning; a newer major version may change what fields mean.
So a descriptor is read by these rules, wherever it arrives (a file, a control message, a
bootstrap registration):

- same or older minor version: unknown fields are refused (`invalid peer descriptor ...
  unknown field`), so a typo is never silently ignored;
- newer minor version of the same major: the fields this build knows are read, the others are
  ignored and reported as the warning `KVB-W003` (the pair is still accepted);
- newer major version: refused before any field is read (`peer descriptor uses
  protocol_version 2.0, but this kvbridge speaks protocol 1.0 ... upgrade kvbridge`), and a
  pair whose majors differ is `KVB-E032`.

| field | type | default | meaning |
|---|---|---|---|
| `role` | `"prefill"` \| `"decode"` | required | which side this rank is |
| `protocol_version` | `"MAJOR.MINOR"` | `"1.0"` | see the version rules above |
| `page_size` | integer | required | physical KV page size in tokens (`--page-size`) |
| `kv_cache_dtype` | string | required | `--kv-cache-dtype`, compared as a string |
| `kv_layout` | string or null | `null` | KV layout name |
| `kv_pool` | `"mha"` \| `"mla"` \| `"hybrid_mla"` | required | pool kind (MHA covers GQA) |
| `attn_tp_size` | integer | required | attention TP size |
| `attn_tp_rank` | integer | `0` | this rank's attention TP rank |
| `attn_cp_size` / `attn_cp_rank` | integer | `1` / `0` | attention context parallelism (decode: 1) |
| `pp_size` / `pp_rank` | integer | `1` / `0` | pipeline parallelism |
| `dcp_size` / `dcp_rank` | integer | `1` / `0` | decode context parallelism, nested in TP: `dcp_rank = attn_tp_rank mod dcp_size` |
| `kv_cache_sharding` | bool | `false` | `--enable-kv-cache-sharding` |
| `total_kv_heads`, `head_dim` | integer | none | required for `"mha"` |
| `kv_item_lens` | list of integers | required | bytes per page of every KV entry, target entries then draft entries |
| `num_draft_entries` | integer | `0` | how many of the last entries are speculative-decoding draft entries |
| `aux_item_lens` | list of integers | `[]` | bytes per row of every aux (metadata) buffer |

In Rust, `PeerDescriptor::mla(role, page_size, layers, token_bytes)`,
`PeerDescriptor::mha(role, page_size, layers, total_kv_heads, head_dim)` and
`PeerDescriptor::builder(role)` build the same descriptor with the defaults above (and
`kv_cache_dtype "auto"`); `build` refuses a missing required value, a size of 0, a rank not
below its size or a DCP size that does not divide the TP size with `cannot build the peer
descriptor: <what>; <the call that fixes it>`.

Descriptors come from peers, so every size and count is bounded before `check` works with it;
a value above its maximum is `KVB-E033`. The maxima are far above any real deployment:

| field | maximum |
|---|---|
| `page_size` | 1,048,576 tokens (2^20) |
| `attn_tp_size`, `attn_cp_size`, `pp_size`, `dcp_size` | 1,024 ranks each |
| `attn_tp_size` x `attn_cp_size` x `pp_size` | 65,536 ranks (2^16) |
| `total_kv_heads`, `head_dim` | 65,536 (2^16) |
| `kv_item_lens` | 4,096 entries, each at most 2^40 bytes |
| `aux_item_lens` | 64 buffers, each at most 2^40 bytes |

## Compatibility modes

`kvbridge check --compat kvbridge` (the default) accepts everything kvbridge's planner supports:
every SGLang setup, plus any prefill DCP size `a` with any decode DCP size `b` for MLA and
hybrid-MLA pools (owner rule: prefill DCP rank `a_r` sends to decode DCP rank `b_r` iff
`a_r ≡ b_r (mod gcd(a, b))`), and different physical page sizes on the two sides. For GQA/MHA
pools whose prefill TP exceeds both the decode TP and the KV head count, it reads each KV head
from one prefill replica instead of all of them (SGLang reads every replica).
`--compat sglang` accepts exactly what SGLang 0.5.23 accepts and refuses the rest with
SGLang's text (`KVB-E001`, `KVB-E013`, `KVB-E014`). Both modes refuse what cannot work.

## Out of scope

These SGLang checks need fields a `PeerDescriptor` does not carry; kvbridge does not invent
them. Their codes are reserved (`KVB-E003`, `KVB-E005`, `KVB-E006`) and explained below.

- MiniMax sparse PD index state (`KVB-E003`), DeepSeek-V4.1 DSpark layouts (`KVB-E005`),
  MXFP8 block-scale state types (`KVB-E006`).
- State pools (Mamba, SWA, DSA) and their head-sliced layouts, `kv_layer_ids` pairing,
  DeepSeek-V4 compressed-MLA grouped layouts.
- Per-request checks of the transfer lifecycle, on the decode and on the prefill: decode
  allocation policy, `follow_bootstrap_room` DP routing, bootstrap lookups and send failures.
  These are runtime failures of one request, not properties of two descriptors.

## Transfer failure causes

A failed room (`kvbridge-coordinator`) carries one cause, printed as `[cause: NAME; peer: ..]`
and counted in `failures_by_cause`. When a prefill room fails, the prefill tells the decode in a
Failed status carrying its cause, and the decode reports that same cause, with one exception:
an abort is `aborted` only on the side whose caller aborted, and `remote_failure` on the other.

| cause | meaning |
|---|---|
| `bootstrap_timeout` | the prefill room stayed in Bootstrapping past the bootstrap timeout, or the decode could not finish the handshake in time |
| `waiting_timeout` | no Success (decode) or no last chunk (prefill) within the waiting timeout |
| `batch_timeout` | a transport batch did not complete by its deadline |
| `transfer_error` | a transport batch failed |
| `peer_rejected` | the peer's descriptor is incompatible (the message lists every problem) |
| `peer_lost` | the heartbeat declared the peer dead |
| `aborted` | this side's caller aborted the room (`abort`, or `clear` before the transfer ended) |
| `remote_failure` | the peer aborted or failed the room (a decode ABORT, seen on the prefill; a prefill abort, seen on the decode) |
| `control_channel` | a control message could not be delivered |
| `unregistered` | the prefill does not know this decode's registration (it restarted) |
| `planning` | the transfer could not be planned (the message ends with the planner's problem code, e.g. `KVB-E041`) |
| `duplicate_room` | two uses of the same room id collided |
| `other_rank` | another rank of the request failed (cross-rank agreement) |
| `shutdown` | the agent shut down |

Aborts, in both directions:

| who aborts | the initiator reports | the peer reports |
|---|---|---|
| decode (`DecodeAgent::abort`, or a decode-side failure after its metadata went out) | `aborted` (or that failure's cause) | `remote_failure`, `Aborted by decode ENDPOINT: REASON` |
| prefill (`PrefillAgent::abort`) | `aborted` | `remote_failure`, `Aborted by prefill ENDPOINT: Aborted by AbortReq.` |
"#;

/// Every entry, in code order. `ProblemCode::info` finds entries here.
pub(crate) static CATALOG: &[ProblemInfo] = &[
    ProblemInfo {
        code: C::PageSizeMismatch,
        id: "KVB-E001",
        title: "Page size mismatch",
        severity: Error,
        detected_by: CheckSglangOnly,
        sglang: "refuses it (decode side, `try_ensure_parallel_info`, before the first request) with this text",
        message: "Page size mismatch: prefill server has page_size={p}, but decode server has page_size={d}. Both servers must use the same --page-size value.",
        meaning: "The two servers allocate their KV pools in pages of different sizes. SGLang's page path copies whole pages and uses the prefill's bytes per page as the decode's stride, so it cannot move KV between different page sizes. kvbridge's planner moves rows instead of pages when the sizes differ, so the default `--compat kvbridge` mode accepts the pair (transfer path `rows`) and only `--compat sglang` reports this problem.",
        when: "The servers were started with different `--page-size` values, or one side uses its backend's default page size. Under DCP the decode's *virtual* page is `page_size x dcp_size`; only the physical `page_size` must match.",
        fix: "Start both servers with the same physical `--page-size`.\nDo not scale `--page-size` by the DCP size on the decode: the virtual page is derived.\nOr keep the sizes and use kvbridge's default mode, whose planner relays rows between different page sizes.",
        example: "# before\nprefill: --page-size 16       decode: --page-size 64\n# after\nprefill: --page-size 64       decode: --page-size 64",
    },
    ProblemInfo {
        code: C::DtypeMismatch,
        id: "KVB-E002",
        title: "KV cache dtype mismatch",
        severity: Error,
        detected_by: Check,
        sglang: "refuses it (decode side, before the first request) with this text",
        message: "KV cache dtype mismatch: prefill server has kv_cache_dtype={p}, but decode server has kv_cache_dtype={d}. Both servers must use the same --kv-cache-dtype value.",
        meaning: "KV bytes are copied verbatim, never converted. A decode that reads fp8 bytes written as bf16 (or the reverse) computes attention over garbage.",
        when: "`--kv-cache-dtype` differs (e.g. `fp8_e4m3` on one side, `auto` on the other), often after enabling FP8 KV on only one role.",
        fix: "Start both servers with the same `--kv-cache-dtype`.\nIf you want FP8 KV, enable it on prefill and decode together.",
        example: "# before\nprefill: --kv-cache-dtype fp8_e4m3   decode: --kv-cache-dtype auto\n# after\nprefill: --kv-cache-dtype fp8_e4m3   decode: --kv-cache-dtype fp8_e4m3",
    },
    ProblemInfo {
        code: C::MiniMaxTp,
        id: "KVB-E003",
        title: "MiniMax sparse PD with different TP sizes (not checked)",
        severity: Error,
        detected_by: NotChecked,
        sglang: "refuses it on the decode side when the decode holds MiniMax index state and the attention TP sizes differ",
        message: "MiniMax sparse PD requires matching attention TP sizes: prefill={p}, decode={d}.",
        meaning: "MiniMax sparse attention keeps an index state per TP rank that cannot be resliced between TP sizes. A `PeerDescriptor` does not say whether a pool carries that state, so kvbridge does not check this; the code is reserved so the SGLang message can be looked up.",
        when: "Serving a MiniMax sparse-attention model with different attention TP sizes on prefill and decode.",
        fix: "Use the same attention TP size on both servers for MiniMax sparse models.",
        example: "# before\nprefill: --tp 4   decode: --tp 8\n# after\nprefill: --tp 8   decode: --tp 8",
    },
    ProblemInfo {
        code: C::LayoutMismatch,
        id: "KVB-E004",
        title: "KV layout mismatch",
        severity: Error,
        detected_by: Check,
        sglang: "refuses it (decode side) when both layouts are set and differ; a layout set on one side only is accepted",
        message: "KV layout mismatch: prefill server has kv_layout={p}, but decode server has kv_layout={d}. Both servers must use the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT.",
        meaning: "The servers arrange the bytes of a KV page differently, so a verbatim copy would scramble them.",
        when: "`--dsv4-attn-backend` or `SGLANG_DSV4_KV_LAYOUT` differ between the roles.",
        fix: "Use the same `--dsv4-attn-backend` and `SGLANG_DSV4_KV_LAYOUT` on both servers.\nExport both descriptors again after the change.",
        example: "# before\nprefill: \"kv_layout\": \"paged_nhd\"   decode: \"kv_layout\": \"paged_hnd\"\n# after\nprefill: \"kv_layout\": \"paged_nhd\"   decode: \"kv_layout\": \"paged_nhd\"",
    },
    ProblemInfo {
        code: C::Dspark,
        id: "KVB-E005",
        title: "DeepSeek-V4.1 DSpark layout or TP mismatch (not checked)",
        severity: Error,
        detected_by: NotChecked,
        sglang: "refuses differing DSpark layouts, and DSpark with different TP sizes (except an MLA prefill with CP whose TP x CP equals the decode TP)",
        message: "DeepSeek-V4.1 DSpark PD layout mismatch ({fields}): both servers must enable DSpark with the same block size and target/draft KV layout. Upgrade both servers together.\nDeepSeek-V4.1 DSpark PD requires the same TP size on both servers (including prefill CP ranks for MLA)",
        meaning: "DSpark stores draft and target KV in a block layout whose parameters must agree. Descriptors do not carry the DSpark layout, so kvbridge does not check this; the code is reserved.",
        when: "Only one role enables DSpark, the block sizes differ, or the servers run different SGLang versions.",
        fix: "Enable DSpark with the same block size and target/draft layout on both servers.\nUse equal TP sizes (prefill TP x CP equal to decode TP for MLA with prefill CP).\nUpgrade both servers together.",
        example: "# before\nprefill: DSpark block 64   decode: DSpark off\n# after\nprefill: DSpark block 64   decode: DSpark block 64",
    },
    ProblemInfo {
        code: C::Mxfp8Tp,
        id: "KVB-E006",
        title: "MXFP8 KV cache with different TP sizes (not checked)",
        severity: Error,
        detected_by: NotChecked,
        sglang: "refuses it on the decode side for non-MLA pools with block-scale states",
        message: "PD Disaggregation does NOT support different attention TP sizes with MXFP8 KV cache: prefill attn_tp_size={p}, decode attn_tp_size={d}, state types {list}.",
        meaning: "MXFP8 keeps per-block scales that cannot be head-sliced between TP sizes. Descriptors do not carry the state types, so kvbridge does not check this; the code is reserved.",
        when: "An MHA/GQA model with an MXFP8 KV cache and different attention TP sizes.",
        fix: "Use equal attention TP sizes with MXFP8 KV.\nOr use another `--kv-cache-dtype`.",
        example: "# before\nprefill: --tp 2 --kv-cache-dtype mxfp8   decode: --tp 4 --kv-cache-dtype mxfp8\n# after\nprefill: --tp 4 --kv-cache-dtype mxfp8   decode: --tp 4 --kv-cache-dtype mxfp8",
    },
    ProblemInfo {
        code: C::DcpNeedsMlaPool,
        id: "KVB-E007",
        title: "DCP requires an MLA or hybrid-MLA KV pool",
        severity: Error,
        detected_by: Check,
        sglang: "refuses a decode with DCP > 1 and an MHA/GQA pool (decode side, `try_ensure_parallel_info`) with this text; the prefill-side variant is kvbridge's",
        message: "PD decode DCP requires an MLA or hybrid-MLA KV pool.\nPD prefill DCP requires an MLA or hybrid-MLA KV pool.",
        meaning: "Decode context parallelism (DCP) splits a sequence across ranks by position: token `p` lives on rank `p mod dcp_size`. That works for MLA's single compressed latent vector per token, which is otherwise replicated on every TP rank. GQA/MHA KV is already split across TP ranks by heads, so a GQA/MHA pool cannot also be split by position; the configuration is rejected.",
        when: "A decode (or, in kvbridge, a prefill) runs with `--dcp-size 2` or more while serving a GQA/MHA model whose pool is neither MLA nor hybrid MLA. Typical cause: copying DCP flags from a DeepSeek (MLA) deployment onto a Llama/Qwen (GQA) deployment.",
        fix: "Start the server with `--dcp-size 1` for GQA/MHA models.\nUse DCP only with MLA models (DeepSeek V2/V3) or hybrid-MLA pools.\nCheck that the descriptor's `kv_pool` matches the model (`\"mla\"` for DeepSeek).",
        example: "# before\npython -m sglang.launch_server --model Qwen/Qwen2.5-7B-Instruct --disaggregation-mode decode --tp 4 --dcp-size 2\n# after\npython -m sglang.launch_server --model Qwen/Qwen2.5-7B-Instruct --disaggregation-mode decode --tp 4 --dcp-size 1\n# descriptor: \"dcp_size\": 2  ->  \"dcp_size\": 1",
    },
    ProblemInfo {
        code: C::DcpPrefillCp,
        id: "KVB-E008",
        title: "DCP requires prefill attention CP = 1",
        severity: Error,
        detected_by: Check,
        sglang: "refuses a decode with DCP > 1 against a prefill with attention CP > 1 with this text",
        message: "PD decode DCP currently requires prefill attention CP=1, got {p_cp}.\nPD prefill DCP requires prefill attention CP=1, got {p_cp}.",
        meaning: "With prefill context parallelism, each prefill CP rank holds a different part of the sequence; the DCP relayout assumes one prefill rank holds every position it sends. Combining the two is not implemented (SGLang) and not planned by kvbridge's planner.",
        when: "The prefill runs with attention CP > 1 (`attn_cp_size`) and the decode (or the prefill) uses DCP.",
        fix: "Start the prefill with attention CP 1 when DCP is used.\nOr drop DCP on the decode (`--dcp-size 1`).",
        example: "# before\nprefill: \"attn_cp_size\": 2      decode: \"dcp_size\": 4\n# after\nprefill: \"attn_cp_size\": 1      decode: \"dcp_size\": 4",
    },
    ProblemInfo {
        code: C::DcpPrefillSharding,
        id: "KVB-E009",
        title: "DCP with a prefill using KV-cache sharding",
        severity: Error,
        detected_by: Check,
        sglang: "refuses a decode with DCP > 1 against a prefill with `--enable-kv-cache-sharding` with this text",
        message: "PD decode DCP does not support a prefill with --enable-kv-cache-sharding.",
        meaning: "KV-cache sharding splits an MLA pool across prefill TP ranks by a rule of its own; the DCP relayout reads whole rows from a single prefill rank, so the two cannot be combined.",
        when: "The prefill was started with `--enable-kv-cache-sharding` and the decode (or, in kvbridge, the prefill) uses DCP.",
        fix: "Start the prefill without `--enable-kv-cache-sharding` when DCP is used.\nOr use `--dcp-size 1` on the decode.",
        example: "# before\nprefill: \"kv_cache_sharding\": true    decode: \"dcp_size\": 4\n# after\nprefill: \"kv_cache_sharding\": false   decode: \"dcp_size\": 4",
    },
    ProblemInfo {
        code: C::MlaShardingTp,
        id: "KVB-E010",
        title: "MLA KV-cache sharding requires equal TP sizes",
        severity: Error,
        detected_by: Check,
        sglang: "asserts it in the rank mapping (`_resolve_rank_mapping`); the assertion escapes the decode scheduler loop",
        message: "MLA KV cache sharding requires equal prefill/decode attn TP sizes, got prefill={p} decode={d}",
        meaning: "With an MLA pool and prefill KV-cache sharding (and prefill CP 1), every prefill TP rank holds a shard and every decode rank pulls from all of them; the shards only line up when both sides have the same attention TP size.",
        when: "The prefill runs `--enable-kv-cache-sharding` on an MLA model and the attention TP sizes differ.",
        fix: "Use the same attention TP size on both servers.\nOr start the prefill without `--enable-kv-cache-sharding`.",
        example: "# before\nprefill: --tp 2 --enable-kv-cache-sharding   decode: --tp 4\n# after\nprefill: --tp 4 --enable-kv-cache-sharding   decode: --tp 4",
    },
    ProblemInfo {
        code: C::DecodeCp,
        id: "KVB-E011",
        title: "Decode attention CP must be 1",
        severity: Error,
        detected_by: Check,
        sglang: "asserts it in the rank mapping",
        message: "Decode cp size ({d_cp}) should be equal to 1",
        meaning: "The decode side does not support attention context parallelism; splitting the decode KV by position is done by DCP, which lives inside attention TP.",
        when: "The decode descriptor has `attn_cp_size` > 1 (often copied from a prefill descriptor).",
        fix: "Start the decode with attention CP 1.\nUse `--dcp-size` to split the decode KV by position (MLA models only).",
        example: "# before\ndecode: \"attn_cp_size\": 2\n# after\ndecode: \"attn_cp_size\": 1, \"dcp_size\": 2",
    },
    ProblemInfo {
        code: C::PpMismatch,
        id: "KVB-E012",
        title: "Decode PP must equal prefill PP or be 1",
        severity: Error,
        detected_by: Check,
        sglang: "asserts it in the rank mapping",
        message: "Decode pp size ({d_pp}) should be equal to prefill pp size ({p_pp}) or 1",
        meaning: "Pipeline stages own layer ranges. A decode stage can receive from the prefill stage with the same layers (equal PP) or a single decode stage can receive from every prefill stage (decode PP 1); other splits would need layers re-cut across stages.",
        when: "Both sides are pipelined with different stage counts, e.g. prefill PP 4 and decode PP 2.",
        fix: "Use the prefill's PP size on the decode.\nOr run the decode without pipeline parallelism (PP 1).",
        example: "# before\nprefill: --pp-size 4   decode: --pp-size 2\n# after\nprefill: --pp-size 4   decode: --pp-size 4   (or --pp-size 1)",
    },
    ProblemInfo {
        code: C::DcpRankMismatch,
        id: "KVB-E013",
        title: "Mapped peers have different DCP ranks",
        severity: Error,
        detected_by: CheckSglangOnly,
        sglang: "refuses the registration on the prefill side (`requires_dcp_relayout`); the exception kills the prefill's control thread, so later requests time out",
        message: "PD peers must connect matching DCP ranks, got prefill={p}, decode={d}",
        meaning: "With equal DCP sizes SGLang uses the plain page path, which is only correct when the decode rank receives from a prefill rank with the same DCP rank (the same positions). SGLang maps decode TP rank r to prefill TP rank `r div (tp_d div tp_p)`, so with different attention TP sizes some decode ranks land on a prefill rank with a different DCP rank. kvbridge's default mode maps DCP ranks by the owner rule instead and accepts these pairs.",
        when: "Equal DCP sizes (> 1) on both sides but different attention TP sizes, or a decode whose `dcp_rank` is not `attn_tp_rank mod dcp_size`.",
        fix: "With equal DCP sizes use equal attention TP sizes, so decode rank r maps to prefill rank r.\nOr use kvbridge's default mode, which routes each decode DCP rank to the prefill ranks holding its positions.",
        example: "# before\nprefill: --tp 2 --dcp-size 2   decode: --tp 4 --dcp-size 2   (decode rank 1 -> prefill rank 0)\n# after\nprefill: --tp 4 --dcp-size 2   decode: --tp 4 --dcp-size 2",
    },
    ProblemInfo {
        code: C::DcpTopology,
        id: "KVB-E014",
        title: "Unsupported DCP topology",
        severity: Error,
        detected_by: CheckSglangOnly,
        sglang: "refuses the registration on the prefill side; the exception kills the prefill's control thread (requests then hang until timeout)",
        message: "Unsupported PD DCP topology: {p} -> {d}",
        meaning: "SGLang relays KV from a prefill without DCP to a DCP decode (MLA/hybrid-MLA pools only), or between equal DCP sizes with matching ranks. Everything else, e.g. prefill DCP 2 -> decode DCP 4, or DCP 4 -> 1, or prefill DCP 1 -> decode DCP 4 on an MHA pool, is unsupported. kvbridge's planner relays any prefill DCP a to any decode DCP b for MLA/hybrid-MLA pools (owner rule), so the default mode accepts those.",
        when: "The prefill and decode DCP sizes differ and the prefill is not `dcp_size 1` with an MLA/hybrid-MLA pool.",
        fix: "Run the prefill with DCP 1, or with the decode's DCP size.\nFor MHA/GQA models use `--dcp-size 1` on the decode.\nOr use kvbridge's default mode (MLA/hybrid-MLA pools).",
        example: "# before\nprefill: --dcp-size 2   decode: --dcp-size 4\n# after\nprefill: --dcp-size 1   decode: --dcp-size 4",
    },
    ProblemInfo {
        code: C::DcpEntryCount,
        id: "KVB-E015",
        title: "DCP relayout: entry counts differ",
        severity: Error,
        detected_by: Check,
        sglang: "refuses the registration on the prefill side (`prepare_dcp_token_item_lens`), killing its control thread",
        message: "PD DCP requires the decode to register one KV entry per prefill entry: src={N} (draft={nd}), dst={len}",
        meaning: "The DCP relayout writes each prefill entry (layer, then draft layer) into the decode entry at the same index; the decode must register exactly as many entries as the prefill.",
        when: "Different models or draft models, speculative decoding on one side only, or a pipelined prefill (each stage registers only its layers) against a DCP decode.",
        fix: "Serve the same model, with the same speculative-decoding draft, on both sides.\nDo not pipeline the prefill when the decode uses DCP.",
        example: "# before\nprefill: \"kv_item_lens\": [73728, 73728, 73728]   decode: \"kv_item_lens\": [73728, 73728]\n# after\nprefill: \"kv_item_lens\": [73728, 73728, 73728]   decode: \"kv_item_lens\": [73728, 73728, 73728]",
    },
    ProblemInfo {
        code: C::DcpEntryGeometry,
        id: "KVB-E016",
        title: "DCP relayout: per-entry token widths differ",
        severity: Error,
        detected_by: Check,
        sglang: "refuses the registration on the prefill side (`prepare_dcp_token_item_lens`); Mooncake/Mori send only the decode's first item length, so mixed stacks fail here even when correct",
        message: "PD DCP source/destination KV geometry differs at entry {i}: src token bytes={src_tok}, dst token bytes={dst_tok} (dst item_len={dst_item_len}, page scale={scale})",
        meaning: "The relayout copies rows, so every entry must have the same bytes per token on both sides. Prefill token bytes are `item_len div page_size`; decode target entries use `item_len div page_size`, decode draft entries `item_len div (page_size x dcp_size)` because the draft pool is not sharded and uses the virtual page. (kvbridge also scales prefill draft entries by the prefill DCP size.)",
        when: "Different KV dtypes or models, a draft entry registered with the physical instead of the virtual page size, or a hybrid stack whose per-layer sizes differ.",
        fix: "Register per-entry lengths from the same model on both sides.\nRegister decode draft entries with `page_size x dcp_size x token bytes`.\nUse the same `--kv-cache-dtype`.",
        example: "# P=64, decode DCP 4, one draft entry of 16 B/token\n# before\ndecode: \"kv_item_lens\": [2048, 2048, 1024], \"num_draft_entries\": 1\n# after\ndecode: \"kv_item_lens\": [2048, 2048, 4096], \"num_draft_entries\": 1   (4096 = 64 x 4 x 16)",
    },
    ProblemInfo {
        code: C::AuxLayout,
        id: "KVB-E017",
        title: "Aux (metadata) buffers differ",
        severity: Error,
        detected_by: Check,
        sglang: "does not check row sizes; it transfers the first min(n, m) buffers by position, so mismatched buffers silently receive the wrong bytes",
        message: "aux (metadata) buffers differ: buffer {j}: prefill {p} B/row, decode {d} B/row (prefill aux_item_lens={p_lens}, decode aux_item_lens={d_lens}); rows would land in the wrong buffer or be cut",
        meaning: "Aux buffers carry per-request metadata (first output token, logprobs, speculative hidden state, checksum) after the KV. They are matched by position; if the buffers at one position have different row sizes, the decode reads a corrupted first token or hidden state.",
        when: "An optional metadata buffer (KV checksum, sampling mask, DSA top-k) is enabled on one engine only and is not the last buffer, or the speculative settings differ.",
        fix: "Enable the same optional metadata buffers on both servers (`--disaggregation-enable-kv-checksum`, `SGLANG_ENABLE_DISAGG_SAMPLING_MASK`, DSA top-k).\nUse the same speculative decoding settings on both sides.",
        example: "# before\nprefill: \"aux_item_lens\": [4, 8, 16384]   decode: \"aux_item_lens\": [4, 16384]\n# after\nprefill: \"aux_item_lens\": [4, 8, 16384]   decode: \"aux_item_lens\": [4, 8, 16384]",
    },
    ProblemInfo {
        code: C::HeadSliceItemLens,
        id: "KVB-E018",
        title: "Head slicing needs one item length for every entry",
        severity: Error,
        detected_by: Check,
        sglang: "fails every transfer chunk at run time (logged as `[{session}] head-sliced transfer assumes one item length ...`), never at startup",
        message: "head-sliced transfer assumes one item length for every KV entry, got {set}",
        meaning: "With different attention TP sizes on an MHA/GQA pool each decode rank gathers head slices per token, computed from one bytes-per-head value for all entries. Entries of different sizes (typically a draft model with another KV geometry) make that computation wrong.",
        when: "Different attention TP sizes on an MHA/GQA model with speculative decoding whose draft KV has a different head count or head dim.",
        fix: "Use equal attention TP sizes (page path, no head slicing).\nOr use a draft model with the same KV geometry as the target.",
        example: "# before\nprefill: --tp 2, \"kv_item_lens\": [65536, 65536, 16384, 16384], \"num_draft_entries\": 2   decode: --tp 4\n# after\nprefill: --tp 4   decode: --tp 4",
    },
    ProblemInfo {
        code: C::RoleMistake,
        id: "KVB-E020",
        title: "Wrong descriptor roles",
        severity: Error,
        detected_by: Check,
        sglang: "has no descriptors; a misrouted peer shows up as a bootstrap or registration failure",
        message: "the descriptors are swapped: the PREFILL argument has role=decode and the DECODE argument has role=prefill\nthe {side} descriptor has role={role}: both descriptors describe a {role} server",
        meaning: "`check` compares a prefill rank with a decode rank. The first descriptor must have `\"role\": \"prefill\"`, the second `\"role\": \"decode\"`.",
        when: "The arguments are swapped, or the same server's descriptor was exported twice.",
        fix: "Pass the prefill descriptor first and the decode descriptor second.\nExport the missing descriptor from a server of the other role.",
        example: "# before\nkvbridge check decode.json prefill.json\n# after\nkvbridge check prefill.json decode.json",
    },
    ProblemInfo {
        code: C::ZeroSize,
        id: "KVB-E021",
        title: "A size is zero",
        severity: Error,
        detected_by: Check,
        sglang: "divides by these sizes (ZeroDivisionError) or registers no ranks",
        message: "{side} descriptor has zero sizes: {field}=0; every size must be at least 1",
        meaning: "`page_size`, `attn_tp_size`, `attn_cp_size`, `pp_size` and `dcp_size` count tokens or ranks; a server without a kind of parallelism uses 1, never 0.",
        when: "A hand-written descriptor, or an exporter that wrote 0 for an unset option.",
        fix: "Write the server's real sizes; use 1 for parallelism that is not used.",
        example: "# before\n\"pp_size\": 0\n# after\n\"pp_size\": 1",
    },
    ProblemInfo {
        code: C::RankOutOfRange,
        id: "KVB-E022",
        title: "A rank is out of range",
        severity: Error,
        detected_by: Check,
        sglang: "silently reduces the engine rank modulo the TP size, so the rank talks to the wrong peers",
        message: "{side} {rank_field}={rank} is out of range for {size_field}={size} (valid: 0..={max})",
        meaning: "Every rank must be smaller than its size. SGLang would quietly use `rank mod size`, i.e. pretend to be another rank, and two ranks would receive the same rows while one receives none.",
        when: "A descriptor exported from one deployment and edited for another, or a rank taken from a global (DP x TP) index instead of the attention TP rank.",
        fix: "Export the descriptor from a real rank of the server.\nUse the attention TP rank, not a global GPU index.",
        example: "# before\n\"attn_tp_size\": 4, \"attn_tp_rank\": 5\n# after\n\"attn_tp_size\": 4, \"attn_tp_rank\": 1",
    },
    ProblemInfo {
        code: C::DcpNotNested,
        id: "KVB-E023",
        title: "DCP is not nested in attention TP",
        severity: Error,
        detected_by: Check,
        sglang: "builds DCP groups inside attention TP at startup; descriptors that contradict this describe no real server",
        message: "{side} dcp_size={dcp} does not divide attn_tp_size={tp}: DCP groups are nested inside attention TP\n{side} dcp_rank={r} but attn_tp_rank={t} with dcp_size={dcp} implies dcp_rank={t mod dcp}",
        meaning: "DCP groups live inside the attention TP group: `dcp_size` divides `attn_tp_size` and a rank's DCP rank is `attn_tp_rank mod dcp_size`. The rank mapping relies on it to find which prefill ranks hold which positions.",
        when: "A hand-edited descriptor, or DCP size larger than (or not a divisor of) the TP size.",
        fix: "Choose a `dcp_size` that divides `attn_tp_size`.\nSet `dcp_rank` to `attn_tp_rank mod dcp_size`.",
        example: "# before\n\"attn_tp_size\": 4, \"attn_tp_rank\": 1, \"dcp_size\": 4, \"dcp_rank\": 2\n# after\n\"attn_tp_size\": 4, \"attn_tp_rank\": 1, \"dcp_size\": 4, \"dcp_rank\": 1",
    },
    ProblemInfo {
        code: C::TpNotMultiple,
        id: "KVB-E024",
        title: "Attention TP sizes are not multiples of one another",
        severity: Error,
        detected_by: Check,
        sglang: "has no divisibility check: decode TP 6 against prefill TP 4 maps decode rank 5 to prefill rank 5, which does not exist (the request later fails with `Bootstrap info not found`)",
        message: "attention TP sizes must divide one another, got prefill attn_tp_size={p} and decode attn_tp_size={d} ({consequence})",
        meaning: "The rank mapping pairs each decode rank with `tp_d div tp_p` or `tp_p div tp_d` prefill ranks. When the larger size is not a multiple of the smaller, the integer division silently drops ranks: some decode ranks target prefill ranks that do not exist and some prefill ranks are never read.",
        when: "Sizing prefill and decode independently, e.g. prefill TP 4 and decode TP 6.",
        fix: "Choose TP sizes where the larger is a multiple of the smaller (1, 2, 4, 8 ...).",
        example: "# before\nprefill: --tp 4   decode: --tp 6\n# after\nprefill: --tp 4   decode: --tp 8",
    },
    ProblemInfo {
        code: C::HeadGeometry,
        id: "KVB-E025",
        title: "MHA head geometry missing or different",
        severity: Error,
        detected_by: Check,
        sglang: "takes head counts from the model config on each side and does not compare them; different models fail in head slicing or corrupt KV",
        message: "{side} kv_pool=mha needs total_kv_heads and head_dim (missing or 0: {fields})\nprefill {field}={p} but decode {field}={d}: the servers do not serve the same model",
        meaning: "For MHA/GQA pools the KV of a token is split across TP ranks by heads; kvbridge needs the model's total KV head count and head dim to check item lengths and to plan head slices. Both sides must serve the same model.",
        when: "A descriptor for an MHA pool without `total_kv_heads`/`head_dim`, or two servers running different models.",
        fix: "Add the model's `num_key_value_heads` as `total_kv_heads` and its `head_dim`.\nServe the same model on both sides.",
        example: "# before\n{\"kv_pool\": \"mha\", \"attn_tp_size\": 4, ...}\n# after\n{\"kv_pool\": \"mha\", \"attn_tp_size\": 4, \"total_kv_heads\": 8, \"head_dim\": 128, ...}",
    },
    ProblemInfo {
        code: C::HeadsDoNotSplit,
        id: "KVB-E026",
        title: "KV heads cannot be split across TP",
        severity: Error,
        detected_by: Check,
        sglang: "uses `max(1, heads div tp)` heads per rank without checking; uneven splits silently drop heads or mis-assign replicas",
        message: "{side} total_kv_heads={h} cannot be split across attn_tp_size={tp}: {reason}",
        meaning: "GQA/MHA KV heads are divided among TP ranks: with TP <= heads each rank holds `heads / tp` heads, which must divide evenly; with TP > heads each head is replicated on `tp / heads` consecutive ranks, which also must divide evenly.",
        when: "E.g. 8 KV heads on TP 3 or TP 12, or 6 heads on TP 4.",
        fix: "Use an attention TP size that divides the KV head count or is a multiple of it.",
        example: "# 8 KV heads\n# before\n--tp 12\n# after\n--tp 8   (or --tp 16: each head replicated on 2 ranks)",
    },
    ProblemInfo {
        code: C::ItemLensMalformed,
        id: "KVB-E027",
        title: "kv_item_lens malformed",
        severity: Error,
        detected_by: Check,
        sglang: "trusts the registered lengths; a length that is not a whole number of token rows shifts every row after the first",
        message: "{side} kv_item_lens {lens} (num_draft_entries={nd}): {what is wrong}",
        meaning: "`kv_item_lens` lists the bytes per page of every registered KV entry, target entries then draft entries. Each must be positive and a whole number of token rows: a multiple of `page_size` for target entries and of `page_size x dcp_size` for draft entries (the draft pool uses the virtual page). There must be at least one target entry, and `num_draft_entries` cannot exceed the list.",
        when: "A hand-written descriptor, bytes per token given instead of bytes per page, or `num_draft_entries` counted wrongly.",
        fix: "Export `kv_item_lens` from the pool as registered with the transfer engine.\nWrite bytes per page (`page_size x bytes per token`), not bytes per token.",
        example: "# page_size 64, MLA 576 x 2 B per token\n# before\n\"kv_item_lens\": [1152, 1152]\n# after\n\"kv_item_lens\": [73728, 73728]",
    },
    ProblemInfo {
        code: C::ItemLensVsHeads,
        id: "KVB-E028",
        title: "kv_item_lens disagree with the pool kind or head geometry",
        severity: Error,
        detected_by: Check,
        sglang: "does not compare them; the head-slice path computes offsets from them and writes the wrong bytes",
        message: "{side} kv_item_lens do not match the head geometry (total_kv_heads={h}, attn_tp_size={tp}, heads_per_rank={hpr}, head_dim={hd}, page_size={P}): {reasons}\n{side} kv_pool=mla but its target entries have different item lengths {set}: every MLA layer holds the same latent vector per token",
        meaning: "An MHA/GQA pool registers a K and a V entry per layer, each `page_size x heads_per_rank x head_dim x dtype bytes` long, with `heads_per_rank = max(1, total_kv_heads div attn_tp_size)`. A pure MLA pool registers one identical entry per layer. Lengths that disagree mean the descriptor does not describe the pool, or the pool kind is wrong.",
        when: "`total_kv_heads`/`head_dim` from another model, a dtype that does not match, an odd number of MHA entries, or a hybrid stack declared as `\"mla\"`.",
        fix: "Export `kv_item_lens`, `total_kv_heads`, `head_dim` and `kv_cache_dtype` from the same server.\nDeclare pools that mix MLA layers with other per-layer state as `\"hybrid_mla\"`.",
        example: "# 8 KV heads, head_dim 128, TP 4, page 64, bf16: 64 x 2 x 128 x 2 = 32768\n# before\n\"kv_item_lens\": [65536, 65536]\n# after\n\"kv_item_lens\": [32768, 32768]",
    },
    ProblemInfo {
        code: C::PoolKindMismatch,
        id: "KVB-E029",
        title: "Pool kinds differ",
        severity: Error,
        detected_by: Check,
        sglang: "does not compare pool kinds across roles; the transfer writes MLA rows into an MHA pool (or the reverse)",
        message: "prefill kv_pool={p} but decode kv_pool={d}: the servers do not hold the same kind of KV cache",
        meaning: "Both servers must serve the same model with the same attention backend, so they hold the same kind of KV pool.",
        when: "Different models, or an attention backend that turns MLA into a hybrid pool on one side only.",
        fix: "Serve the same model with the same attention backend on both sides.",
        example: "# before\nprefill: \"kv_pool\": \"mla\"   decode: \"kv_pool\": \"hybrid_mla\"\n# after\nprefill: \"kv_pool\": \"mla\"   decode: \"kv_pool\": \"mla\"",
    },
    ProblemInfo {
        code: C::EntryCount,
        id: "KVB-E030",
        title: "Entry counts differ",
        severity: Error,
        detected_by: Check,
        sglang: "pairs entries positionally and, without layer ids, fails late (`PP-heterogeneous transfer requires layer ids on both peers`) or pairs the wrong layers",
        message: "prefill registers {n} KV entries (draft={nd}) but decode registers {m} (draft={md}); entries are paired by position",
        meaning: "Without layer ids, the page and head-slice paths pair entry i with entry i; with the same PP size both sides must register the same layers and draft layers.",
        when: "Different models, or speculative decoding enabled on one side only.",
        fix: "Serve the same model with the same speculative-decoding draft on both sides.",
        example: "# before\nprefill: 2 entries, \"num_draft_entries\": 0   decode: 4 entries, \"num_draft_entries\": 2\n# after\nprefill: 4 entries, \"num_draft_entries\": 2   decode: 4 entries, \"num_draft_entries\": 2",
    },
    ProblemInfo {
        code: C::EntryGeometry,
        id: "KVB-E031",
        title: "Per-entry geometry differs",
        severity: Error,
        detected_by: Check,
        sglang: "uses the prefill's item length as the decode's stride on the page path without comparing, so different lengths write outside the intended pages",
        message: "KV entry geometry differs at entry {i}: prefill {unit}={p}, decode {unit}={d} (prefill item_len={s}, decode item_len={t})",
        meaning: "On the page path each prefill page is copied into a decode page of the same size, so the entries' bytes per page must be equal. With different page sizes (kvbridge rows) the bytes per token must be equal; with head slicing the bytes per head per token.",
        when: "Different dtypes or models, or hand-edited item lengths.",
        fix: "Serve the same model with the same KV dtype on both sides.\nExport both descriptors again from the running servers.",
        example: "# before\nprefill: \"kv_item_lens\": [73728, 73728]   decode: \"kv_item_lens\": [36864, 36864]\n# after\nprefill: \"kv_item_lens\": [73728, 73728]   decode: \"kv_item_lens\": [73728, 73728]",
    },
    ProblemInfo {
        code: C::ProtocolVersion,
        id: "KVB-E032",
        title: "Protocol major versions differ",
        severity: Error,
        detected_by: Check,
        sglang: "has no descriptor protocol",
        message: "{side} descriptor uses protocol_version {v}, but this kvbridge speaks {current}",
        meaning: "Descriptors carry a `MAJOR.MINOR` protocol version. A newer minor only adds optional fields; a different major may change what fields mean, so the pair is refused. Parsing a descriptor with a newer major already fails (exit code 2 in the CLI); this code covers descriptors built in code.",
        when: "One side runs a kvbridge release with a different protocol major version.",
        fix: "Upgrade both sides to releases that speak the same protocol major version.",
        example: "# before\nprefill: \"protocol_version\": \"2.0\"   decode: \"protocol_version\": \"1.0\"\n# after\nprefill: \"protocol_version\": \"2.0\"   decode: \"protocol_version\": \"2.0\"",
    },
    ProblemInfo {
        code: C::TooLarge,
        id: "KVB-E033",
        title: "A size or count is above its maximum",
        severity: Error,
        detected_by: Check,
        sglang: "has no maxima: it allocates rank lists of the claimed size or loops over them",
        message: "{side} descriptor has values above their maxima: {field}={value} (max {max}); such values are corrupt or hostile, so the {side} side is not checked further",
        meaning: "Every size and count in a descriptor is bounded (see \"Descriptor format\" above for the maxima) before `check` builds rank lists, checks entries or computes the mapping from it. A descriptor with a larger value is refused without further checks of that side, so a corrupt or hostile peer cannot make the other side allocate or loop over a claimed count.",
        when: "A corrupt or truncated descriptor, an exporter that wrote a sentinel such as 4294967295 for an unset option, or a peer probing for a crash.",
        fix: "Export the descriptor again from the running server; its real sizes are far below the maxima.\nIf a real deployment exceeds a maximum, split it (fewer ranks per replica, smaller pages) and report it.",
        example: "# before\n\"pp_size\": 4294967295\n# after\n\"pp_size\": 1",
    },
    ProblemInfo {
        code: C::PrefixMisaligned,
        id: "KVB-E040",
        title: "Decode prefix not aligned to the DCP virtual page (planner)",
        severity: Error,
        detected_by: Planner,
        sglang: "raises ValueError in `build_dcp_token_transfer_plan` on the prefill, per request",
        message: "PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size ({virtual_page_size}), got {decode_prefix_len}",
        meaning: "Under DCP the decode allocator works in virtual pages of `V = page_size x dcp_size` tokens: virtual page v occupies physical page v on every DCP rank. A decode prefix (tokens the decode already holds from its prefix cache) that ends inside a virtual page would make the owner-rule arithmetic place rows on the wrong ranks, so the planner refuses it. This is not a property of two descriptors: `kvbridge check` accepts the pair and prints the virtual page size; the error comes from the planner (kvbridge-geometry, `kvbridge plan`) for one request.",
        when: "Calling the planner with a `decode_prefix_len` that is not a multiple of V, e.g. prefix 100 with page_size 16 and dcp_size 4 (V = 64); a multiple of the physical page (48) is not enough. Typical causes: a decode radix cache paged by the physical page instead of V, chunked prefill leaving a partial virtual page, mismatched page sizes shifting the prefix boundary.",
        fix: "Keep decode prefix-cache hits aligned to V: page the decode radix cache by `page_size x dcp_size`.\nRound a prefix down to a multiple of V before planning (the prefill then resends the tail).\nUse the same page_size and dcp_size that produced the prefix.",
        example: "# before\nkvbridge plan examples/descriptors/misaligned-prefix/plan.json   # page 16, DCP 4, prefix 100 -> error\n# after\ndecode_prefix_len = (100 div 64) x 64 = 64   # prefill resends tokens 64..100",
    },
    ProblemInfo {
        code: C::PagesInsufficient,
        id: "KVB-E041",
        title: "Page ids do not cover the chunk (planner)",
        severity: Error,
        detected_by: Planner,
        sglang: "raises ValueError in `build_dcp_token_transfer_plan` on the prefill, per request, for the DCP token plan (`num_kv_tokens must fit ...`, `Insufficient destination DCP pages ...`); the other cases are kvbridge's own",
        message: "Insufficient destination DCP pages: required={required}, provided={provided}, src_page_offset={src_page_offset}, dcp_rank={dcp_rank}",
        meaning: "The planner was given fewer page ids than the rows it must address: the prefill's pages of the chunk hold fewer tokens than `num_kv_tokens`, the decode sent fewer virtual pages than the send range needs up to the chunk's end, a resharding rank's pages do not cover its rows, a page id lies outside its pool, or a page table (from position 0) is shorter than its cached prefix. Nothing is written; the room fails with cause `planning`.",
        when: "The decode allocated pages for fewer tokens than the prefill sends; a chunk's page list was sliced wrong; a page table from position 0 was treated as the send range or the reverse (`SendPages::from_page_table` and `SendPages::after_prefix` name which); page ids from another pool.",
        fix: "Allocate one decode virtual page per `page_size x dcp_size` tokens of the whole send range, counted from the cached prefix.\nPass every source page of the chunk, and `num_kv_tokens` no larger than they hold.\nBuild the decode's ids with `SendPages::from_page_table(table, prefix, V)` when the table starts at position 0.",
        example: "# before\nsrc_pages [1, 2, 3, 4], page_size 2, dcp_size 2, dst_pages [7]   # 8 tokens need 2 virtual pages\n# after\nsrc_pages [1, 2, 3, 4], page_size 2, dcp_size 2, dst_pages [7, 8]",
    },
    ProblemInfo {
        code: C::PlanInputInvalid,
        id: "KVB-E042",
        title: "Planner inputs inconsistent (planner)",
        severity: Error,
        detected_by: Planner,
        sglang: "has no equivalent check for most of these (a DCP chunk that starts mid-page, or entries that do not exist, address the wrong rows); SGLang's layer-metadata texts are kept word for word",
        message: "chunk_start={chunk_start} tokens is not a multiple of page_size={page_size}; ...",
        meaning: "The inputs of one plan contradict each other: a DCP chunk that does not start on a page boundary, index arrays of different lengths, an entry index beyond a pool, a pool description inconsistent in itself, or layer ids that do not pair the entries. The planner refuses before computing anything.",
        when: "A caller computing `chunk_start` from a partial chunk, or in pages instead of tokens; entry pairs built for another pool; layer ids published by one peer only.",
        fix: "Count `chunk_start` in tokens: the tokens of the send range sent before the chunk (SGLang's `src_page_offset x page_size`).\nPair only entries both pools have; publish layer ids on both peers or on none.\nRead the message: it names the input and the value seen.",
        example: "# before\nchunk_start: 1        # one page sent before, counted in pages\n# after\nchunk_start: 64       # one page of 64 tokens",
    },
    ProblemInfo {
        code: C::TpDiffersMha,
        id: "KVB-W001",
        title: "Different TP sizes on an MHA/GQA model (performance)",
        severity: Warning,
        detected_by: Check,
        sglang: "logs this warning and continues",
        message: "Performance is NOT guaranteed when using different TP sizes for non-MLA models. ",
        meaning: "With different attention TP sizes an MHA/GQA decode rank receives per-token head slices (many small writes) instead of whole pages. The pair works; it is just slower.",
        when: "Prefill and decode attention TP sizes differ on an MHA/GQA model.",
        fix: "Use equal attention TP sizes when transfer bandwidth matters.\nOtherwise nothing to do.",
        example: "# slower\nprefill: --tp 2   decode: --tp 4\n# faster\nprefill: --tp 4   decode: --tp 4",
    },
    ProblemInfo {
        code: C::AuxCount,
        id: "KVB-W002",
        title: "Aux buffer counts differ",
        severity: Warning,
        detected_by: Check,
        sglang: "logs this on the prefill when the decode registers and continues",
        message: "Decode {peer} registered {n} metadata buffers but this prefill has {m}; only the first {min} are transferred, and misaligned if the extra buffer is not the last. An optional metadata buffer is enabled on one engine only: --disaggregation-enable-kv-checksum, SGLANG_ENABLE_DISAGG_SAMPLING_MASK, or the DSA top-k buffer.",
        meaning: "One side has an extra metadata buffer. The buffers both sides have agree in row size (otherwise `KVB-E017` is reported), so the extra trailing buffer is simply not transferred.",
        when: "An optional metadata buffer is enabled on one engine only.",
        fix: "Enable the same optional metadata buffers on both servers.",
        example: "# before\nprefill: \"aux_item_lens\": [4, 16384]   decode: \"aux_item_lens\": [4, 16384, 8]\n# after\nprefill: \"aux_item_lens\": [4, 16384, 8]   decode: \"aux_item_lens\": [4, 16384, 8]",
    },
    ProblemInfo {
        code: C::NewerMinorFields,
        id: "KVB-W003",
        title: "Fields of a newer minor version ignored",
        severity: Warning,
        detected_by: Check,
        sglang: "has no descriptor protocol",
        message: "{side} descriptor uses protocol_version {v}, newer than this kvbridge's {current}; its fields {fields} are unknown here and ignored",
        meaning: "A newer minor protocol version only adds optional fields whose defaults keep the old meaning, so a descriptor from a newer minor release is read without them and the pair still works as it would have under this build's version. Unknown fields in a descriptor of this build's minor version or an older one are a typo and refused (`invalid peer descriptor`); a newer major version is refused (`peer descriptor uses protocol_version 2.0, but this kvbridge speaks protocol 1.0 ...` when parsing, `KVB-E032` for a pair built in code).",
        when: "The two sides run kvbridge releases of the same protocol major version but different minor versions, and the newer side advertises a field it added.",
        fix: "Nothing is required: the pair is accepted.\nTo use what the new fields add, upgrade this side to a release that speaks the newer minor version.",
        example: "# before (this build speaks 1.0)\nprefill: \"protocol_version\": \"1.1\", \"kv_zones\": 4   -> warning, kv_zones ignored\n# after\nboth sides on a release that speaks 1.1",
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Adding a variant without listing it in `ALL` (and the catalog) fails to compile here or
    /// fails this test.
    #[test]
    fn all_lists_every_variant_once_and_each_has_its_entry() {
        let position = |c: C| ProblemCode::ALL.iter().position(|x| *x == c);
        for &c in ProblemCode::ALL {
            let listed = match c {
                C::PageSizeMismatch
                | C::DtypeMismatch
                | C::MiniMaxTp
                | C::LayoutMismatch
                | C::Dspark
                | C::Mxfp8Tp
                | C::DcpNeedsMlaPool
                | C::DcpPrefillCp
                | C::DcpPrefillSharding
                | C::MlaShardingTp
                | C::DecodeCp
                | C::PpMismatch
                | C::DcpRankMismatch
                | C::DcpTopology
                | C::DcpEntryCount
                | C::DcpEntryGeometry
                | C::AuxLayout
                | C::HeadSliceItemLens
                | C::RoleMistake
                | C::ZeroSize
                | C::RankOutOfRange
                | C::DcpNotNested
                | C::TpNotMultiple
                | C::HeadGeometry
                | C::HeadsDoNotSplit
                | C::ItemLensMalformed
                | C::ItemLensVsHeads
                | C::PoolKindMismatch
                | C::EntryCount
                | C::EntryGeometry
                | C::ProtocolVersion
                | C::TooLarge
                | C::PrefixMisaligned
                | C::PagesInsufficient
                | C::PlanInputInvalid
                | C::TpDiffersMha
                | C::AuxCount
                | C::NewerMinorFields => position(c),
            };
            assert!(listed.is_some());
            assert_eq!(CATALOG.iter().filter(|i| i.code == c).count(), 1, "{c:?}");
        }
        assert_eq!(ProblemCode::ALL.len(), CATALOG.len());
        let order: Vec<ProblemCode> = CATALOG.iter().map(|i| i.code).collect();
        assert_eq!(order, ProblemCode::ALL);
    }
}
