//! Problems found by [`crate::check`], their stable codes, and the catalog behind
//! `kvbridge explain` and `docs/errors.md`.

use std::fmt;

use serde::{Serialize, Serializer};

/// A stable problem code. The string form (`KVB-E007`) never changes meaning; new problems get
/// new codes.
///
/// `KVB-E001`–`KVB-E018` follow SGLang 0.5.23's own checks (E001–E012 in the order SGLang's
/// decode side runs them; docs/errors.md lists each); `KVB-E020`–`KVB-E033` are what SGLang lets through
/// but cannot work; `KVB-E040`–`KVB-E042` are raised by the planner per request; `KVB-Wnnn` are warnings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ProblemCode {
    /// `KVB-E001` page sizes differ.
    PageSizeMismatch,
    /// `KVB-E002` KV cache dtypes differ.
    DtypeMismatch,
    /// `KVB-E003` MiniMax sparse PD with different TP (not checked: descriptors do not carry
    /// the MiniMax index state).
    MiniMaxTp,
    /// `KVB-E004` KV layouts differ.
    LayoutMismatch,
    /// `KVB-E005` DeepSeek-V4.1 DSpark layout/TP (not checked: not carried).
    Dspark,
    /// `KVB-E006` MXFP8 KV cache with different TP (not checked: state types not carried).
    Mxfp8Tp,
    /// `KVB-E007` DCP with a pool that is neither MLA nor hybrid MLA.
    DcpNeedsMlaPool,
    /// `KVB-E008` DCP with prefill attention CP > 1.
    DcpPrefillCp,
    /// `KVB-E009` DCP with prefill KV-cache sharding.
    DcpPrefillSharding,
    /// `KVB-E010` MLA KV-cache sharding with different TP sizes.
    MlaShardingTp,
    /// `KVB-E011` decode attention CP ≠ 1.
    DecodeCp,
    /// `KVB-E012` decode PP neither prefill PP nor 1.
    PpMismatch,
    /// `KVB-E013` mapped peers have different DCP ranks.
    DcpRankMismatch,
    /// `KVB-E014` DCP topology SGLang does not support.
    DcpTopology,
    /// `KVB-E015` DCP relayout: entry counts differ.
    DcpEntryCount,
    /// `KVB-E016` DCP relayout: per-entry token widths differ.
    DcpEntryGeometry,
    /// `KVB-E017` aux (metadata) buffers differ.
    AuxLayout,
    /// `KVB-E018` head slicing with several item lengths.
    HeadSliceItemLens,
    /// `KVB-E020` roles are wrong.
    RoleMistake,
    /// `KVB-E021` a size is zero.
    ZeroSize,
    /// `KVB-E022` a rank is out of range.
    RankOutOfRange,
    /// `KVB-E023` DCP is not nested in attention TP.
    DcpNotNested,
    /// `KVB-E024` attention TP sizes are not multiples.
    TpNotMultiple,
    /// `KVB-E025` MHA head geometry missing or different.
    HeadGeometry,
    /// `KVB-E026` KV heads cannot be split across TP.
    HeadsDoNotSplit,
    /// `KVB-E027` `kv_item_lens` malformed.
    ItemLensMalformed,
    /// `KVB-E028` `kv_item_lens` disagree with the pool kind / head geometry.
    ItemLensVsHeads,
    /// `KVB-E029` pool kinds differ.
    PoolKindMismatch,
    /// `KVB-E030` page path: entry counts differ.
    EntryCount,
    /// `KVB-E031` page path: per-entry geometry differs.
    EntryGeometry,
    /// `KVB-E032` protocol major versions differ.
    ProtocolVersion,
    /// `KVB-E033` a size or count is above its maximum.
    TooLarge,
    /// `KVB-E040` decode prefix not aligned to the DCP virtual page (planner, per request).
    PrefixMisaligned,
    /// `KVB-E041` the page ids given to the planner do not cover the chunk (per request).
    PagesInsufficient,
    /// `KVB-E042` the planner's inputs are inconsistent in themselves (per request).
    PlanInputInvalid,
    /// `KVB-W001` different TP on an MHA/GQA pool (performance warning).
    TpDiffersMha,
    /// `KVB-W002` aux buffer counts differ.
    AuxCount,
    /// `KVB-W003` a descriptor of a newer minor version has fields this build ignores.
    NewerMinorFields,
}

impl ProblemCode {
    /// Every code, in catalog order.
    pub const ALL: &'static [ProblemCode] = &[
        ProblemCode::PageSizeMismatch,
        ProblemCode::DtypeMismatch,
        ProblemCode::MiniMaxTp,
        ProblemCode::LayoutMismatch,
        ProblemCode::Dspark,
        ProblemCode::Mxfp8Tp,
        ProblemCode::DcpNeedsMlaPool,
        ProblemCode::DcpPrefillCp,
        ProblemCode::DcpPrefillSharding,
        ProblemCode::MlaShardingTp,
        ProblemCode::DecodeCp,
        ProblemCode::PpMismatch,
        ProblemCode::DcpRankMismatch,
        ProblemCode::DcpTopology,
        ProblemCode::DcpEntryCount,
        ProblemCode::DcpEntryGeometry,
        ProblemCode::AuxLayout,
        ProblemCode::HeadSliceItemLens,
        ProblemCode::RoleMistake,
        ProblemCode::ZeroSize,
        ProblemCode::RankOutOfRange,
        ProblemCode::DcpNotNested,
        ProblemCode::TpNotMultiple,
        ProblemCode::HeadGeometry,
        ProblemCode::HeadsDoNotSplit,
        ProblemCode::ItemLensMalformed,
        ProblemCode::ItemLensVsHeads,
        ProblemCode::PoolKindMismatch,
        ProblemCode::EntryCount,
        ProblemCode::EntryGeometry,
        ProblemCode::ProtocolVersion,
        ProblemCode::TooLarge,
        ProblemCode::PrefixMisaligned,
        ProblemCode::PagesInsufficient,
        ProblemCode::PlanInputInvalid,
        ProblemCode::TpDiffersMha,
        ProblemCode::AuxCount,
        ProblemCode::NewerMinorFields,
    ];

    /// The stable string form, e.g. `KVB-E007`.
    pub fn as_str(self) -> &'static str {
        self.info().id
    }
}

impl fmt::Display for ProblemCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ProblemCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// How bad a problem is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// The pair cannot work; `check` refuses it.
    Error,
    /// The pair works, but something deserves attention.
    Warning,
}

/// Who detects a problem, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DetectedBy {
    /// `check` (before any request), in both compatibility modes.
    Check,
    /// `check` in `Compat::Sglang` mode only; kvbridge's planner supports the case.
    CheckSglangOnly,
    /// The transfer planner, per request (not visible to `check`).
    Planner,
    /// Not checked: descriptors do not carry the fields it needs (out of scope).
    NotChecked,
}

impl DetectedBy {
    fn describe(self) -> &'static str {
        match self {
            DetectedBy::Check => {
                "`kvbridge check` / `check()`, before any request, in both compat modes"
            }
            DetectedBy::CheckSglangOnly => {
                "`kvbridge check --compat sglang` only; the default kvbridge mode supports this setup"
            }
            DetectedBy::Planner => {
                "the transfer planner (kvbridge-geometry), per request; `check` cannot see it"
            }
            DetectedBy::NotChecked => {
                "not checked: peer descriptors do not carry the fields this check needs (out of scope)"
            }
        }
    }
}

/// One catalog entry: everything `kvbridge explain CODE` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProblemInfo {
    /// The code.
    pub code: ProblemCode,
    /// Its stable string form, e.g. `KVB-E007`.
    pub id: &'static str,
    /// A short title.
    pub title: &'static str,
    /// Error or warning.
    pub severity: Severity,
    /// Who detects it.
    pub detected_by: DetectedBy,
    /// What SGLang 0.5.23 does with the same setup.
    pub sglang: &'static str,
    /// The message template (`{}` placeholders), verbatim SGLang text where SGLang has one.
    pub message: &'static str,
    /// What it means.
    pub meaning: &'static str,
    /// When it happens.
    pub when: &'static str,
    /// How to fix it (one step per line).
    pub fix: &'static str,
    /// An example fix (before / after).
    pub example: &'static str,
}

impl ProblemInfo {
    /// The entry as Markdown; `kvbridge explain` prints exactly this, and `docs/errors.md`
    /// contains it verbatim.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!("## {} — {}\n\n", self.id, self.title));
        out.push_str(&format!(
            "- **Severity:** {}\n",
            match self.severity {
                Severity::Error => "error (the pair is refused)",
                Severity::Warning => "warning (the pair is accepted)",
            }
        ));
        out.push_str(&format!(
            "- **Detected by:** {}\n",
            self.detected_by.describe()
        ));
        out.push_str(&format!("- **SGLang 0.5.23:** {}\n\n", self.sglang));
        out.push_str("**Message**\n\n```text\n");
        out.push_str(self.message);
        out.push_str("\n```\n\n**What it means**\n\n");
        out.push_str(self.meaning);
        out.push_str("\n\n**When it happens**\n\n");
        out.push_str(self.when);
        out.push_str("\n\n**How to fix it**\n\n");
        for (n, step) in self.fix.lines().enumerate() {
            out.push_str(&format!("{}. {}\n", n + 1, step));
        }
        out.push_str("\n**Example fix**\n\n```text\n");
        out.push_str(self.example);
        out.push_str("\n```\n");
        out
    }
}

/// One problem found by [`crate::check`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Problem {
    /// Stable code.
    pub code: ProblemCode,
    /// Error or warning.
    pub severity: Severity,
    /// What is wrong, with the values seen (verbatim SGLang text where SGLang has one).
    pub message: String,
    /// The values seen, as `(field, value)` pairs such as `("prefill.page_size", "16")`.
    pub values: Vec<(String, String)>,
    /// How to fix it.
    pub remedy: String,
}

impl Problem {
    /// A new problem with the code's catalog severity.
    pub fn new(code: ProblemCode, message: impl Into<String>, remedy: impl Into<String>) -> Self {
        Problem {
            code,
            severity: code.info().severity,
            message: message.into(),
            values: Vec::new(),
            remedy: remedy.into(),
        }
    }

    /// Add a value seen.
    #[must_use]
    pub fn with(mut self, field: impl Into<String>, value: impl fmt::Display) -> Self {
        self.values.push((field.into(), value.to_string()));
        self
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} (fix: {})", self.code, self.message, self.remedy)
    }
}
