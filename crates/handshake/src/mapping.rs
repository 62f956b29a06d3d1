//! Rank mapping (docs/planning.md, "Rank mapping"): which prefill ranks a decode rank talks to, and how many
//! registrations and responses each side waits for.
//!
//! Two layers:
//! * [`sglang_rank_mapping`] is SGLang 0.5.23's `_resolve_rank_mapping`, rule for rule,
//!   including its lack of a divisibility check (decode TP 6 against prefill TP 4 targets the
//!   non-existent prefill rank 5). [`crate::check`] refuses such inputs before mapping.
//! * [`RankMapping`] (from [`crate::check_with`] or [`rank_mapping`]) is what the coordinator
//!   uses: the target ranks plus the ordered bootstrap list ([`PeerTarget`]), dummy flags,
//!   per-peer registration counts, DCP ranks and the transfer path. Where SGLang defines the
//!   result it is SGLang's; kvbridge's any-to-any DCP topologies use the owner rule (below).
//!
//! **Owner rule (any prefill DCP `a` → decode DCP `b`, MLA/hybrid-MLA).** Prefill DCP rank
//! `a_r` holds position `p` iff `p mod a == a_r`; decode DCP rank `b_r` needs `p` iff
//! `p mod b == b_r`. Both hold for some `p` iff `a_r ≡ b_r (mod gcd(a, b))`, so decode rank
//! `b_r` receives from the `a / gcd(a, b)` prefill DCP ranks `{a_r : a_r ≡ b_r mod gcd}`.
//! DCP ranks are nested in attention TP (`dcp_rank = tp_rank mod dcp_size`); of the prefill
//! TP ranks holding DCP rank `a_r`, decode rank `e` uses the one in the DCP group of SGLang's
//! base target (`e div (tp_d div tp_p)` or `e · (tp_p div tp_d)`). Prefill ranks no decode
//! rank reads from get metadata as dummies from the decode rank whose SGLang range contains
//! them, so every prefill rank still learns every room.
//!
//! ```text
//!  prefill DCP 2 (TP 2)          decode DCP 4 (TP 4)
//!  rank 0: p = 0,2,4,6,... ──┬──> rank 0: p = 0,4,8,...
//!                            └──> rank 2: p = 2,6,10,...
//!  rank 1: p = 1,3,5,7,... ──┬──> rank 1: p = 1,5,9,...
//!                            └──> rank 3: p = 3,7,11,...
//! ```
//!
//! **Exact head plan (MHA/GQA, kvbridge).** When the prefill TP size exceeds both the decode TP
//! size and the KV head count, the prefill replicates heads and SGLang reads every replica (the
//! same bytes `tp_p / heads` times). kvbridge reads each decode head from exactly one replica
//! (`kvbridge_geometry::HeadSharding::sources_for`); the other ranks of SGLang's range become
//! dummies. Every peer that sends head slices carries its [`HeadRange`].

use std::collections::BTreeSet;

use kvbridge_geometry::{
    HeadSharding, HeadSlice, PoolKind, compute_head_slice_params, reshard_sources,
};
use serde::Serialize;

use crate::error::{HandshakeError, Result};
use crate::limits::{MAX_DEPLOYMENT_RANKS, MAX_GROUP_SIZE};
use crate::problem::ProblemCode;

/// Inputs of SGLang's rank mapping (docs/planning.md, "Rank mapping"), decode side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappingInput {
    /// Decode attention TP size (`tp_d`).
    pub decode_tp_size: u32,
    /// Decode engine rank (attention TP rank); reduced `mod tp_d` as SGLang does.
    pub decode_engine_rank: u32,
    /// Decode attention CP size (must be 1).
    pub decode_cp_size: u32,
    /// Decode PP size.
    pub decode_pp_size: u32,
    /// Decode PP rank.
    pub decode_pp_rank: u32,
    /// Decode pool kind.
    pub decode_pool: PoolKind,
    /// Decode runs `--enable-kv-cache-sharding` (implies all-CP transfer).
    pub decode_kv_cache_sharding: bool,
    /// Prefill attention TP size (`tp_p`).
    pub prefill_tp_size: u32,
    /// Prefill attention CP size (`cp_p`).
    pub prefill_cp_size: u32,
    /// Prefill PP size (`pp_p`).
    pub prefill_pp_size: u32,
    /// Prefill runs `--enable-kv-cache-sharding`.
    pub prefill_kv_cache_sharding: bool,
    /// Prefill `enable_dsa_cache_layer_split` (not carried by descriptors; DSA is out of scope).
    pub prefill_dsa_layer_split: bool,
    /// `SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER` on the decode.
    pub all_cp_ranks_transfer: bool,
}

impl MappingInput {
    /// SGLang's `all_cp`: the env flag, or a hybrid-MLA decode pool, or decode KV sharding.
    pub fn all_cp(&self) -> bool {
        self.all_cp_ranks_transfer
            || self.decode_pool == PoolKind::HybridMla
            || self.decode_kv_cache_sharding
    }

    /// Decode engine rank reduced modulo the decode TP size (`e` in docs/planning.md, "Rank mapping").
    pub fn engine_rank(&self) -> u32 {
        self.decode_engine_rank % self.decode_tp_size.max(1)
    }
}

/// The six values SGLang's rank mapping fills into `PrefillServerInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TargetRanks {
    /// The "main" prefill TP rank (`None` = all ranks are real, MLA with prefill sharding).
    pub target_tp_rank: Option<u32>,
    /// Prefill attention TP ranks this decode rank registers with.
    pub target_tp_ranks: Vec<u32>,
    /// Prefill attention CP ranks this decode rank registers with.
    pub target_cp_ranks: Vec<u32>,
    /// Prefill PP ranks this decode rank registers with.
    pub target_pp_ranks: Vec<u32>,
    /// How many decode ranks register the same room at each target prefill rank.
    pub required_dst_info_num: u32,
    /// How many distinct prefill ranks' Success this decode rank waits for.
    pub required_prefill_response_num: u32,
}

/// A failed mapping precondition, with the problem code `check` reports for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MappingFailure {
    pub(crate) code: ProblemCode,
    pub(crate) message: String,
    pub(crate) remedy: String,
}

impl From<MappingFailure> for HandshakeError {
    fn from(f: MappingFailure) -> Self {
        HandshakeError::MappingPrecondition {
            message: f.message,
            remedy: f.remedy,
        }
    }
}

pub(crate) fn mla_sharding_failure(tp_p: u32, tp_d: u32) -> MappingFailure {
    MappingFailure {
        code: ProblemCode::MlaShardingTp,
        message: format!(
            //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: e010_mla_sharding_needs_equal_tp
            //# "MLA KV cache sharding requires equal prefill/decode attn TP "
            //# f"sizes, got prefill={info.attn_tp_size} decode={self.attn_tp_size}"
            "MLA KV cache sharding requires equal prefill/decode attn TP sizes, got prefill={tp_p} decode={tp_d}"
        ),
        remedy: format!(
            "run both sides with the same attention TP size (prefill {tp_p}, decode {tp_d}), \
             or start the prefill without --enable-kv-cache-sharding"
        ),
    }
}

pub(crate) fn decode_cp_failure(cp_d: u32) -> MappingFailure {
    MappingFailure {
        code: ProblemCode::DecodeCp,
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: e011_decode_cp_must_be_1
        //# f"Decode cp size ({self.attn_cp_size}) should be equal to 1",
        message: format!("Decode cp size ({cp_d}) should be equal to 1"),
        remedy: "start the decode with attention CP 1; to split the decode KV by position use \
                 decode context parallelism (--dcp-size) instead"
            .to_owned(),
    }
}

pub(crate) fn pp_failure(pp_d: u32, pp_p: u32) -> MappingFailure {
    MappingFailure {
        code: ProblemCode::PpMismatch,
        message: format!(
            //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: e012_pp_sizes
            //# f"Decode pp size ({self.pp_size}) should be equal to prefill pp size ({info.pp_size}) or 1",
            "Decode pp size ({pp_d}) should be equal to prefill pp size ({pp_p}) or 1"
        ),
        remedy: format!(
            "start the decode with --pp-size {pp_p} (same stages as the prefill) or --pp-size 1"
        ),
    }
}

fn too_large(name: &str, value: u64, max: u64) -> std::result::Result<(), MappingFailure> {
    if value <= max {
        return Ok(());
    }
    Err(MappingFailure {
        code: ProblemCode::TooLarge,
        message: format!("{name}={value} is above the maximum of {max}"),
        remedy: format!(
            "set {name} to the server's real size; every maximum is far above any real \
             deployment (docs/errors.md, \"Descriptor format\")"
        ),
    })
}

/// SGLang 0.5.23's rank mapping (docs/planning.md, "Rank mapping"), exactly — including its silent reduction of the
/// engine rank modulo `tp_d` and the absence of a TP divisibility check.
///
/// # Errors
/// [`HandshakeError::MappingPrecondition`] with SGLang's assertion text for the three
/// preconditions (MLA sharding with different TP, decode CP ≠ 1, decode PP neither prefill PP
/// nor 1), for zero sizes (which SGLang would divide by), and for sizes above
/// [`crate::MAX_GROUP_SIZE`] or a prefill deployment above [`crate::MAX_DEPLOYMENT_RANKS`]
/// ranks (checked before any rank list is allocated).
pub fn sglang_rank_mapping(input: &MappingInput) -> Result<TargetRanks> {
    Ok(sglang_targets(input)?)
}

pub(crate) fn sglang_targets(i: &MappingInput) -> std::result::Result<TargetRanks, MappingFailure> {
    check_sizes(i)?;
    let (target_tp_rank, target_tp_ranks, dst_info, responses) = tp_targets(i)?;
    let (target_cp_ranks, cp_responses) = cp_targets(i)?;
    let (target_pp_ranks, pp_responses) = pp_targets(i)?;
    Ok(TargetRanks {
        target_tp_rank,
        target_tp_ranks,
        target_cp_ranks,
        target_pp_ranks,
        required_dst_info_num: dst_info,
        required_prefill_response_num: responses * cp_responses * pp_responses,
    })
}

/// Zero sizes (SGLang would divide by them) and sizes above the maxima, before any rank list
/// is allocated.
fn check_sizes(i: &MappingInput) -> std::result::Result<(), MappingFailure> {
    for (name, v) in [
        ("decode attn_tp_size", i.decode_tp_size),
        ("prefill attn_tp_size", i.prefill_tp_size),
        ("prefill attn_cp_size", i.prefill_cp_size),
        ("decode pp_size", i.decode_pp_size),
        ("prefill pp_size", i.prefill_pp_size),
    ] {
        if v == 0 {
            return Err(MappingFailure {
                code: ProblemCode::ZeroSize,
                message: format!("{name} must be >= 1 (got 0)"),
                remedy: format!("set {name} to the server's real size"),
            });
        }
        too_large(name, u64::from(v), MAX_GROUP_SIZE)?;
    }
    // The target lists below hold up to tp_p, cp_p and pp_p ranks, and the bootstrap list their
    // product: bounded before anything is allocated.
    let prefill_ranks =
        u64::from(i.prefill_tp_size) * u64::from(i.prefill_cp_size) * u64::from(i.prefill_pp_size);
    too_large(
        "prefill attn_tp_size x attn_cp_size x pp_size",
        prefill_ranks,
        MAX_DEPLOYMENT_RANKS,
    )?;
    Ok(())
}

/// SGLang's TP rank mapping: (target_tp_rank, target_tp_ranks, required_dst_info_num,
/// required_prefill_response_num of the TP mapping).
type TpTargets = (Option<u32>, Vec<u32>, u32, u32);

fn tp_targets(i: &MappingInput) -> std::result::Result<TpTargets, MappingFailure> {
    let tp_d = i.decode_tp_size;
    let tp_p = i.prefill_tp_size;
    let e = i.engine_rank();
    let mla = i.decode_pool == PoolKind::Mla;
    //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: row_06_mla_prefill_sharding_all_real
    //# self.is_mla_backend
    //# and info.enable_kv_cache_sharding
    //# and info.attn_cp_size == 1
    let targets = if mla && i.prefill_kv_cache_sharding && i.prefill_cp_size == 1 {
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: row_07_mla_prefill_sharding_needs_equal_tp
        //# assert self.attn_tp_size == info.attn_tp_size, (
        if tp_d != tp_p {
            return Err(mla_sharding_failure(tp_p, tp_d));
        }
        (None, (0..tp_p).collect::<Vec<_>>(), tp_d, tp_p)
    } else if tp_d == tp_p {
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: row_01_equal_tp_any_pool
        //# target_tp_rank = self.kv_args.engine_rank % self.attn_tp_size
        //# required_dst_info_num = 1
        //# required_prefill_response_num = 1
        (Some(e), vec![e], 1, 1)
    } else if tp_d > tp_p {
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: row_02_decode_tp_larger_mha_or_mla
        //# target_tp_rank = (self.kv_args.engine_rank % self.attn_tp_size) // (
        //# self.attn_tp_size // info.attn_tp_size
        //# )
        //# required_dst_info_num = self.attn_tp_size // info.attn_tp_size
        let ratio = tp_d / tp_p;
        let t = e / ratio;
        (Some(t), vec![t], ratio, 1)
    } else {
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: row_03_prefill_tp_larger_mha_waits_for_every_slice
        //# (self.kv_args.engine_rank % self.attn_tp_size)
        //# * (info.attn_tp_size // self.attn_tp_size),
        let k = tp_p / tp_d;
        let start = e * k;
        (
            Some(start),
            (start..start + k).collect(),
            1,
            //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: row_04_prefill_tp_larger_mla_waits_for_one, row_05_prefill_tp_larger_hybrid_counts_as_non_mla
            //# if self.is_mla_backend:
            //# required_prefill_response_num = 1
            //# else:
            //# required_prefill_response_num = info.attn_tp_size // self.attn_tp_size
            if mla { 1 } else { k },
        )
    };
    Ok(targets)
}

/// SGLang's CP rank mapping: the target CP ranks and the factor they add to the responses.
fn cp_targets(i: &MappingInput) -> std::result::Result<(Vec<u32>, u32), MappingFailure> {
    //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: e011_decode_cp_must_be_1
    //# assert self.attn_cp_size == 1, (
    if i.decode_cp_size != 1 {
        return Err(decode_cp_failure(i.decode_cp_size));
    }
    let cp_p = i.prefill_cp_size;
    Ok(if cp_p == 1 {
        (vec![0], 1)
    } else if i.all_cp() || i.prefill_dsa_layer_split || i.prefill_kv_cache_sharding {
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: row_09_prefill_cp_with_all_cp, row_10_prefill_cp_with_dsa_layer_split, row_08_prefill_cp_without_all_cp
        //# self.enable_all_cp_ranks_for_transfer
        //# or info.enable_dsa_cache_layer_split
        //# or info.enable_kv_cache_sharding
        ((0..cp_p).collect(), cp_p)
    } else {
        (vec![0], 1)
    })
}

/// SGLang's PP rank mapping: the target PP ranks and the factor they add to the responses.
fn pp_targets(i: &MappingInput) -> std::result::Result<(Vec<u32>, u32), MappingFailure> {
    let (pp_d, pp_p) = (i.decode_pp_size, i.prefill_pp_size);
    Ok(if pp_d == pp_p {
        (vec![i.decode_pp_rank], 1)
    } else if pp_d == 1 {
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: row_12_decode_pp1_pulls_every_prefill_stage
        //# target_pp_ranks = list(range(info.pp_size))
        //# required_prefill_response_num *= info.pp_size // self.pp_size
        ((0..pp_p).collect(), pp_p)
    } else {
        //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: e012_pp_sizes
        //# assert self.pp_size == info.pp_size or self.pp_size == 1, (
        return Err(pp_failure(pp_d, pp_p));
    })
}

/// A prefill rank's id in status messages:
/// `attn_tp_rank·(pp_size·attn_cp_size) + pp_rank·attn_cp_size + attn_cp_rank`.
pub fn prefill_unique_rank(
    tp_rank: u32,
    cp_rank: u32,
    pp_rank: u32,
    cp_size: u32,
    pp_size: u32,
) -> u32 {
    //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._prefill_unique_rank test: unique_rank_formula
    //# self.attn_tp_rank * (self.pp_size * self.attn_cp_size)
    //# + self.pp_rank * self.attn_cp_size
    //# + self.attn_cp_rank
    tp_rank * (pp_size * cp_size) + pp_rank * cp_size + cp_rank
}

/// SGLang's bootstrap list order: for each target CP rank, for each target TP rank, for each
/// target PP rank in **descending** order. Returns `(tp, cp, pp)` triples.
pub fn bootstrap_order(targets: &TargetRanks) -> Vec<(u32, u32, u32)> {
    let mut out = Vec::new();
    //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVReceiver._setup_bootstrap_infos test: bootstrap_order_is_cp_then_tp_then_pp_descending
    //# for target_cp_rank in self.target_cp_ranks:
    for &cp in &targets.target_cp_ranks {
        for &tp in &targets.target_tp_ranks {
            //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVReceiver._setup_bootstrap_infos test: bootstrap_order_is_cp_then_tp_then_pp_descending
            //# for target_pp_rank in reversed(self.target_pp_ranks):
            for &pp in targets.target_pp_ranks.iter().rev() {
                out.push((tp, cp, pp));
            }
        }
    }
    out
}

/// SGLang's dummy rule: an MLA pool and `tp != target_tp_rank` (never a dummy when
/// `target_tp_rank` is `None` or the pool is not pure MLA).
pub fn sglang_is_dummy(pool: PoolKind, target_tp_rank: Option<u32>, tp: u32) -> bool {
    //= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVReceiver._setup_bootstrap_infos test: mapping_from_descriptors_lists_peers_with_dummies_and_ids
    //# bootstrap_info["is_dummy"] = not bool(
    //# target_tp_rank == self.target_tp_rank
    //# or self.target_tp_rank is None
    //# )
    pool == PoolKind::Mla && target_tp_rank.is_some_and(|t| t != tp)
}

/// How KV moves between one decode rank and its prefill peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
#[non_exhaustive]
pub enum TransferPath {
    /// Whole pages: same page size, same per-entry item lengths, no DCP or equal DCP sizes with
    /// matching ranks (docs/planning.md, "The page path").
    Pages,
    /// MHA/GQA with different attention TP sizes and the same page size: per-token head slices
    /// (docs/planning.md, "MHA/GQA head slicing").
    HeadSlices,
    /// SGLang's relayout: prefill DCP 1 → decode DCP N, MLA/hybrid-MLA, same page size; the
    /// DCP token plan (docs/planning.md, "Prefill DCP 1 → decode DCP d").
    DcpTokenPlan,
    /// kvbridge only: row-level moves by the owner rule — any prefill DCP `a` → decode DCP `b`
    /// and/or different page sizes (docs/planning.md, "The general case"). `head_slices`: MHA with different TP too.
    Rows {
        /// Each row also carries a head slice (MHA, different attention TP sizes).
        head_slices: bool,
    },
}

impl TransferPath {
    /// A short human description.
    pub fn describe(self) -> &'static str {
        match self {
            TransferPath::Pages => "whole pages (page path)",
            TransferPath::HeadSlices => {
                "per-token KV head slices (MHA/GQA, different attention TP)"
            }
            TransferPath::DcpTokenPlan => "DCP token plan (prefill DCP 1 -> decode DCP N relayout)",
            TransferPath::Rows { head_slices: false } => {
                "row-level owner-rule relayout (kvbridge: any DCP sizes / page sizes)"
            }
            TransferPath::Rows { head_slices: true } => {
                "row-level relayout with KV head slices (kvbridge: different page sizes, MHA TP differs)"
            }
        }
    }
}

/// Which KV heads one prefill rank sends to one decode rank (MHA/GQA with different attention TP
/// sizes), counted inside each rank's own heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct HeadRange {
    /// First head, counted inside the prefill rank's heads.
    pub src_head_start: u64,
    /// Heads copied.
    pub num_heads: u64,
    /// First head, counted inside the decode rank's heads.
    pub dst_head_start: u64,
}

impl From<HeadSlice> for HeadRange {
    fn from(s: HeadSlice) -> Self {
        HeadRange {
            src_head_start: s.src_head_start,
            num_heads: s.num_heads,
            dst_head_start: s.dst_head_start,
        }
    }
}

/// One prefill rank in a decode rank's bootstrap list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerTarget {
    /// Prefill attention TP rank.
    pub tp_rank: u32,
    /// Prefill attention CP rank.
    pub cp_rank: u32,
    /// Prefill PP rank.
    pub pp_rank: u32,
    /// The prefill rank's DCP rank (`tp_rank mod prefill dcp_size`).
    pub dcp_rank: u32,
    /// The prefill rank's id in status messages ([`prefill_unique_rank`]).
    pub unique_rank: u32,
    /// Gets the room's metadata but sends nothing (and sends no Success to the decode).
    pub is_dummy: bool,
    /// How many decode ranks register the same room at this prefill rank.
    pub required_dst_info_num: u32,
    /// MHA/GQA with different attention TP sizes: the heads this peer sends (`None` for dummies,
    /// MLA pools and equal TP sizes, where whole rows move).
    pub head_slice: Option<HeadRange>,
}

/// Everything a decode rank needs to know about whom it talks to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankMapping {
    /// The main prefill TP rank (`None` = all real, MLA with prefill sharding).
    pub target_tp_rank: Option<u32>,
    /// Prefill attention TP ranks this decode rank registers with (real and dummy).
    pub target_tp_ranks: Vec<u32>,
    /// Prefill attention CP ranks.
    pub target_cp_ranks: Vec<u32>,
    /// Prefill PP ranks.
    pub target_pp_ranks: Vec<u32>,
    /// Decode ranks registering the same room at each target prefill rank (the maximum over
    /// [`RankMapping::peers`]; equal for all peers in every SGLang-defined topology).
    pub required_dst_info_num: u32,
    /// Distinct prefill ranks whose Success this decode rank waits for.
    pub required_prefill_response_num: u32,
    /// The bootstrap list, in SGLang's order (CP, TP, then PP descending).
    pub peers: Vec<PeerTarget>,
    /// How the KV moves.
    pub path: TransferPath,
    /// This decode rank's attention TP rank.
    pub decode_tp_rank: u32,
    /// This decode rank's PP rank.
    pub decode_pp_rank: u32,
    /// Prefill DCP size (`a`).
    pub prefill_dcp_size: u32,
    /// Decode DCP size (`b`).
    pub decode_dcp_size: u32,
    /// This decode rank's DCP rank.
    pub decode_dcp_rank: u32,
    /// Decode virtual page size in tokens (`page_size · dcp_size`); decode prefixes must be
    /// multiples of it under DCP.
    pub decode_virtual_page_size: u64,
}

impl RankMapping {
    /// The six SGLang fields.
    pub fn targets(&self) -> TargetRanks {
        TargetRanks {
            target_tp_rank: self.target_tp_rank,
            target_tp_ranks: self.target_tp_ranks.clone(),
            target_cp_ranks: self.target_cp_ranks.clone(),
            target_pp_ranks: self.target_pp_ranks.clone(),
            required_dst_info_num: self.required_dst_info_num,
            required_prefill_response_num: self.required_prefill_response_num,
        }
    }

    /// The peers that actually send KV (not dummies).
    pub fn senders(&self) -> impl Iterator<Item = &PeerTarget> {
        self.peers.iter().filter(|p| !p.is_dummy)
    }
}

/// SGLang's base target TP rank for decode rank `e` (assumes sizes ≥ 1).
fn base_target(e: u32, tp_d: u32, tp_p: u32) -> u32 {
    if tp_d >= tp_p {
        e / (tp_d / tp_p)
    } else {
        e * (tp_p / tp_d)
    }
}

/// Owner-rule senders of decode rank `e`: prefill TP ranks holding positions it needs. The
/// prefill DCP ranks come from `kvbridge_geometry::reshard_sources`, so the mapping and the
/// planner agree. Assumes sizes ≥ 1, `a | tp_p`, `b | tp_d`.
pub(crate) fn owner_rule_senders(e: u32, tp_d: u32, b: u32, tp_p: u32, a: u32) -> Vec<u32> {
    let base = base_target(e, tp_d, tp_p);
    let group = base / a;
    reshard_sources(u64::from(a), u64::from(b), u64::from(e % b))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|a_r| u32::try_from(a_r).ok())
        .map(|a_r| group * a + a_r)
        .collect()
}

/// Exact GQA/MHA senders of decode rank `e` (kvbridge): each of its KV heads from exactly one
/// prefill rank (`kvbridge_geometry::HeadSharding::sources_for`), with the slice to copy.
pub(crate) fn head_sources(e: u32, tp_d: u32, tp_p: u32, heads: u32) -> Vec<(u32, HeadRange)> {
    HeadSharding::new(u64::from(heads), u64::from(tp_p), u64::from(tp_d))
        .and_then(|s| s.sources_for(u64::from(e)))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|s| Some((u32::try_from(s.src_rank).ok()?, HeadRange::from(s.slice))))
        .collect()
}

/// The prefill TP ranks of [`head_sources`].
pub(crate) fn head_senders(e: u32, tp_d: u32, tp_p: u32, heads: u32) -> Vec<u32> {
    head_sources(e, tp_d, tp_p, heads)
        .into_iter()
        .map(|(t, _)| t)
        .collect()
}

/// How many decode ranks read from prefill TP rank `t` under the exact head plan
/// (`kvbridge_geometry::HeadSharding::targets_of`, linear in those ranks).
pub(crate) fn head_readers(t: u32, tp_d: u32, tp_p: u32, heads: u32) -> u32 {
    let n = HeadSharding::new(u64::from(heads), u64::from(tp_p), u64::from(tp_d))
        .and_then(|s| s.targets_of(u64::from(t)))
        .map_or(0, |v| v.len());
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// SGLang's head slice for one (prefill rank, decode rank) pair (docs/planning.md, "MHA/GQA
/// head slicing").
pub(crate) fn sglang_head_slice(
    tp_p: u32,
    tp_d: u32,
    src: u32,
    dst: u32,
    heads: u32,
) -> Option<HeadRange> {
    compute_head_slice_params(
        u64::from(tp_p),
        u64::from(tp_d),
        u64::from(src),
        u64::from(dst),
        u64::from(heads),
    )
    .ok()
    .map(HeadRange::from)
}

/// One target prefill TP rank of a decode rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TpTarget {
    pub(crate) tp: u32,
    pub(crate) is_dummy: bool,
    /// Decode ranks registering at this prefill TP rank.
    pub(crate) dst_info: u32,
}

/// Decode ranks in `lo..hi` congruent to `c` modulo `m` (`m ≥ 1`).
fn count_congruent(lo: u64, hi: u64, m: u64, c: u64) -> u64 {
    // Values below n congruent to c.
    let below = |n: u64| {
        if n > c % m {
            (n - c % m - 1) / m + 1
        } else {
            0
        }
    };
    below(hi.max(lo)) - below(lo)
}

/// How many decode ranks read from prefill TP rank `t` under the owner rule
/// ([`owner_rule_senders`]), in closed form: decode rank `e'` reads `t` iff its group
/// (`base_target(e') div a`) is `t div a` and `e' ≡ t (mod gcd(a, b))`. Assumes the
/// preconditions of [`owner_rule_senders`] and that the TP sizes divide one another.
pub(crate) fn owner_rule_readers(t: u32, tp_d: u32, b: u32, tp_p: u32, a: u32) -> u32 {
    let (t, tp_d, b, tp_p, a) = (
        u64::from(t),
        u64::from(tp_d),
        u64::from(b),
        u64::from(tp_p),
        u64::from(a),
    );
    let g = gcd(a, b);
    let first = t / a * a;
    // Decode ranks whose base target lies in [first, first + a).
    let (lo, hi) = if tp_d >= tp_p {
        let r = tp_d / tp_p;
        (first * r, (first + a) * r)
    } else {
        let k = tp_p / tp_d;
        (first.div_ceil(k), (first + a).div_ceil(k))
    };
    let n = count_congruent(lo.min(tp_d), hi.min(tp_d), g, t);
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn gcd(mut x: u64, mut y: u64) -> u64 {
    while y != 0 {
        (x, y) = (y, x % y);
    }
    x
}

/// A mapping whose real senders are chosen per decode rank by `real_of` (owner rule or exact
/// head plan), with `readers_of(t)` the number of decode ranks whose real senders include
/// prefill rank `t`. Prefill ranks in this decode rank's SGLang range that no decode rank reads
/// become its dummies (only when `tp_d < tp_p`; otherwise every prefill rank is read by
/// someone); registration counts follow. CP and PP follow SGLang. Work is linear in this rank's
/// peers (never a table of every decode rank).
pub(crate) fn coverage_targets(
    i: &MappingInput,
    real_of: &dyn Fn(u32) -> Vec<u32>,
    readers_of: &dyn Fn(u32) -> u32,
) -> std::result::Result<(TargetRanks, Vec<TpTarget>), MappingFailure> {
    // CP/PP rules and their preconditions are SGLang's; reuse them on a non-sharded input.
    let sg = sglang_targets(&MappingInput {
        prefill_kv_cache_sharding: false,
        ..*i
    })?;
    let (tp_d, tp_p) = (i.decode_tp_size, i.prefill_tp_size);
    let e = i.engine_rank();
    let real = real_of(e);
    let dummies: Vec<u32> = if tp_d < tp_p {
        let k = tp_p / tp_d;
        (e * k..(e + 1) * k)
            .filter(|&t| readers_of(t) == 0)
            .collect()
    } else {
        Vec::new()
    };
    let mut all: Vec<u32> = real.iter().chain(&dummies).copied().collect();
    all.sort_unstable();
    all.dedup();
    let real_set: BTreeSet<u32> = real.iter().copied().collect();
    let per_tp: Vec<TpTarget> = all
        .iter()
        .map(|&t| {
            let is_dummy = !real_set.contains(&t);
            TpTarget {
                tp: t,
                is_dummy,
                // A prefill rank nobody reads is the dummy of exactly one decode rank: this one.
                dst_info: if is_dummy { 1 } else { readers_of(t) },
            }
        })
        .collect();
    let cp_factor = sg.target_cp_ranks.len() as u32;
    let pp_factor = sg.target_pp_ranks.len() as u32;
    let targets = TargetRanks {
        target_tp_rank: real.first().copied(),
        target_tp_ranks: all,
        target_cp_ranks: sg.target_cp_ranks,
        target_pp_ranks: sg.target_pp_ranks,
        required_dst_info_num: per_tp.iter().map(|x| x.dst_info).max().unwrap_or(0),
        required_prefill_response_num: real.len() as u32 * cp_factor * pp_factor,
    };
    Ok((targets, per_tp))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(tp, is_dummy, dst_info)` of each target of one decode rank.
    type Targets = Vec<(u32, bool, u32)>;

    /// The table of every decode rank's real senders and dummies that `coverage_targets`
    /// replaced, as the reference: per decode rank, `(target ranks, targets)`.
    fn reference(
        tp_d: u32,
        tp_p: u32,
        real_of: &dyn Fn(u32) -> Vec<u32>,
    ) -> Vec<(Vec<u32>, Targets)> {
        let real: Vec<Vec<u32>> = (0..tp_d).map(real_of).collect();
        let covered: BTreeSet<u32> = real.iter().flatten().copied().collect();
        let table: Vec<(Vec<u32>, Vec<u32>)> = real
            .iter()
            .zip(0u32..)
            .map(|(senders, e)| {
                let dummies = if tp_d < tp_p {
                    let k = tp_p / tp_d;
                    (e * k..(e + 1) * k)
                        .filter(|t| !covered.contains(t))
                        .collect()
                } else {
                    Vec::new()
                };
                (senders.clone(), dummies)
            })
            .collect();
        table
            .iter()
            .map(|(r, d)| {
                let mut all: Vec<u32> = r.iter().chain(d).copied().collect();
                all.sort_unstable();
                all.dedup();
                let per: Targets = all
                    .iter()
                    .map(|&t| {
                        let n = table
                            .iter()
                            .filter(|(r, d)| r.contains(&t) || d.contains(&t))
                            .count() as u32;
                        (t, !r.contains(&t), n)
                    })
                    .collect();
                (all, per)
            })
            .collect()
    }

    fn input(tp_d: u32, e: u32, tp_p: u32) -> MappingInput {
        MappingInput {
            decode_tp_size: tp_d,
            decode_engine_rank: e,
            decode_cp_size: 1,
            decode_pp_size: 1,
            decode_pp_rank: 0,
            decode_pool: PoolKind::Mla,
            decode_kv_cache_sharding: false,
            prefill_tp_size: tp_p,
            prefill_cp_size: 1,
            prefill_pp_size: 1,
            prefill_kv_cache_sharding: false,
            prefill_dsa_layer_split: false,
            all_cp_ranks_transfer: false,
        }
    }

    fn compare(
        tp_d: u32,
        tp_p: u32,
        real_of: &dyn Fn(u32) -> Vec<u32>,
        readers_of: &dyn Fn(u32) -> u32,
        what: &str,
    ) {
        let want = reference(tp_d, tp_p, real_of);
        for e in 0..tp_d {
            let (t, per) = coverage_targets(&input(tp_d, e, tp_p), real_of, readers_of).unwrap();
            let got: Targets = per.iter().map(|x| (x.tp, x.is_dummy, x.dst_info)).collect();
            assert_eq!(t.target_tp_ranks, want[e as usize].0, "{what}, rank {e}");
            assert_eq!(got, want[e as usize].1, "{what}, rank {e}");
        }
    }

    /// Closed-form reader counts give exactly the table's dummies and registration counts, for
    /// every owner-rule topology with TP sizes up to 16 and every exact head plan up to 32.
    #[test]
    fn coverage_equals_the_whole_table() {
        let divisors = |n: u32| (1..=n).filter(move |x| n % x == 0);
        for tp_p in 1..=16u32 {
            for tp_d in 1..=16u32 {
                if tp_p.max(tp_d) % tp_p.min(tp_d) != 0 {
                    continue;
                }
                for a in divisors(tp_p) {
                    for b in divisors(tp_d) {
                        compare(
                            tp_d,
                            tp_p,
                            &|e| owner_rule_senders(e, tp_d, b, tp_p, a),
                            &|t| owner_rule_readers(t, tp_d, b, tp_p, a),
                            &format!("owner rule tp {tp_p}/{a} -> {tp_d}/{b}"),
                        );
                    }
                }
            }
        }
        for heads in [1u32, 2, 4, 8] {
            for tp_p in [2u32, 4, 8, 16, 32] {
                for tp_d in [1u32, 2, 4, 8, 16] {
                    let splits = |t: u32| heads % t == 0 || t % heads == 0;
                    if tp_p <= tp_d || tp_p <= heads || !splits(tp_p) || !splits(tp_d) {
                        continue;
                    }
                    compare(
                        tp_d,
                        tp_p,
                        &|e| head_senders(e, tp_d, tp_p, heads),
                        &|t| head_readers(t, tp_d, tp_p, heads),
                        &format!("heads {heads}, tp {tp_p} -> {tp_d}"),
                    );
                }
            }
        }
    }
}
