//! What one rank advertises: [`PeerDescriptor`] and its JSON form.

use std::fmt;
use std::str::FromStr;

use kvbridge_geometry::PoolKind;
use serde::{Deserialize, Serialize};

use crate::check::dtype_bytes;
use crate::error::{HandshakeError, Result};

/// The side a descriptor describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The sender: computes the KV cache of the prompt.
    Prefill,
    /// The receiver: generates tokens from the transferred KV cache.
    Decode,
}

impl Role {
    /// `"prefill"` or `"decode"`, as in the JSON form.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl FromStr for Role {
    type Err = String;

    /// `"prefill"` or `"decode"`, as in the JSON form.
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(format!(
                "role must be \"prefill\" or \"decode\", got {other:?}"
            )),
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A descriptor protocol version, `MAJOR.MINOR`.
///
/// A newer minor version only adds optional fields whose defaults keep the old meaning; a newer
/// major version may change meanings and is refused
/// ([`HandshakeError::UnsupportedProtocolVersion`]). In JSON it is a string such as `"1.0"`
/// (a bare major, `"1"` or `1`, means `.0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawVersion", into = "String")]
pub struct ProtocolVersion {
    /// Incompatible changes bump this.
    pub major: u16,
    /// Compatible additions bump this.
    pub minor: u16,
}

impl ProtocolVersion {
    /// The version this build writes and understands.
    pub const CURRENT: ProtocolVersion = ProtocolVersion { major: 1, minor: 0 };

    /// Whether this build can read a descriptor of this version (same or older major).
    pub fn is_supported(self) -> bool {
        self.major <= Self::CURRENT.major
    }
}

impl Default for ProtocolVersion {
    fn default() -> Self {
        Self::CURRENT
    }
}

impl fmt::Display for ProtocolVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl FromStr for ProtocolVersion {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let bad = || format!("protocol_version must look like \"1.0\" (MAJOR.MINOR), got {s:?}");
        let (major, minor) = match s.split_once('.') {
            Some((a, b)) => (a, b),
            None => (s, "0"),
        };
        let major = major.parse::<u16>().map_err(|_| bad())?;
        let minor = minor.parse::<u16>().map_err(|_| bad())?;
        Ok(ProtocolVersion { major, minor })
    }
}

impl From<ProtocolVersion> for String {
    fn from(v: ProtocolVersion) -> String {
        v.to_string()
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawVersion {
    Text(String),
    Major(u64),
}

impl TryFrom<RawVersion> for ProtocolVersion {
    type Error = String;

    fn try_from(raw: RawVersion) -> std::result::Result<Self, Self::Error> {
        match raw {
            RawVersion::Text(s) => s.parse(),
            RawVersion::Major(m) => u16::try_from(m)
                .map(|major| ProtocolVersion { major, minor: 0 })
                .map_err(|_| format!("protocol_version major {m} is out of range")),
        }
    }
}

fn one() -> u32 {
    1
}

/// What one rank advertises to its peer before any KV moves.
///
/// The JSON field names are part of the public contract. Omitted optional fields take the
/// defaults documented on each field; unknown fields are rejected, so a typo is never silently
/// ignored. In Rust, build one with [`PeerDescriptor::mla`], [`PeerDescriptor::mha`] or
/// [`PeerDescriptor::builder`]; [`PeerDescriptor::from_json`] reads the JSON form.
///
/// ```
/// use kvbridge_handshake::{PeerDescriptor, Role};
/// let built = PeerDescriptor::mla(Role::Decode, 64, 2, 288).attn_tp(4, 1).dcp(4).build()?;
/// let parsed: PeerDescriptor = r#"{
///     "role": "decode", "page_size": 64, "kv_cache_dtype": "auto", "kv_pool": "mla",
///     "attn_tp_size": 4, "attn_tp_rank": 1, "dcp_size": 4, "dcp_rank": 1,
///     "kv_item_lens": [18432, 18432]
/// }"#.parse()?;
/// assert_eq!(built, parsed);
/// assert_eq!(parsed.pp_size, 1);
/// # Ok::<(), kvbridge_handshake::HandshakeError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerDescriptor {
    /// `"prefill"` or `"decode"`.
    pub role: Role,
    /// Descriptor protocol version (default: [`ProtocolVersion::CURRENT`]).
    #[serde(default)]
    pub protocol_version: ProtocolVersion,
    /// Physical KV pool page size in tokens (`--page-size`). Under DCP the decode's virtual
    /// page is `page_size · dcp_size`; this field is the physical one.
    pub page_size: u64,
    /// KV cache dtype string (`--kv-cache-dtype`), compared as a string, e.g. `"auto"`,
    /// `"fp8_e4m3"`.
    pub kv_cache_dtype: String,
    /// KV layout name, or `null` (default `null`).
    #[serde(default)]
    pub kv_layout: Option<String>,
    /// Pool kind: `"mha"` (MHA/GQA), `"mla"` or `"hybrid_mla"`.
    pub kv_pool: PoolKind,
    /// Attention tensor-parallel size.
    pub attn_tp_size: u32,
    /// This rank's attention TP rank (default 0).
    #[serde(default)]
    pub attn_tp_rank: u32,
    /// Attention context-parallel size (default 1; a decode must use 1).
    #[serde(default = "one")]
    pub attn_cp_size: u32,
    /// This rank's attention CP rank (default 0).
    #[serde(default)]
    pub attn_cp_rank: u32,
    /// Pipeline-parallel size (default 1).
    #[serde(default = "one")]
    pub pp_size: u32,
    /// This rank's pipeline stage (default 0).
    #[serde(default)]
    pub pp_rank: u32,
    /// Decode context-parallel size (default 1). Nested inside attention TP:
    /// `dcp_rank == attn_tp_rank mod dcp_size`.
    #[serde(default = "one")]
    pub dcp_size: u32,
    /// This rank's DCP rank (default 0).
    #[serde(default)]
    pub dcp_rank: u32,
    /// `--enable-kv-cache-sharding` (default false).
    #[serde(default)]
    pub kv_cache_sharding: bool,
    /// Total KV heads of the model (required for `"mha"`; ignored otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_kv_heads: Option<u32>,
    /// Head dimension (required for `"mha"`; ignored otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<u32>,
    /// Bytes per page of every registered KV entry: target entries, then draft entries.
    pub kv_item_lens: Vec<u64>,
    /// How many of the last `kv_item_lens` are speculative-decoding draft entries (default 0).
    #[serde(default)]
    pub num_draft_entries: usize,
    /// Bytes per row of every aux (metadata) buffer (default `[]`).
    #[serde(default)]
    pub aux_item_lens: Vec<u64>,
}

impl PeerDescriptor {
    /// Parse a descriptor from JSON.
    ///
    /// # Errors
    /// [`HandshakeError::Json`] (with line and column) for invalid JSON, unknown or missing
    /// fields and wrong types; [`HandshakeError::UnsupportedProtocolVersion`] for a descriptor
    /// from a newer major version (checked first, so a newer descriptor is refused for its
    /// version rather than for the fields it added).
    pub fn from_json(text: &str) -> Result<Self> {
        match serde_json::from_str::<PeerDescriptor>(text) {
            Ok(d) => {
                d.ensure_supported_version()?;
                Ok(d)
            }
            Err(e) => {
                let seen = declared_version(text);
                if let Some(seen) = seen {
                    if !seen.is_supported() {
                        return Err(HandshakeError::UnsupportedProtocolVersion {
                            seen,
                            supported: ProtocolVersion::CURRENT,
                        });
                    }
                }
                let mut message = e.to_string();
                // serde_json appends " at line L column C"; we report them separately.
                if let Some(cut) = message.rfind(" at line ") {
                    message.truncate(cut);
                }
                if let Some(seen) = seen.filter(|s| *s > ProtocolVersion::CURRENT) {
                    if message.contains("unknown field") {
                        message.push_str(&format!(
                            " (the descriptor says protocol_version {seen}, newer than this \
                             build's {}: upgrade kvbridge to read the fields it added)",
                            ProtocolVersion::CURRENT
                        ));
                    }
                }
                Err(HandshakeError::Json {
                    line: e.line(),
                    column: e.column(),
                    message,
                })
            }
        }
    }

    /// Serialise to pretty JSON (all fields, defaults included).
    pub fn to_json_pretty(&self) -> String {
        // Serialising this plain struct cannot fail: all keys are strings, no custom maps.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Refuse a descriptor from a newer protocol major version.
    ///
    /// # Errors
    /// [`HandshakeError::UnsupportedProtocolVersion`].
    pub fn ensure_supported_version(&self) -> Result<()> {
        if self.protocol_version.is_supported() {
            Ok(())
        } else {
            Err(HandshakeError::UnsupportedProtocolVersion {
                seen: self.protocol_version,
                supported: ProtocolVersion::CURRENT,
            })
        }
    }

    /// Number of target (non-draft) KV entries, saturating at 0.
    pub fn num_target_entries(&self) -> usize {
        self.kv_item_lens
            .len()
            .saturating_sub(self.num_draft_entries)
    }

    /// Whether the pool is MLA or hybrid MLA (one flat entry per layer, replicated over TP).
    pub fn is_mla_like(&self) -> bool {
        matches!(self.kv_pool, PoolKind::Mla | PoolKind::HybridMla)
    }

    /// KV heads held by each attention-TP rank, SGLang's `max(1, total_kv_heads div attn_tp_size)`
    /// (`None` without head geometry or with a zero size).
    pub fn heads_per_rank(&self) -> Option<u32> {
        let h = self.total_kv_heads?;
        if self.attn_tp_size == 0 {
            return None;
        }
        Some((h / self.attn_tp_size).max(1))
    }
}

/// How the builder gets `kv_item_lens`: given as registered, or derived from the model shape
/// when [`PeerDescriptorBuilder::build`] knows the parallelism.
#[derive(Debug, Clone)]
enum Entries {
    Unset,
    Given(Vec<u64>),
    /// `layers` entries of `page_size · token_bytes`.
    Mla {
        layers: usize,
        token_bytes: u64,
    },
    /// `2 · layers` entries (K then V) of `page_size · heads_per_rank · head_dim · element bytes`.
    Mha {
        layers: usize,
    },
}

/// Builds a [`PeerDescriptor`] with the JSON form's defaults for every optional field.
///
/// Start from [`PeerDescriptor::mla`], [`PeerDescriptor::mha`] or, for any other shape,
/// [`PeerDescriptor::builder`]; set the parallelism this rank runs with; call
/// [`build`](Self::build), which refuses incomplete or contradictory input
/// ([`HandshakeError::DescriptorBuild`]) with what to call to fix it.
///
/// Defaults: `kv_cache_dtype "auto"`, no `kv_layout`, attention TP, CP, PP and DCP size 1 rank 0,
/// `dcp_rank = attn_tp_rank mod dcp_size` (DCP nests inside attention TP), no KV cache
/// sharding, no draft entries, no aux buffers, [`ProtocolVersion::CURRENT`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct PeerDescriptorBuilder {
    role: Role,
    protocol_version: ProtocolVersion,
    page_size: Option<u64>,
    kv_cache_dtype: String,
    kv_layout: Option<String>,
    kv_pool: Option<PoolKind>,
    attn_tp: (u32, u32),
    attn_cp: (u32, u32),
    pp: (u32, u32),
    dcp_size: u32,
    kv_cache_sharding: bool,
    heads: Option<(u32, u32)>,
    element_bytes: Option<u64>,
    entries: Entries,
    num_draft_entries: usize,
    aux_item_lens: Vec<u64>,
}

impl PeerDescriptor {
    /// An MLA rank: `layers` KV entries of `page_size · token_bytes` bytes each, where
    /// `token_bytes` is one token's latent row in one layer (`(kv_lora_rank + qk_rope_head_dim)
    /// · element bytes`: 576 · 2 = 1152 for DeepSeek-V3 in bf16).
    ///
    /// ```
    /// use kvbridge_handshake::{PeerDescriptor, Role};
    /// // DeepSeek-V3 decode rank 1 of attention TP 4 with DCP 4: 61 layers, page size 64.
    /// let d = PeerDescriptor::mla(Role::Decode, 64, 61, 1152).attn_tp(4, 1).dcp(4).build()?;
    /// assert_eq!((d.dcp_size, d.dcp_rank), (4, 1));
    /// assert_eq!(d.kv_item_lens, vec![64 * 1152; 61]);
    /// # Ok::<(), kvbridge_handshake::HandshakeError>(())
    /// ```
    pub fn mla(
        role: Role,
        page_size: u64,
        layers: usize,
        token_bytes: u64,
    ) -> PeerDescriptorBuilder {
        let mut b = Self::builder(role).page_size(page_size);
        b.kv_pool = Some(PoolKind::Mla);
        b.entries = Entries::Mla {
            layers,
            token_bytes,
        };
        b
    }

    /// An MHA/GQA rank: `2 · layers` KV entries (K, then V, per layer) of `page_size ·
    /// heads_per_rank · head_dim · element bytes` each, with `heads_per_rank =
    /// max(1, total_kv_heads / attn_tp_size)` as SGLang shards heads. The element size comes from
    /// `kv_cache_dtype` when it names one (`"bfloat16"`, `"fp8_e4m3"`, ...); with the default
    /// `"auto"` it must be given with [`element_bytes`](PeerDescriptorBuilder::element_bytes).
    ///
    /// ```
    /// use kvbridge_handshake::{PeerDescriptor, Role};
    /// // Llama-3-8B prefill rank 0 of TP 4: 32 layers, 8 KV heads of dim 128, bf16.
    /// let d = PeerDescriptor::mha(Role::Prefill, 64, 32, 8, 128).element_bytes(2).attn_tp(4, 0).build()?;
    /// assert_eq!(d.kv_item_lens, vec![64 * 2 * 128 * 2; 64]);
    /// # Ok::<(), kvbridge_handshake::HandshakeError>(())
    /// ```
    pub fn mha(
        role: Role,
        page_size: u64,
        layers: usize,
        total_kv_heads: u32,
        head_dim: u32,
    ) -> PeerDescriptorBuilder {
        let mut b = Self::builder(role).page_size(page_size);
        b.kv_pool = Some(PoolKind::Mha);
        b.heads = Some((total_kv_heads, head_dim));
        b.entries = Entries::Mha { layers };
        b
    }

    /// A builder for any shape (hybrid MLA, entries exported from an engine as registered):
    /// `page_size`, `kv_pool` and `kv_item_lens` must be set before [`build`](PeerDescriptorBuilder::build).
    pub fn builder(role: Role) -> PeerDescriptorBuilder {
        PeerDescriptorBuilder {
            role,
            protocol_version: ProtocolVersion::CURRENT,
            page_size: None,
            kv_cache_dtype: "auto".to_owned(),
            kv_layout: None,
            kv_pool: None,
            attn_tp: (1, 0),
            attn_cp: (1, 0),
            pp: (1, 0),
            dcp_size: 1,
            kv_cache_sharding: false,
            heads: None,
            element_bytes: None,
            entries: Entries::Unset,
            num_draft_entries: 0,
            aux_item_lens: Vec::new(),
        }
    }
}

impl PeerDescriptorBuilder {
    /// Physical KV pool page size in tokens (`--page-size`).
    pub fn page_size(mut self, tokens: u64) -> Self {
        self.page_size = Some(tokens);
        self
    }

    /// Pool kind (set by [`PeerDescriptor::mla`] and [`PeerDescriptor::mha`]).
    pub fn kv_pool(mut self, kind: PoolKind) -> Self {
        self.kv_pool = Some(kind);
        self
    }

    /// The KV cache dtype string (`--kv-cache-dtype`, default `"auto"`).
    pub fn kv_cache_dtype(mut self, dtype: impl Into<String>) -> Self {
        self.kv_cache_dtype = dtype.into();
        self
    }

    /// The KV layout name (default none).
    pub fn kv_layout(mut self, layout: impl Into<String>) -> Self {
        self.kv_layout = Some(layout.into());
        self
    }

    /// Bytes per KV element, for an MHA shape whose `kv_cache_dtype` (such as `"auto"`) does not
    /// say it.
    pub fn element_bytes(mut self, bytes: u64) -> Self {
        self.element_bytes = Some(bytes);
        self
    }

    /// Total KV heads of the model and the head dimension (set by [`PeerDescriptor::mha`]).
    pub fn heads(mut self, total_kv_heads: u32, head_dim: u32) -> Self {
        self.heads = Some((total_kv_heads, head_dim));
        self
    }

    /// Bytes per page of every registered KV entry, target entries then draft entries, exactly
    /// as the engine registered them; replaces the entries [`PeerDescriptor::mla`] or
    /// [`PeerDescriptor::mha`] would derive.
    pub fn kv_item_lens(mut self, lens: Vec<u64>) -> Self {
        self.entries = Entries::Given(lens);
        self
    }

    /// How many of the last KV entries are speculative-decoding draft entries (default 0).
    pub fn num_draft_entries(mut self, n: usize) -> Self {
        self.num_draft_entries = n;
        self
    }

    /// Bytes per row of every aux (metadata) buffer (default none).
    pub fn aux_item_lens(mut self, lens: Vec<u64>) -> Self {
        self.aux_item_lens = lens;
        self
    }

    /// Attention tensor-parallel size and this rank's TP rank (default 1, 0).
    pub fn attn_tp(mut self, size: u32, rank: u32) -> Self {
        self.attn_tp = (size, rank);
        self
    }

    /// Attention context-parallel size and rank (default 1, 0; a decode must use 1).
    pub fn attn_cp(mut self, size: u32, rank: u32) -> Self {
        self.attn_cp = (size, rank);
        self
    }

    /// Pipeline-parallel size and this rank's stage (default 1, 0).
    pub fn pp(mut self, size: u32, rank: u32) -> Self {
        self.pp = (size, rank);
        self
    }

    /// Decode context-parallel size (default 1); the DCP rank follows from the attention TP
    /// rank (`attn_tp_rank mod dcp_size`).
    pub fn dcp(mut self, size: u32) -> Self {
        self.dcp_size = size;
        self
    }

    /// `--enable-kv-cache-sharding` (default false).
    pub fn kv_cache_sharding(mut self, on: bool) -> Self {
        self.kv_cache_sharding = on;
        self
    }

    /// The descriptor protocol version to advertise (default [`ProtocolVersion::CURRENT`]).
    pub fn protocol_version(mut self, version: ProtocolVersion) -> Self {
        self.protocol_version = version;
        self
    }

    /// The descriptor.
    ///
    /// # Errors
    /// [`HandshakeError::DescriptorBuild`] when a required value is missing (`page_size`,
    /// `kv_pool`, `kv_item_lens`, the head geometry of an MHA pool, the element size of an MHA
    /// shape whose dtype does not name one), a size is 0, a rank is not below its size, or
    /// `dcp_size` does not divide `attn_tp_size`. Whether two descriptors work together is
    /// [`crate::check`]'s question, not the builder's.
    pub fn build(self) -> Result<PeerDescriptor> {
        let fail = |message: String, remedy: &str| {
            Err(HandshakeError::DescriptorBuild {
                message,
                remedy: remedy.to_owned(),
            })
        };
        let Some(page_size) = self.page_size.filter(|&p| p > 0) else {
            return fail(
                format!(
                    "page_size is {}",
                    self.page_size
                        .map_or("not set".to_owned(), |p| p.to_string())
                ),
                "call .page_size(tokens) with the engine's --page-size (at least 1)",
            );
        };
        let Some(kv_pool) = self.kv_pool else {
            return fail(
                "kv_pool is not set".to_owned(),
                "start from PeerDescriptor::mla(..) or PeerDescriptor::mha(..), or call .kv_pool(..)",
            );
        };
        for (name, (size, rank)) in [
            ("attn_tp", self.attn_tp),
            ("attn_cp", self.attn_cp),
            ("pp", self.pp),
        ] {
            if size == 0 || rank >= size {
                return fail(
                    format!(
                        "{name} size {size}, rank {rank}: the rank must be below a size of at least 1"
                    ),
                    &format!("call .{name}(size, rank) with 0 <= rank < size"),
                );
            }
        }
        let (tp, tp_rank) = self.attn_tp;
        if self.dcp_size == 0 || tp % self.dcp_size != 0 {
            return fail(
                format!(
                    "dcp_size {} does not divide attn_tp_size {tp}",
                    self.dcp_size
                ),
                "call .dcp(size) with a divisor of the attention TP size (1 without DCP)",
            );
        }
        if kv_pool == PoolKind::Mha && self.heads.is_none() {
            return fail(
                "an mha pool needs total_kv_heads and head_dim".to_owned(),
                "start from PeerDescriptor::mha(..) or call .heads(total_kv_heads, head_dim)",
            );
        }
        let kv_item_lens = match self.entries {
            Entries::Unset => {
                return fail(
                    "kv_item_lens is not set".to_owned(),
                    "call .kv_item_lens(..) with the bytes per page of every registered KV entry, \
                     or start from PeerDescriptor::mla(..) or PeerDescriptor::mha(..)",
                );
            }
            Entries::Given(lens) => lens,
            Entries::Mla {
                layers,
                token_bytes,
            } => vec![page_size.saturating_mul(token_bytes); layers],
            Entries::Mha { layers } => {
                let (heads, head_dim) = self.heads.unwrap_or_default();
                let Some(element) = self
                    .element_bytes
                    .or_else(|| dtype_bytes(&self.kv_cache_dtype))
                else {
                    return fail(
                        format!(
                            "kv_cache_dtype {:?} does not say how many bytes a KV element takes",
                            self.kv_cache_dtype
                        ),
                        "call .element_bytes(n) (2 for a bf16 or fp16 model), or name the dtype \
                         with .kv_cache_dtype(\"bfloat16\")",
                    );
                };
                let per_rank = u64::from((heads / tp).max(1));
                let item = page_size
                    .saturating_mul(per_rank)
                    .saturating_mul(u64::from(head_dim))
                    .saturating_mul(element);
                vec![item; layers.saturating_mul(2)]
            }
        };
        if self.num_draft_entries > kv_item_lens.len() {
            return fail(
                format!(
                    "num_draft_entries {} exceeds the {} KV entries",
                    self.num_draft_entries,
                    kv_item_lens.len()
                ),
                "count only the draft entries at the end of kv_item_lens",
            );
        }
        let (total_kv_heads, head_dim) = self.heads.unzip();
        Ok(PeerDescriptor {
            role: self.role,
            protocol_version: self.protocol_version,
            page_size,
            kv_cache_dtype: self.kv_cache_dtype,
            kv_layout: self.kv_layout,
            kv_pool,
            attn_tp_size: tp,
            attn_tp_rank: tp_rank,
            attn_cp_size: self.attn_cp.0,
            attn_cp_rank: self.attn_cp.1,
            pp_size: self.pp.0,
            pp_rank: self.pp.1,
            dcp_size: self.dcp_size,
            dcp_rank: tp_rank % self.dcp_size,
            kv_cache_sharding: self.kv_cache_sharding,
            total_kv_heads,
            head_dim,
            kv_item_lens,
            num_draft_entries: self.num_draft_entries,
            aux_item_lens: self.aux_item_lens,
        })
    }
}

impl FromStr for PeerDescriptor {
    type Err = HandshakeError;

    fn from_str(s: &str) -> Result<Self> {
        Self::from_json(s)
    }
}

/// The `protocol_version` a JSON text declares, if it is a JSON object with a readable one.
fn declared_version(text: &str) -> Option<ProtocolVersion> {
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    let raw = value.get("protocol_version")?;
    let raw: RawVersion = serde_json::from_value(raw.clone()).ok()?;
    ProtocolVersion::try_from(raw).ok()
}
