//! `check`: every compatibility check between two descriptors, all problems at once (each one
//! is an entry of docs/errors.md).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt::Write as _;

use kvbridge_geometry::{GeometryError, PoolKind, prepare_dcp_token_item_lens};
use serde::Serialize;

use crate::descriptor::{PeerDescriptor, Role, dtype_bytes};
use crate::error::{HandshakeError, Result};
use crate::fingerprint::{Fingerprint, fingerprint};
use crate::limits;
use crate::mapping::{
    HeadRange, MappingInput, PeerTarget, RankMapping, TargetRanks, TpTarget, TransferPath,
    bootstrap_order, coverage_targets, decode_cp_failure, head_readers, head_senders, head_sources,
    mla_sharding_failure, owner_rule_readers, owner_rule_senders, pp_failure, prefill_unique_rank,
    sglang_head_slice, sglang_is_dummy, sglang_targets,
};
use crate::problem::{Problem, ProblemCode, Severity};
use crate::version::ProtocolVersion;

/// Which envelope of supported setups `check` applies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Compat {
    /// What kvbridge's planner supports (default): any prefill DCP `a` → decode DCP `b` for
    /// MLA/hybrid-MLA pools, different physical page sizes, and every SGLang setup. Still refuses
    /// what cannot work (DCP on an MHA/GQA pool, heads that do not split, TP sizes that are not
    /// multiples, mismatched geometry).
    #[default]
    Kvbridge,
    /// Exactly SGLang 0.5.23's envelope: everything SGLang refuses is refused with SGLang's
    /// text (different page sizes, `Unsupported PD DCP topology`, mismatched DCP ranks), plus
    /// the safety checks for setups SGLang lets through but that fail later or corrupt data.
    Sglang,
}

impl Compat {
    /// `"kvbridge"` or `"sglang"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Compat::Kvbridge => "kvbridge",
            Compat::Sglang => "sglang",
        }
    }
}

/// Options of [`check_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct CheckOptions {
    /// Supported-setup envelope (default [`Compat::Kvbridge`]).
    pub compat: Compat,
    /// The decode's `SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER` (pull from every prefill CP
    /// rank); a hybrid-MLA decode pool or decode KV sharding implies it.
    pub all_cp_ranks_transfer: bool,
}

impl CheckOptions {
    /// Options for the given compatibility mode.
    pub fn new(compat: Compat) -> Self {
        CheckOptions {
            compat,
            all_cp_ranks_transfer: false,
        }
    }

    /// Sets [`CheckOptions::compat`].
    #[must_use]
    pub fn with_compat(mut self, compat: Compat) -> Self {
        self.compat = compat;
        self
    }

    /// Set [`CheckOptions::all_cp_ranks_transfer`].
    #[must_use]
    pub fn with_all_cp_ranks_transfer(mut self, on: bool) -> Self {
        self.all_cp_ranks_transfer = on;
        self
    }
}

/// The result of [`check_with`]: every problem, and the rank mapping when compatible.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Every error found (empty = compatible), in check order.
    pub problems: Vec<Problem>,
    /// Warnings (the pair is still compatible).
    pub warnings: Vec<Problem>,
    /// The decode rank's mapping, when there are no problems.
    pub mapping: Option<RankMapping>,
    /// Fingerprint of the prefill descriptor.
    pub prefill_fingerprint: Fingerprint,
    /// Fingerprint of the decode descriptor.
    pub decode_fingerprint: Fingerprint,
}

impl Report {
    /// No errors (warnings allowed).
    pub fn is_compatible(&self) -> bool {
        self.problems.is_empty()
    }

    /// The mapping, or every problem as [`HandshakeError::Incompatible`].
    ///
    /// # Errors
    /// [`HandshakeError::Incompatible`] when `check` found problems.
    pub fn into_result(self) -> Result<RankMapping> {
        match self.mapping {
            Some(m) if self.problems.is_empty() => Ok(m),
            _ => Err(HandshakeError::Incompatible {
                problems: self.problems,
            }),
        }
    }

    /// The codes of all problems, in order (handy in tests and logs).
    pub fn codes(&self) -> Vec<ProblemCode> {
        self.problems.iter().map(|p| p.code).collect()
    }
}

/// [`check_with`] with default options ([`Compat::Kvbridge`]).
pub fn check(prefill: &PeerDescriptor, decode: &PeerDescriptor) -> Report {
    check_with(prefill, decode, &CheckOptions::default())
}

/// Check a prefill descriptor against a decode rank's descriptor: every check of SGLang 0.5.23
/// that applies to what descriptors carry, plus what SGLang lets through but cannot work. Returns
/// **all** problems; computes the rank mapping when there are none.
///
/// Order: descriptor sanity (per side), then SGLang's decode-side checks (`KVB-E001`..`E012`,
/// in SGLang's order), the rank-mapping preconditions, the prefill-side registration checks
/// SGLang runs when a decode registers (DCP topology, per-entry geometry, aux buffers), and the
/// warnings. Each problem is an entry of docs/errors.md.
pub fn check_with(
    prefill: &PeerDescriptor,
    decode: &PeerDescriptor,
    options: &CheckOptions,
) -> Report {
    let mut c = Checker {
        p: prefill,
        d: decode,
        opts: *options,
        out: Vec::new(),
        seen: HashSet::new(),
    };
    c.run();
    let (problems, warnings): (Vec<_>, Vec<_>) = c
        .out
        .into_iter()
        .partition(|p| p.severity == Severity::Error);
    let mapping = if problems.is_empty() {
        build_mapping(prefill, decode, options).ok()
    } else {
        None
    };
    Report {
        problems,
        warnings,
        mapping,
        prefill_fingerprint: fingerprint(prefill),
        decode_fingerprint: fingerprint(decode),
    }
}

/// Check, then return the mapping, or every problem as one error.
///
/// # Errors
/// [`HandshakeError::Incompatible`] listing every problem.
pub fn rank_mapping(
    prefill: &PeerDescriptor,
    decode: &PeerDescriptor,
    options: &CheckOptions,
) -> Result<RankMapping> {
    check_with(prefill, decode, options).into_result()
}

/// The result of checking one decode rank in [`check_all_ranks`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankReport {
    /// The decode attention TP rank checked.
    pub decode_tp_rank: u32,
    /// The decode PP rank checked.
    pub decode_pp_rank: u32,
    /// The decode DCP rank checked (`tp_rank mod dcp_size`).
    pub decode_dcp_rank: u32,
    /// The report for this rank.
    pub report: Report,
}

/// Check every rank of the decode deployment (varying `attn_tp_rank`, `pp_rank`,
/// `dcp_rank = attn_tp_rank mod dcp_size`; `attn_cp_rank` 0) against the prefill.
/// With a zero size in the decode descriptor, or one above its maximum (`KVB-E033`), only the
/// descriptor as given is checked.
pub fn check_all_ranks(
    prefill: &PeerDescriptor,
    decode: &PeerDescriptor,
    options: &CheckOptions,
) -> Vec<RankReport> {
    // Zero or oversized decode sizes: the rank loops below would divide by them or run over
    // a claimed count, and the report for the descriptor as given already says why.
    if decode.attn_tp_size == 0
        || decode.pp_size == 0
        || decode.dcp_size == 0
        || !limits::sizes_within(decode)
    {
        return vec![RankReport {
            decode_tp_rank: decode.attn_tp_rank,
            decode_pp_rank: decode.pp_rank,
            decode_dcp_rank: decode.dcp_rank,
            report: check_with(prefill, decode, options),
        }];
    }
    let mut out = Vec::new();
    for pp in 0..decode.pp_size {
        for tp in 0..decode.attn_tp_size {
            let d = PeerDescriptor {
                attn_tp_rank: tp,
                pp_rank: pp,
                dcp_rank: tp % decode.dcp_size,
                attn_cp_rank: 0,
                ..decode.clone()
            };
            out.push(RankReport {
                decode_tp_rank: tp,
                decode_pp_rank: pp,
                decode_dcp_rank: d.dcp_rank,
                report: check_with(prefill, &d, options),
            });
        }
    }
    out
}

/// Mapping inputs from two descriptors.
pub(crate) fn mapping_input(
    p: &PeerDescriptor,
    d: &PeerDescriptor,
    opts: &CheckOptions,
) -> MappingInput {
    MappingInput {
        decode_tp_size: d.attn_tp_size,
        decode_engine_rank: d.attn_tp_rank,
        decode_cp_size: d.attn_cp_size,
        decode_pp_size: d.pp_size,
        decode_pp_rank: d.pp_rank,
        decode_pool: d.kv_pool,
        decode_kv_cache_sharding: d.kv_cache_sharding,
        prefill_tp_size: p.attn_tp_size,
        prefill_cp_size: p.attn_cp_size,
        prefill_pp_size: p.pp_size,
        prefill_kv_cache_sharding: p.kv_cache_sharding,
        prefill_dsa_layer_split: false,
        all_cp_ranks_transfer: opts.all_cp_ranks_transfer,
    }
}

/// Whether SGLang defines this DCP pairing (prefill DCP 1, or equal DCP sizes with equal TP).
fn sglang_defines_dcp(p: &PeerDescriptor, d: &PeerDescriptor) -> bool {
    let prefill_without_dcp = p.dcp_size == 1 && (d.dcp_size == 1 || p.is_mla_like());
    prefill_without_dcp || p.dcp_size == d.dcp_size && p.attn_tp_size == d.attn_tp_size
}

/// The transfer path for a pair (sizes assumed valid).
pub(crate) fn transfer_path(
    p: &PeerDescriptor,
    d: &PeerDescriptor,
    compat: Compat,
) -> TransferPath {
    let same_page = p.page_size == d.page_size;
    if p.is_mla_like() {
        let (a, b) = (p.dcp_size, d.dcp_size);
        if a == b
            && same_page
            && (a == 1 || compat == Compat::Sglang || p.attn_tp_size == d.attn_tp_size)
        {
            TransferPath::Pages
        } else if a == 1 && b > 1 && (same_page || compat == Compat::Sglang) {
            TransferPath::DcpTokenPlan
        } else if compat == Compat::Sglang && same_page {
            // Refused as an unsupported topology; the page path is what SGLang would attempt.
            TransferPath::Pages
        } else {
            TransferPath::Rows { head_slices: false }
        }
    } else {
        let tp_differs = p.attn_tp_size != d.attn_tp_size;
        match (same_page || compat == Compat::Sglang, tp_differs) {
            (true, false) => TransferPath::Pages,
            (true, true) => TransferPath::HeadSlices,
            (false, head_slices) => TransferPath::Rows { head_slices },
        }
    }
}

/// Whether kvbridge uses its exact head plan instead of SGLang's (MHA/GQA, prefill TP larger
/// than decode TP and than the KV head count: SGLang would read every replica of a head).
fn exact_head_plan(p: &PeerDescriptor, d: &PeerDescriptor, compat: Compat) -> bool {
    compat == Compat::Kvbridge
        && d.kv_pool == PoolKind::Mha
        && p.attn_tp_size > d.attn_tp_size
        && d.total_kv_heads.is_some_and(|h| p.attn_tp_size > h)
}

fn build_mapping(
    p: &PeerDescriptor,
    d: &PeerDescriptor,
    opts: &CheckOptions,
) -> Result<RankMapping> {
    let input = mapping_input(p, d, opts);
    let (a, b) = (p.dcp_size, d.dcp_size);
    let (tp_p, tp_d) = (p.attn_tp_size, d.attn_tp_size);
    let heads = d.total_kv_heads.unwrap_or(0);
    let e = input.engine_rank();
    let owner_rule =
        opts.compat == Compat::Kvbridge && p.is_mla_like() && !sglang_defines_dcp(p, d);
    let exact_heads = exact_head_plan(p, d, opts.compat);
    let (targets, per_tp): (TargetRanks, Vec<TpTarget>) = if owner_rule {
        coverage_targets(&input, &|e| owner_rule_senders(e, tp_d, b, tp_p, a), &|t| {
            owner_rule_readers(t, tp_d, b, tp_p, a)
        })?
    } else if exact_heads {
        coverage_targets(&input, &|e| head_senders(e, tp_d, tp_p, heads), &|t| {
            head_readers(t, tp_d, tp_p, heads)
        })?
    } else {
        let t = sglang_targets(&input)?;
        let per_tp = t
            .target_tp_ranks
            .iter()
            .map(|&tp| TpTarget {
                tp,
                is_dummy: sglang_is_dummy(d.kv_pool, t.target_tp_rank, tp),
                dst_info: t.required_dst_info_num,
            })
            .collect();
        (t, per_tp)
    };
    let exact_slices: BTreeMap<u32, HeadRange> = if exact_heads {
        head_sources(e, tp_d, tp_p, heads).into_iter().collect()
    } else {
        BTreeMap::new()
    };
    // Looked up once per peer: a map keeps building the list linear in its length.
    let per_tp: BTreeMap<u32, TpTarget> = per_tp.into_iter().map(|x| (x.tp, x)).collect();
    let peers = bootstrap_order(&targets)
        .into_iter()
        .map(|(tp, cp, pp)| {
            let (is_dummy, dst_info) = per_tp
                .get(&tp)
                .map_or((false, targets.required_dst_info_num), |x| {
                    (x.is_dummy, x.dst_info)
                });
            let head_slice = if is_dummy || d.kv_pool != PoolKind::Mha || tp_p == tp_d {
                None
            } else if exact_heads {
                exact_slices.get(&tp).copied()
            } else {
                sglang_head_slice(tp_p, tp_d, tp, e, heads)
            };
            PeerTarget {
                tp_rank: tp,
                cp_rank: cp,
                pp_rank: pp,
                dcp_rank: tp % a.max(1),
                unique_rank: prefill_unique_rank(tp, cp, pp, p.attn_cp_size, p.pp_size),
                is_dummy,
                required_dst_info_num: dst_info,
                head_slice,
            }
        })
        .collect();
    Ok(RankMapping {
        target_tp_rank: targets.target_tp_rank,
        target_tp_ranks: targets.target_tp_ranks,
        target_cp_ranks: targets.target_cp_ranks,
        target_pp_ranks: targets.target_pp_ranks,
        required_dst_info_num: targets.required_dst_info_num,
        required_prefill_response_num: targets.required_prefill_response_num,
        peers,
        path: transfer_path(p, d, opts.compat),
        decode_tp_rank: d.attn_tp_rank,
        decode_pp_rank: d.pp_rank,
        prefill_dcp_size: a,
        decode_dcp_size: b,
        decode_dcp_rank: d.dcp_rank,
        decode_virtual_page_size: d.page_size * u64::from(b),
    })
}

fn python_set(values: &[u64]) -> String {
    let set: BTreeSet<u64> = values.iter().copied().collect();
    let items: Vec<String> = set.iter().map(u64::to_string).collect();
    format!("{{{}}}", items.join(", "))
}

fn layout_str(l: &Option<String>) -> String {
    l.clone().unwrap_or_else(|| "None".to_owned())
}

struct Checker<'a> {
    p: &'a PeerDescriptor,
    d: &'a PeerDescriptor,
    opts: CheckOptions,
    out: Vec<Problem>,
    /// What `out` holds, for deduplication in constant time (a descriptor may yield one
    /// problem per entry, thousands of them).
    seen: HashSet<Problem>,
}

impl Checker<'_> {
    fn push(&mut self, p: Problem) {
        if self.seen.insert(p.clone()) {
            self.out.push(p);
        }
    }

    fn sglang(&self) -> bool {
        self.opts.compat == Compat::Sglang
    }

    fn run(&mut self) {
        self.versions();
        self.roles();
        // Sizes above their maxima first: nothing below may allocate or loop over them.
        let p_small = self.limits(self.p, "prefill");
        let d_small = self.limits(self.d, "decode");
        let p_ok = p_small && self.side(self.p, "prefill");
        let d_ok = d_small && self.side(self.d, "decode");
        self.pool_kinds();
        self.decode_side_checks();
        self.head_geometry_cross();
        if p_ok && d_ok {
            self.tp_multiple();
            self.mapping_preconditions();
            self.dcp_topology();
            self.entry_geometry();
            self.head_slice_item_lens();
        }
        if p_small && d_small {
            self.aux();
        }
        if p_ok
            && d_ok
            && self.p.attn_tp_size != self.d.attn_tp_size
            && self.d.kv_pool == PoolKind::Mha
        {
            self.push(
                Problem::new(
                    ProblemCode::TpDiffersMha,
                    //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: w001_mha_different_tp_is_a_warning
                    //# if not self.is_mla_backend and not self.is_hybrid_mla_backend:
                    //# logger.warning_once(
                    //# "Performance is NOT guaranteed when using different TP sizes for non-MLA models. "
                    "Performance is NOT guaranteed when using different TP sizes for non-MLA models. ",
                    "expected with different attention TP sizes on an MHA/GQA model (each decode rank \
                     gathers head slices per token); use equal TP sizes for the fastest page path",
                )
                .with("prefill.attn_tp_size", self.p.attn_tp_size)
                .with("decode.attn_tp_size", self.d.attn_tp_size),
            );
        }
    }

    fn versions(&mut self) {
        for (side, d) in [("prefill", self.p), ("decode", self.d)] {
            if d.protocol_version.major != ProtocolVersion::CURRENT.major {
                self.push(
                    Problem::new(
                        ProblemCode::ProtocolVersion,
                        format!(
                            "{side} descriptor uses protocol_version {}, but this kvbridge speaks {}",
                            d.protocol_version,
                            ProtocolVersion::CURRENT
                        ),
                        format!(
                            "run the same kvbridge protocol major version on both sides (upgrade the \
                             side that speaks {}.x)",
                            d.protocol_version.major.min(ProtocolVersion::CURRENT.major)
                        ),
                    )
                    .with(format!("{side}.protocol_version"), d.protocol_version),
                );
            } else if !d.unknown_fields().is_empty() {
                let fields = listed(d.unknown_fields());
                self.push(
                    Problem::new(
                        ProblemCode::NewerMinorFields,
                        format!(
                            "{side} descriptor uses protocol_version {}, newer than this kvbridge's {}; \
                             its fields {fields} are unknown here and ignored",
                            d.protocol_version,
                            ProtocolVersion::CURRENT
                        ),
                        format!(
                            "nothing is required (a newer minor version only adds fields whose defaults \
                             keep the old meaning); to use them, upgrade this side to a release that \
                             speaks protocol {}",
                            d.protocol_version
                        ),
                    )
                    .with(format!("{side}.protocol_version"), d.protocol_version)
                    .with(format!("{side}.unknown_fields"), fields),
                );
            }
        }
    }

    fn roles(&mut self) {
        let (pr, dr) = (self.p.role, self.d.role);
        if pr == Role::Decode && dr == Role::Prefill {
            self.push(
                Problem::new(
                    ProblemCode::RoleMistake,
                    "the descriptors are swapped: the PREFILL argument has role=decode and the DECODE \
                     argument has role=prefill",
                    "pass the prefill descriptor first and the decode descriptor second",
                )
                .with("prefill.role", pr)
                .with("decode.role", dr),
            );
            return;
        }
        for (side, role, want) in [("prefill", pr, Role::Prefill), ("decode", dr, Role::Decode)] {
            if role != want {
                self.push(
                    Problem::new(
                        ProblemCode::RoleMistake,
                        format!(
                            "the {side} descriptor has role={role}: both descriptors describe a {role} server"
                        ),
                        format!(
                            "pass a descriptor exported by a {want} server (\"role\": \"{want}\") as the \
                             {} argument",
                            side.to_ascii_uppercase()
                        ),
                    )
                    .with(format!("{side}.role"), role),
                );
            }
        }
    }

    /// Every size and count of one side against its maximum (`KVB-E033`). Returns whether all
    /// are within them.
    fn limits(&mut self, s: &PeerDescriptor, side: &str) -> bool {
        let excess = limits::excesses(s);
        if excess.is_empty() {
            return true;
        }
        let listed: Vec<String> = excess
            .iter()
            .map(|x| format!("{}={} (max {})", x.field, x.value, x.max))
            .collect();
        let mut p = Problem::new(
            ProblemCode::TooLarge,
            format!(
                "{side} descriptor has values above their maxima: {}; such values are corrupt or \
                 hostile, so the {side} side is not checked further",
                listed.join(", ")
            ),
            format!(
                "export the {side} descriptor again from the running server; real deployments \
                 stay far below every maximum (docs/errors.md, \"Descriptor format\")"
            ),
        );
        for x in &excess {
            p = p.with(format!("{side}.{}", x.field), x.value);
        }
        self.push(p);
        false
    }

    /// Per-side sanity. Returns whether sizes are all ≥ 1 (so cross checks can divide).
    fn side(&mut self, s: &PeerDescriptor, side: &str) -> bool {
        if !self.sizes_nonzero(s, side) {
            return false;
        }
        self.ranks_in_range(s, side);
        self.dcp_nested(s, side);
        let heads_ok = self.heads_split(s, side);
        self.item_lens(s, side, heads_ok);
        true
    }

    /// `KVB-E021`: every size at least 1. Returns whether they are.
    fn sizes_nonzero(&mut self, s: &PeerDescriptor, side: &str) -> bool {
        let sizes = [
            ("page_size", s.page_size),
            ("attn_tp_size", u64::from(s.attn_tp_size)),
            ("attn_cp_size", u64::from(s.attn_cp_size)),
            ("pp_size", u64::from(s.pp_size)),
            ("dcp_size", u64::from(s.dcp_size)),
        ];
        let zero: Vec<&str> = sizes
            .iter()
            .filter(|(_, v)| *v == 0)
            .map(|(n, _)| *n)
            .collect();
        if !zero.is_empty() {
            let mut p = Problem::new(
                ProblemCode::ZeroSize,
                format!(
                    "{side} descriptor has zero sizes: {}; every size must be at least 1",
                    zero.iter()
                        .map(|n| format!("{n}=0"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                format!(
                    "export the {side} server's real sizes (a server without TP/CP/PP/DCP uses 1)"
                ),
            );
            for n in &zero {
                p = p.with(format!("{side}.{n}"), 0);
            }
            self.push(p);
            return false;
        }
        true
    }

    /// `KVB-E022`: every rank below its size.
    fn ranks_in_range(&mut self, s: &PeerDescriptor, side: &str) {
        for (rank_name, rank, size_name, size) in [
            (
                "attn_tp_rank",
                s.attn_tp_rank,
                "attn_tp_size",
                s.attn_tp_size,
            ),
            (
                "attn_cp_rank",
                s.attn_cp_rank,
                "attn_cp_size",
                s.attn_cp_size,
            ),
            ("pp_rank", s.pp_rank, "pp_size", s.pp_size),
            ("dcp_rank", s.dcp_rank, "dcp_size", s.dcp_size),
        ] {
            if rank >= size {
                self.push(
                    Problem::new(
                        ProblemCode::RankOutOfRange,
                        format!(
                            "{side} {rank_name}={rank} is out of range for {size_name}={size} (valid: 0..={})",
                            size - 1
                        ),
                        format!(
                            "export the descriptor from a real {side} rank, or fix {rank_name}/{size_name}; \
                             SGLang would silently use rank {} instead",
                            rank % size
                        ),
                    )
                    .with(format!("{side}.{rank_name}"), rank)
                    .with(format!("{side}.{size_name}"), size),
                );
            }
        }
    }

    /// `KVB-E023`: DCP groups nest inside attention TP.
    fn dcp_nested(&mut self, s: &PeerDescriptor, side: &str) {
        if s.attn_tp_size % s.dcp_size != 0 {
            self.push(
                Problem::new(
                    ProblemCode::DcpNotNested,
                    format!(
                        "{side} dcp_size={} does not divide attn_tp_size={}: DCP groups are nested inside \
                         attention TP",
                        s.dcp_size, s.attn_tp_size
                    ),
                    format!(
                        "choose a {side} dcp_size that divides attn_tp_size={} (e.g. {})",
                        s.attn_tp_size, s.attn_tp_size
                    ),
                )
                .with(format!("{side}.dcp_size"), s.dcp_size)
                .with(format!("{side}.attn_tp_size"), s.attn_tp_size),
            );
        } else if s.attn_tp_rank < s.attn_tp_size && s.dcp_rank != s.attn_tp_rank % s.dcp_size {
            self.push(
                Problem::new(
                    ProblemCode::DcpNotNested,
                    format!(
                        "{side} dcp_rank={} but attn_tp_rank={} with dcp_size={} implies dcp_rank={}",
                        s.dcp_rank,
                        s.attn_tp_rank,
                        s.dcp_size,
                        s.attn_tp_rank % s.dcp_size
                    ),
                    format!(
                        "set {side} dcp_rank to attn_tp_rank mod dcp_size = {}",
                        s.attn_tp_rank % s.dcp_size
                    ),
                )
                .with(format!("{side}.dcp_rank"), s.dcp_rank)
                .with(format!("{side}.attn_tp_rank"), s.attn_tp_rank),
            );
        }
    }

    /// `KVB-E025`, `KVB-E026` for an MHA pool: head geometry given, heads split over TP.
    /// Returns whether the heads split (so item lengths can be checked against them).
    fn heads_split(&mut self, s: &PeerDescriptor, side: &str) -> bool {
        if s.kv_pool != PoolKind::Mha {
            return false;
        }
        let missing: Vec<&str> = [
            ("total_kv_heads", s.total_kv_heads),
            ("head_dim", s.head_dim),
        ]
        .iter()
        .filter(|(_, v)| v.unwrap_or(0) == 0)
        .map(|(n, _)| *n)
        .collect();
        if !missing.is_empty() {
            self.push(
                Problem::new(
                    ProblemCode::HeadGeometry,
                    format!(
                        "{side} kv_pool=mha needs total_kv_heads and head_dim (missing or 0: {})",
                        missing.join(", ")
                    ),
                    format!(
                        "add the model's num_key_value_heads as total_kv_heads and its head_dim to the \
                         {side} descriptor"
                    ),
                )
                .with(format!("{side}.kv_pool"), "mha"),
            );
            return false;
        }
        let h = s.total_kv_heads.unwrap_or(1);
        let tp = s.attn_tp_size;
        let splits = if tp <= h { h % tp == 0 } else { tp % h == 0 };
        if splits {
            return true;
        }
        let how = if tp <= h {
            format!("{h} heads do not divide evenly over {tp} ranks")
        } else {
            format!("{tp} ranks cannot replicate {h} heads evenly ({tp} is not a multiple of {h})")
        };
        self.push(
            Problem::new(
                ProblemCode::HeadsDoNotSplit,
                format!("{side} total_kv_heads={h} cannot be split across attn_tp_size={tp}: {how}"),
                format!(
                    "use a {side} attention TP size that divides {h} or is a multiple of it (e.g. {})",
                    nearest_split(h, tp)
                ),
            )
            .with(format!("{side}.total_kv_heads"), h)
            .with(format!("{side}.attn_tp_size"), tp),
        );
        false
    }

    fn item_lens(&mut self, s: &PeerDescriptor, side: &str, heads_ok: bool) {
        let lens = &s.kv_item_lens;
        let (n, nd) = (lens.len(), s.num_draft_entries);
        let bad = malformed_item_lens(s);
        if !bad.is_empty() {
            self.push(
                Problem::new(
                    ProblemCode::ItemLensMalformed,
                    format!("{side} kv_item_lens {lens:?} (num_draft_entries={nd}): {}", bad.join("; ")),
                    format!(
                        "export kv_item_lens from the {side} pool as registered: bytes per page of every \
                         entry (page_size x bytes per token), target entries then draft entries"
                    ),
                )
                .with(format!("{side}.kv_item_lens"), format!("{lens:?}"))
                .with(format!("{side}.page_size"), s.page_size),
            );
            return;
        }

        let targets = &lens[..n - nd];
        match s.kv_pool {
            PoolKind::Mha if heads_ok => self.mha_item_lens(s, side, targets),
            PoolKind::Mla if targets.iter().any(|&l| l != targets[0]) => {
                self.push(
                    Problem::new(
                        ProblemCode::ItemLensVsHeads,
                        format!(
                            "{side} kv_pool=mla but its target entries have different item lengths {}: \
                             every MLA layer holds the same latent vector per token",
                            python_set(targets)
                        ),
                        format!(
                            "if the {side} pool mixes MLA layers with other per-layer state, declare \
                             kv_pool=\"hybrid_mla\"; otherwise export kv_item_lens again"
                        ),
                    )
                    .with(format!("{side}.kv_item_lens"), format!("{lens:?}")),
                );
            }
            _ => {}
        }
    }

    /// `KVB-E028` for an MHA pool whose heads split: every target entry is one K or V half of a
    /// layer, `page_size x heads_per_rank x head_dim x dtype bytes`.
    fn mha_item_lens(&mut self, s: &PeerDescriptor, side: &str, targets: &[u64]) {
        let lens = &s.kv_item_lens;
        let h = s.total_kv_heads.unwrap_or(1);
        let hd = u64::from(s.head_dim.unwrap_or(1));
        let hpr = u64::from(s.heads_per_rank().unwrap_or(1));
        let why = mha_item_len_mismatches(s, targets);
        if !why.is_empty() {
            self.push(
                Problem::new(
                    ProblemCode::ItemLensVsHeads,
                    format!(
                        "{side} kv_item_lens do not match the head geometry (total_kv_heads={h}, \
                         attn_tp_size={}, heads_per_rank={hpr}, head_dim={hd}, page_size={}): {}",
                        s.attn_tp_size,
                        s.page_size,
                        why.join("; ")
                    ),
                    format!(
                        "export kv_item_lens, total_kv_heads and head_dim from the same {side} \
                         server; each target entry is page_size x heads_per_rank x head_dim x dtype bytes"
                    ),
                )
                .with(format!("{side}.kv_item_lens"), format!("{lens:?}")),
            );
        }
    }

    fn pool_kinds(&mut self) {
        if self.p.kv_pool != self.d.kv_pool {
            self.push(
                Problem::new(
                    ProblemCode::PoolKindMismatch,
                    format!(
                        "prefill kv_pool={} but decode kv_pool={}: the servers do not hold the same kind of \
                         KV cache",
                        pool_str(self.p.kv_pool),
                        pool_str(self.d.kv_pool)
                    ),
                    "serve the same model with the same attention backend on both sides".to_owned(),
                )
                .with("prefill.kv_pool", pool_str(self.p.kv_pool))
                .with("decode.kv_pool", pool_str(self.d.kv_pool)),
            );
        }
    }

    /// SGLang's decode-side checks, in its order: the settings both servers must share, then
    /// what DCP requires (`KVB-E003`, `E005`, `E006` need fields descriptors do not carry).
    fn decode_side_checks(&mut self) {
        self.same_settings();
        self.dcp_requirements();
    }

    /// `KVB-E001` page size (SGLang mode), `KVB-E002` KV cache dtype, `KVB-E004` KV layout.
    fn same_settings(&mut self) {
        let (p, d) = (self.p, self.d);
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.try_ensure_parallel_info test: e001_page_size_mismatch_sglang_text_and_kvbridge_accepts
        //# if info.page_size is not None and info.page_size != self.kv_args.page_size:
        //# raise RuntimeError(
        //# f"Page size mismatch: prefill server has page_size={info.page_size}, "
        //# f"but decode server has page_size={self.kv_args.page_size}. "
        //# f"Both servers must use the same --page-size value."
        if p.page_size != d.page_size && self.sglang() {
            self.push(
                Problem::new(
                    ProblemCode::PageSizeMismatch,
                    format!(
                        "Page size mismatch: prefill server has page_size={}, but decode server has \
                         page_size={}. Both servers must use the same --page-size value.",
                        p.page_size, d.page_size
                    ),
                    format!(
                        "start both servers with the same physical --page-size (e.g. {}); under DCP the \
                         virtual page (page_size x dcp_size) is derived, not configured. kvbridge's default \
                         mode (--compat kvbridge) supports different page sizes",
                        p.page_size
                    ),
                )
                .with("prefill.page_size", p.page_size)
                .with("decode.page_size", d.page_size),
            );
        }
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.try_ensure_parallel_info test: e002_dtype_mismatch
        //# and info.kv_cache_dtype != self.kv_cache_dtype_str
        //# ):
        //# raise RuntimeError(
        //# f"KV cache dtype mismatch: prefill server has kv_cache_dtype={info.kv_cache_dtype}, "
        //# f"but decode server has kv_cache_dtype={self.kv_cache_dtype_str}. "
        //# f"Both servers must use the same --kv-cache-dtype value."
        if p.kv_cache_dtype != d.kv_cache_dtype {
            self.push(
                Problem::new(
                    ProblemCode::DtypeMismatch,
                    format!(
                        "KV cache dtype mismatch: prefill server has kv_cache_dtype={}, but decode server has \
                         kv_cache_dtype={}. Both servers must use the same --kv-cache-dtype value.",
                        p.kv_cache_dtype, d.kv_cache_dtype
                    ),
                    format!(
                        "start both servers with the same --kv-cache-dtype (e.g. {}); KV bytes are copied \
                         verbatim, never converted",
                        p.kv_cache_dtype
                    ),
                )
                .with("prefill.kv_cache_dtype", &p.kv_cache_dtype)
                .with("decode.kv_cache_dtype", &d.kv_cache_dtype),
            );
        }
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.try_ensure_parallel_info test: e004_layout_mismatch_only_when_both_set
        //# info.kv_layout is not None
        //# and self.kv_layout is not None
        //# and info.kv_layout != self.kv_layout
        //# ):
        //# raise RuntimeError(
        //# f"KV layout mismatch: prefill server has kv_layout={info.kv_layout}, "
        //# f"but decode server has kv_layout={self.kv_layout}. Both servers "
        //# f"must use the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT."
        if let (Some(pl), Some(dl)) = (&p.kv_layout, &d.kv_layout) {
            if pl != dl {
                self.push(
                    Problem::new(
                        ProblemCode::LayoutMismatch,
                        format!(
                            "KV layout mismatch: prefill server has kv_layout={pl}, but decode server has \
                             kv_layout={dl}. Both servers must use the same --dsv4-attn-backend and \
                             SGLANG_DSV4_KV_LAYOUT."
                        ),
                        "use the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT on both servers".to_owned(),
                    )
                    .with("prefill.kv_layout", layout_str(&p.kv_layout))
                    .with("decode.kv_layout", layout_str(&d.kv_layout)),
                );
            }
        }
    }

    /// `KVB-E007` DCP needs an MLA pool, `KVB-E008` prefill attention CP 1, `KVB-E009` no
    /// prefill KV-cache sharding (for a prefill with DCP too, in kvbridge mode).
    fn dcp_requirements(&mut self) {
        let (p, d) = (self.p, self.d);
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.try_ensure_parallel_info test: e007_decode_dcp_needs_mla_pool
        //# if self.dcp_size > 1:
        //# if not (self.is_mla_backend or self.is_hybrid_mla_backend):
        //# raise RuntimeError(
        //# "PD decode DCP requires an MLA or hybrid-MLA KV pool."
        if d.dcp_size > 1 && d.kv_pool == PoolKind::Mha {
            self.push(
                Problem::new(
                    ProblemCode::DcpNeedsMlaPool,
                    "PD decode DCP requires an MLA or hybrid-MLA KV pool.",
                    format!(
                        "start the decode with --dcp-size 1: GQA/MHA KV is split across ranks by heads (TP), \
                         not by position (decode has dcp_size={}); DCP is for MLA models (DeepSeek V2/V3)",
                        d.dcp_size
                    ),
                )
                .with("decode.dcp_size", d.dcp_size)
                .with("decode.kv_pool", "mha"),
            );
        }
        if !self.sglang() && p.dcp_size > 1 && p.kv_pool == PoolKind::Mha {
            self.push(
                Problem::new(
                    ProblemCode::DcpNeedsMlaPool,
                    "PD prefill DCP requires an MLA or hybrid-MLA KV pool.",
                    format!(
                        "start the prefill with --dcp-size 1 (it has dcp_size={}): GQA/MHA KV is split by \
                         heads, not by position",
                        p.dcp_size
                    ),
                )
                .with("prefill.dcp_size", p.dcp_size)
                .with("prefill.kv_pool", "mha"),
            );
        }
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.try_ensure_parallel_info test: e008_dcp_needs_prefill_cp1
        //# if info.attn_cp_size != 1:
        //# raise RuntimeError(
        //# "PD decode DCP currently requires prefill attention CP=1, "
        //# f"got {info.attn_cp_size}."
        if d.dcp_size > 1 && p.attn_cp_size != 1 {
            self.push(
                Problem::new(
                    ProblemCode::DcpPrefillCp,
                    format!(
                        "PD decode DCP currently requires prefill attention CP=1, got {}.",
                        p.attn_cp_size
                    ),
                    "start the prefill with attention CP 1 when the decode uses DCP".to_owned(),
                )
                .with("prefill.attn_cp_size", p.attn_cp_size)
                .with("decode.dcp_size", d.dcp_size),
            );
        } else if !self.sglang() && p.dcp_size > 1 && p.attn_cp_size != 1 {
            self.push(
                Problem::new(
                    ProblemCode::DcpPrefillCp,
                    format!(
                        "PD prefill DCP requires prefill attention CP=1, got {}.",
                        p.attn_cp_size
                    ),
                    "use either prefill attention CP or prefill DCP, not both".to_owned(),
                )
                .with("prefill.attn_cp_size", p.attn_cp_size)
                .with("prefill.dcp_size", p.dcp_size),
            );
        }
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.try_ensure_parallel_info test: e009_dcp_with_prefill_sharding
        //# if info.enable_kv_cache_sharding:
        //# raise RuntimeError(
        //# "PD decode DCP does not support a prefill with "
        //# "--enable-kv-cache-sharding."
        if p.kv_cache_sharding && (d.dcp_size > 1 || !self.sglang() && p.dcp_size > 1) {
            self.push(
                Problem::new(
                    ProblemCode::DcpPrefillSharding,
                    "PD decode DCP does not support a prefill with --enable-kv-cache-sharding.",
                    "start the prefill without --enable-kv-cache-sharding when DCP is used"
                        .to_owned(),
                )
                .with("prefill.kv_cache_sharding", true)
                .with("prefill.dcp_size", p.dcp_size)
                .with("decode.dcp_size", d.dcp_size),
            );
        }
    }

    fn head_geometry_cross(&mut self) {
        let (p, d) = (self.p, self.d);
        if p.kv_pool != PoolKind::Mha || d.kv_pool != PoolKind::Mha {
            return;
        }
        for (name, a, b) in [
            ("total_kv_heads", p.total_kv_heads, d.total_kv_heads),
            ("head_dim", p.head_dim, d.head_dim),
        ] {
            if let (Some(a), Some(b)) = (a, b) {
                if a != b && a != 0 && b != 0 {
                    self.push(
                        Problem::new(
                            ProblemCode::HeadGeometry,
                            format!(
                                "prefill {name}={a} but decode {name}={b}: the servers do not serve the same model"
                            ),
                            "serve the same model on both sides and export both descriptors again".to_owned(),
                        )
                        .with(format!("prefill.{name}"), a)
                        .with(format!("decode.{name}"), b),
                    );
                }
            }
        }
    }

    fn tp_multiple(&mut self) {
        let (tp_p, tp_d) = (self.p.attn_tp_size, self.d.attn_tp_size);
        let (lo, hi) = (tp_p.min(tp_d), tp_p.max(tp_d));
        if hi % lo != 0 {
            let consequence = if tp_d > tp_p {
                let t = (tp_d - 1) / (tp_d / tp_p);
                format!(
                    "SGLang would map decode rank {} to prefill rank {t}, which does not exist",
                    tp_d - 1
                )
            } else {
                let k = tp_p / tp_d;
                format!(
                    "SGLang would leave prefill ranks {}..={} without a decode peer",
                    tp_d * k,
                    tp_p - 1
                )
            };
            self.push(
                Problem::new(
                    ProblemCode::TpNotMultiple,
                    format!(
                        "attention TP sizes must divide one another, got prefill attn_tp_size={tp_p} and decode \
                         attn_tp_size={tp_d} ({consequence})"
                    ),
                    format!(
                        "choose TP sizes where the larger is a multiple of the smaller (e.g. decode {} or {} \
                         with prefill {tp_p})",
                        lo_multiple(tp_p, tp_d),
                        tp_p
                    ),
                )
                .with("prefill.attn_tp_size", tp_p)
                .with("decode.attn_tp_size", tp_d),
            );
        }
    }

    fn mapping_preconditions(&mut self) {
        let (p, d) = (self.p, self.d);
        if d.kv_pool == PoolKind::Mla
            && p.kv_cache_sharding
            && p.attn_cp_size == 1
            && p.attn_tp_size != d.attn_tp_size
        {
            let f = mla_sharding_failure(p.attn_tp_size, d.attn_tp_size);
            self.push(
                Problem::new(f.code, f.message, f.remedy)
                    .with("prefill.kv_cache_sharding", true)
                    .with("prefill.attn_tp_size", p.attn_tp_size)
                    .with("decode.attn_tp_size", d.attn_tp_size),
            );
        }
        if d.attn_cp_size != 1 {
            let f = decode_cp_failure(d.attn_cp_size);
            self.push(
                Problem::new(f.code, f.message, f.remedy)
                    .with("decode.attn_cp_size", d.attn_cp_size),
            );
        }
        if d.pp_size != p.pp_size && d.pp_size != 1 {
            let f = pp_failure(d.pp_size, p.pp_size);
            self.push(
                Problem::new(f.code, f.message, f.remedy)
                    .with("decode.pp_size", d.pp_size)
                    .with("prefill.pp_size", p.pp_size),
            );
        }
    }

    /// SGLang's DCP topology check (`KVB-E013`, `KVB-E014`), run for each prefill rank this
    /// decode rank registers with.
    fn dcp_topology(&mut self) {
        let (p, d) = (self.p, self.d);
        let (a, b) = (p.dcp_size, d.dcp_size);
        if !self.sglang() {
            return; // kvbridge: MLA any a -> b is supported; MHA with DCP is KVB-E007.
        }
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.requires_dcp_relayout test: topology_2_to_2_mismatched_ranks
        //# if self.dcp_size == dst_dcp_size:
        //# if self.dcp_rank != dst_dcp_rank:
        //# raise RuntimeError(
        //# "PD peers must connect matching DCP ranks, got "
        //# f"prefill={self.dcp_rank}, decode={dst_dcp_rank}"
        if a == b {
            if a == 1 {
                return;
            }
            let input = mapping_input(p, d, &self.opts);
            let Ok(t) = sglang_targets(&input) else {
                return; // precondition problems are already reported
            };
            let e = d.attn_tp_rank;
            for &tp in &t.target_tp_ranks {
                let pr = tp % a;
                let dr = d.dcp_rank;
                if pr != dr {
                    self.push(
                        Problem::new(
                            ProblemCode::DcpRankMismatch,
                            format!("PD peers must connect matching DCP ranks, got prefill={pr}, decode={dr}"),
                            format!(
                                "with equal DCP sizes use equal attention TP sizes so decode rank r maps to \
                                 prefill rank r (decode rank {e} maps to prefill TP rank {tp}); kvbridge's \
                                 default mode maps DCP ranks by the owner rule instead"
                            ),
                        )
                        .with("prefill.attn_tp_size", p.attn_tp_size)
                        .with("decode.attn_tp_size", d.attn_tp_size)
                        .with("mapped prefill tp_rank", tp),
                    );
                }
            }
        } else if !(a == 1 && p.is_mla_like()) {
            //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.requires_dcp_relayout test: topology_1_to_4_mha_unsupported, topology_4_to_1_and_4_to_2_unsupported_in_sglang
            //# self.dcp_size == 1
            //# and dst_dcp_size > 1
            //# and (self.is_mla_backend or self.is_hybrid_mla_backend)
            let remedy = if a == 1 {
                "only MLA/hybrid-MLA pools can be relaid from a prefill without DCP; use --dcp-size 1 on \
                 the decode for MHA/GQA models"
                    .to_owned()
            } else {
                format!(
                    "SGLang relays only prefill DCP 1 -> decode DCP N or equal DCP sizes: run the prefill with \
                     DCP 1 (or {b}); kvbridge's default mode supports {a} -> {b} for MLA pools"
                )
            };
            self.push(
                Problem::new(
                    ProblemCode::DcpTopology,
                    //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.requires_dcp_relayout test: topology_4_to_1_and_4_to_2_unsupported_in_sglang
                    //# f"Unsupported PD DCP topology: {self.dcp_size} -> {dst_dcp_size}"
                    format!("Unsupported PD DCP topology: {a} -> {b}"),
                    remedy,
                )
                .with("prefill.dcp_size", a)
                .with("decode.dcp_size", b)
                .with("prefill.kv_pool", pool_str(p.kv_pool)),
            );
        }
    }

    /// Per-entry geometry: the DCP relayout's (`KVB-E015`, `KVB-E016`) or, on the page, head
    /// slice and row paths, entries paired by position (`KVB-E030`, `KVB-E031`).
    fn entry_geometry(&mut self) {
        let (p, d) = (self.p, self.d);
        if p.kv_pool != d.kv_pool || p.kv_item_lens.is_empty() || d.kv_item_lens.is_empty() {
            return;
        }
        if p.num_draft_entries > p.kv_item_lens.len() || d.num_draft_entries > d.kv_item_lens.len()
        {
            return;
        }
        let path = transfer_path(p, d, self.opts.compat);
        let dcp = p.dcp_size > 1 || d.dcp_size > 1;
        let relayout = matches!(path, TransferPath::DcpTokenPlan)
            || matches!(path, TransferPath::Rows { .. }) && dcp;
        if relayout {
            self.relayout_geometry();
            return;
        }
        if p.pp_size != d.pp_size {
            return; // decode PP 1 against pipelined prefill: entries are sliced per stage.
        }
        self.paired_geometry(path);
    }

    /// `KVB-E030`, `KVB-E031`: entries paired by position hold the same bytes per page, per token
    /// or per head and token, as the path moves them.
    // Entries of both sides are indexed in lockstep.
    #[allow(clippy::needless_range_loop)]
    fn paired_geometry(&mut self, path: TransferPath) {
        let (p, d) = (self.p, self.d);
        let (n, nd) = (p.kv_item_lens.len(), p.num_draft_entries);
        let dst = &d.kv_item_lens;
        if dst.len() != n || d.num_draft_entries != nd {
            self.push(
                Problem::new(
                    ProblemCode::EntryCount,
                    format!(
                        "prefill registers {n} KV entries (draft={nd}) but decode registers {} (draft={}); \
                         entries are paired by position",
                        dst.len(),
                        d.num_draft_entries
                    ),
                    "serve the same model with the same speculative-decoding draft on both sides".to_owned(),
                )
                .with("prefill.kv_item_lens.len", n)
                .with("decode.kv_item_lens.len", dst.len()),
            );
            return;
        }
        let (what, sdiv, ddiv): (&str, u64, u64) = match path {
            TransferPath::Pages if p.page_size == d.page_size => ("bytes per page", 1, 1),
            TransferPath::HeadSlices | TransferPath::Rows { head_slices: true } => (
                "bytes per head per token",
                p.page_size * u64::from(p.heads_per_rank().unwrap_or(1)),
                d.page_size * u64::from(d.heads_per_rank().unwrap_or(1)),
            ),
            _ => ("bytes per token", p.page_size, d.page_size),
        };
        for i in 0..n {
            let (s, t) = (p.kv_item_lens[i], dst[i]);
            let draft = i >= n - nd;
            let (sdiv, ddiv) = if draft && what != "bytes per page" {
                (sdiv * u64::from(p.dcp_size), ddiv * u64::from(d.dcp_size))
            } else {
                (sdiv, ddiv)
            };
            if s / sdiv != t / ddiv {
                self.push(
                    Problem::new(
                        ProblemCode::EntryGeometry,
                        format!(
                            "KV entry geometry differs at entry {i}: prefill {what}={}, decode {what}={} \
                             (prefill item_len={s}, decode item_len={t})",
                            s / sdiv,
                            t / ddiv
                        ),
                        "serve the same model with the same KV dtype on both sides; the page path copies \
                         whole prefill pages into decode pages of the same size"
                            .to_owned(),
                    )
                    .with(format!("prefill.kv_item_lens[{i}]"), s)
                    .with(format!("decode.kv_item_lens[{i}]"), t),
                );
            }
        }
    }

    /// `KVB-E015`, `KVB-E016` on a DCP relayout (docs/planning.md, "DCP geometry check"): one
    /// decode entry per prefill entry with the same bytes per token; every differing entry is
    /// reported.
    fn relayout_geometry(&mut self) {
        let (p, d) = (self.p, self.d);
        let (n, nd) = (p.kv_item_lens.len(), p.num_draft_entries);
        let dst = &d.kv_item_lens;
        let (count_ok, mismatches) = relayout_mismatches(p, d);
        if !count_ok {
            self.push(
                Problem::new(
                    ProblemCode::DcpEntryCount,
                    format!(
                        "PD DCP requires the decode to register one KV entry per prefill entry: src={n} \
                         (draft={nd}), dst={}",
                        dst.len()
                    ),
                    "register the same layers (and the same speculative-decoding draft layers) on both \
                     sides; with DCP neither side may be pipelined differently"
                        .to_owned(),
                )
                .with("prefill.kv_item_lens.len", n)
                .with("decode.kv_item_lens.len", dst.len()),
            );
        }
        for (i, src_tok, dst_tok, scale) in mismatches {
            self.push(
                Problem::new(
                    ProblemCode::DcpEntryGeometry,
                    format!(
                        "PD DCP source/destination KV geometry differs at entry {i}: src token \
                         bytes={src_tok}, dst token bytes={dst_tok} (dst item_len={}, page scale={scale})",
                        dst[i]
                    ),
                    format!(
                        "register per-entry lengths from the same model on both sides: target entries \
                         hold page_size x token bytes, draft entries page_size x dcp_size x token bytes \
                         (entry {i}: expected decode item_len {})",
                        src_tok.saturating_mul(scale)
                    ),
                )
                .with(format!("prefill.kv_item_lens[{i}]"), p.kv_item_lens[i])
                .with(format!("decode.kv_item_lens[{i}]"), dst[i]),
            );
        }
    }

    /// `KVB-E018`: head slicing assumes one item length for every KV entry.
    fn head_slice_item_lens(&mut self) {
        let (p, d) = (self.p, self.d);
        if p.kv_pool != PoolKind::Mha || p.attn_tp_size == d.attn_tp_size {
            return;
        }
        for (side, s) in [("prefill", p), ("decode", d)] {
            let lens = &s.kv_item_lens;
            //= sglang 0.5.23 sglang/srt/disaggregation/mooncake/conn.py MooncakeKVManager.send_kvcache_slice test: e018_head_slicing_needs_one_item_length
            //# item_len != src_kv_item_len for item_len in self.kv_args.kv_item_lens
            //# ):
            //# logger.error(
            //# f"[{mooncake_session_id}] head-sliced transfer assumes one item "
            //# f"length for every KV entry, got {set(self.kv_args.kv_item_lens)}"
            if lens.iter().any(|&l| l != lens[0]) {
                self.push(
                    Problem::new(
                        ProblemCode::HeadSliceItemLens,
                        format!(
                            "head-sliced transfer assumes one item length for every KV entry, got {}",
                            python_set(lens)
                        ),
                        format!(
                            "with different attention TP sizes every {side} KV entry (draft included) must have \
                             the same item length: use equal TP sizes, or a draft model with the same KV \
                             geometry"
                        ),
                    )
                    .with(format!("{side}.kv_item_lens"), format!("{lens:?}")),
                );
            }
        }
    }

    fn aux(&mut self) {
        let (p, d) = (self.p, self.d);
        let (m, n) = (p.aux_item_lens.len(), d.aux_item_lens.len());
        let common = m.min(n);
        let differing: Vec<usize> = (0..common)
            .filter(|&j| p.aux_item_lens[j] != d.aux_item_lens[j])
            .collect();
        if !differing.is_empty() {
            let mut detail = String::new();
            for &j in &differing {
                let _ = write!(
                    detail,
                    "{}buffer {j}: prefill {} B/row, decode {} B/row",
                    if detail.is_empty() { "" } else { "; " },
                    p.aux_item_lens[j],
                    d.aux_item_lens[j]
                );
            }
            self.push(
                Problem::new(
                    ProblemCode::AuxLayout,
                    format!(
                        "aux (metadata) buffers differ: {detail} (prefill aux_item_lens={:?}, decode \
                         aux_item_lens={:?}); rows would land in the wrong buffer or be cut",
                        p.aux_item_lens, d.aux_item_lens
                    ),
                    "enable the same optional metadata buffers on both servers \
                     (--disaggregation-enable-kv-checksum, SGLANG_ENABLE_DISAGG_SAMPLING_MASK, the DSA top-k \
                     buffer) and the same speculative decoding settings"
                        .to_owned(),
                )
                .with("prefill.aux_item_lens", format!("{:?}", p.aux_item_lens))
                .with("decode.aux_item_lens", format!("{:?}", d.aux_item_lens)),
            );
        } else if m != n {
            self.push(
                Problem::new(
                    ProblemCode::AuxCount,
                    format!(
                        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.check_peer_aux_buffer_count test: w002_extra_trailing_aux_buffer_is_a_warning
                        //# "Decode %s registered %d metadata buffers but this prefill has %d; "
                        //# "only the first %d are transferred, and misaligned if the extra "
                        //# "buffer is not the last. An optional metadata buffer is enabled on "
                        //# "one engine only: --disaggregation-enable-kv-checksum, "
                        //# "SGLANG_ENABLE_DISAGG_SAMPLING_MASK, or the DSA top-k buffer.",
                        "Decode attn_tp_rank={} registered {n} metadata buffers but this prefill has {m}; only \
                         the first {common} are transferred, and misaligned if the extra buffer is not the last. \
                         An optional metadata buffer is enabled on one engine only: \
                         --disaggregation-enable-kv-checksum, SGLANG_ENABLE_DISAGG_SAMPLING_MASK, or the DSA \
                         top-k buffer.",
                        d.attn_tp_rank
                    ),
                    "enable the same optional metadata buffers on both servers".to_owned(),
                )
                .with("prefill.aux_item_lens.len", m)
                .with("decode.aux_item_lens.len", n),
            );
        }
    }
}

/// The DCP relayout's entry count check and every entry whose bytes per token differ, as
/// `(entry, src token bytes, dst token bytes, page scale)`.
// Entries of both sides are indexed in lockstep.
#[allow(clippy::needless_range_loop)]
fn relayout_mismatches(
    p: &PeerDescriptor,
    d: &PeerDescriptor,
) -> (bool, Vec<(usize, u64, u64, u64)>) {
    let (n, nd) = (p.kv_item_lens.len(), p.num_draft_entries);
    let dst = &d.kv_item_lens;
    let b = u64::from(d.dcp_size);
    let mut count_ok = dst.len() == n;
    let mut mismatches: Vec<(usize, u64, u64, u64)> = Vec::new();
    if p.dcp_size == 1 && p.page_size == d.page_size {
        // SGLang-defined relayout: kvbridge-geometry's check, entry by entry so that
        // every differing entry is reported (it stops at the first).
        let all: Vec<Option<u64>> = dst.iter().map(|&l| Some(l)).collect();
        if let Err(GeometryError::DcpEntryCount { .. }) =
            prepare_dcp_token_item_lens(&p.kv_item_lens, nd, p.page_size, &all, b)
        {
            count_ok = false;
        }
        if count_ok {
            for i in 0..n {
                let draft = usize::from(i >= n - nd);
                if let Err(GeometryError::DcpGeometryDiffers {
                    src_token_bytes,
                    dst_token_bytes,
                    page_scale,
                    ..
                }) = prepare_dcp_token_item_lens(
                    &p.kv_item_lens[i..=i],
                    draft,
                    p.page_size,
                    &[Some(dst[i])],
                    b,
                ) {
                    mismatches.push((i, src_token_bytes, dst_token_bytes, page_scale));
                }
            }
        }
    } else if count_ok {
        // kvbridge's owner-rule rows: the same check with a prefill DCP size `a` (prefill
        // draft entries use page_size·a) and possibly different page sizes.
        for i in 0..n {
            let (src_scale, scale) = if i >= n - nd {
                (p.page_size * u64::from(p.dcp_size), d.page_size * b)
            } else {
                (p.page_size, d.page_size)
            };
            let (src_tok, dst_tok) = (p.kv_item_lens[i] / src_scale, dst[i] / scale);
            if src_tok != dst_tok {
                mismatches.push((i, src_tok, dst_tok, scale));
            }
        }
    }
    (count_ok, mismatches)
}

/// What is wrong with one side's `kv_item_lens` in themselves (`KVB-E027`): empty, more draft
/// entries than entries, zero or not a whole number of pages.
fn malformed_item_lens(s: &PeerDescriptor) -> Vec<String> {
    let lens = &s.kv_item_lens;
    let n = lens.len();
    let nd = s.num_draft_entries;
    let draft_scale = s.page_size * u64::from(s.dcp_size);
    let mut bad = Vec::new();
    if n == 0 {
        bad.push("kv_item_lens is empty (no KV entries registered)".to_owned());
    }
    if nd > n {
        bad.push(format!(
            "num_draft_entries={nd} exceeds the {n} entries of kv_item_lens"
        ));
    } else if n > 0 && nd == n {
        bad.push(format!(
            "all {n} entries are draft entries (num_draft_entries={nd}); no target KV"
        ));
    }
    for (i, &len) in lens.iter().enumerate() {
        let draft = i >= n.saturating_sub(nd);
        let scale = if draft { draft_scale } else { s.page_size };
        if len == 0 {
            bad.push(format!("entry {i} has item_len 0"));
        } else if len % scale != 0 {
            bad.push(if draft {
                format!(
                    "draft entry {i} item_len={len} is not a multiple of page_size·dcp_size={scale} \
                     (draft KV uses the virtual page)"
                )
            } else {
                format!("entry {i} item_len={len} is not a multiple of page_size={scale}")
            });
        }
    }
    bad
}

/// Why MHA target entries do not match the head geometry (empty when they do).
fn mha_item_len_mismatches(s: &PeerDescriptor, targets: &[u64]) -> Vec<String> {
    let hd = u64::from(s.head_dim.unwrap_or(1));
    let hpr = u64::from(s.heads_per_rank().unwrap_or(1));
    let per_elem = s.page_size * hpr * hd;
    let mut why = Vec::new();
    // Head-major pages (vLLM's layout) hold a layer's K and V in one entry.
    if targets.len() % 2 != 0 && !s.is_head_major() {
        why.push(format!(
            "an MHA pool registers K and V per layer, so the {} target entries must be even",
            targets.len()
        ));
    }
    if targets.iter().any(|&l| l != targets[0]) {
        why.push(format!("target entries differ ({})", python_set(targets)));
    }
    let expect_elem = dtype_bytes(&s.kv_cache_dtype);
    for &l in targets.iter().collect::<BTreeSet<_>>() {
        if l % per_elem != 0 {
            why.push(format!(
                "item_len {l} is not page_size({}) x heads_per_rank({hpr}) x head_dim({hd}) x \
                 bytes per element",
                s.page_size
            ));
        } else if let Some(e) = expect_elem.filter(|e| l / per_elem != *e) {
            why.push(format!(
                "item_len {l} implies {} bytes per element, but kv_cache_dtype={} has {e} \
                 (expected {} = {} x {hpr} x {hd} x {e})",
                l / per_elem,
                s.kv_cache_dtype,
                per_elem * e,
                s.page_size
            ));
        }
    }
    why
}

/// Names for a message: all of them, or the first few and how many more (a peer decides how
/// many there are).
fn listed(names: &[String]) -> String {
    const SHOWN: usize = 16;
    let mut out = names[..names.len().min(SHOWN)].join(", ");
    if names.len() > SHOWN {
        let _ = write!(out, " and {} more", names.len() - SHOWN);
    }
    out
}

fn pool_str(k: PoolKind) -> &'static str {
    match k {
        PoolKind::Mha => "mha",
        PoolKind::Mla => "mla",
        PoolKind::HybridMla => "hybrid_mla",
    }
}

/// A TP size near `tp` that splits `h` heads (divides it or is a multiple of it).
fn nearest_split(h: u32, tp: u32) -> u32 {
    if tp > h {
        tp.div_ceil(h) * h
    } else {
        (1..=tp).rev().find(|t| h % t == 0).unwrap_or(1)
    }
}

/// A decode TP size that is a multiple or divisor of the prefill's, near the given decode size.
fn lo_multiple(tp_p: u32, tp_d: u32) -> u32 {
    if tp_d > tp_p {
        tp_d.div_ceil(tp_p) * tp_p
    } else {
        (1..=tp_d).rev().find(|t| tp_p % t == 0).unwrap_or(1)
    }
}
