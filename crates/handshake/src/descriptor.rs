//! What one rank advertises: [`PeerDescriptor`] and its JSON form.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use kvbridge_geometry::PoolKind;
use serde::{Deserialize, Serialize};

use crate::error::{HandshakeError, Result};
use crate::version::{ProtocolVersion, declared_version};

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

fn one() -> u32 {
    1
}

/// What one rank advertises to its peer before any KV moves.
///
/// The JSON field names are part of the public contract. Omitted optional fields take the
/// defaults documented on each field. Unknown fields are rejected, so a typo is never silently
/// ignored, except in a descriptor of a newer minor version: a minor version only adds fields
/// whose defaults keep the old meaning, so this build reads the fields it knows and lists the
/// others in [`unknown_fields`](Self::unknown_fields) (`check` warns with `KVB-W003`). The
/// same rules hold wherever a descriptor is deserialised, inside control messages too. In Rust, build one with [`PeerDescriptor::mla`], [`PeerDescriptor::mha`] or
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
// The derived (strict) code becomes `PeerDescriptor::serialize`/`deserialize`; the trait impls
// below wrap it with the version rules.
#[serde(remote = "Self", deny_unknown_fields)]
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
    /// Fields of a newer minor version that this build does not know (sorted).
    #[serde(skip)]
    pub(crate) unknown_fields: Vec<String>,
}

/// Every JSON field this build knows: the names serde writes, which are the names it reads
/// (one derive, no renames), taken from the smallest descriptor with every optional field that
/// may be left out of the output set.
fn known_fields() -> &'static BTreeSet<String> {
    static KNOWN: OnceLock<BTreeSet<String>> = OnceLock::new();
    KNOWN.get_or_init(|| {
        let smallest = serde_json::json!({
            "role": "prefill", "page_size": 1, "kv_cache_dtype": "auto", "kv_pool": "mha",
            "attn_tp_size": 1, "kv_item_lens": [], "total_kv_heads": 1, "head_dim": 1,
        });
        // The derived (strict) reader: the version rules would ask for this set again.
        let written = PeerDescriptor::deserialize(smallest).and_then(serde_json::to_value);
        match written {
            Ok(serde_json::Value::Object(fields)) => fields.keys().cloned().collect(),
            _ => BTreeSet::new(),
        }
    })
}

/// How a descriptor's JSON object is read, decided by its declared version.
enum Reading {
    /// Every field must be known: this version or an older one, or nothing to ignore.
    Strict,
    /// A newer minor version: these fields are unknown here and left out.
    IgnoringNewer(Vec<String>),
}

/// The version rules, applied to the JSON value before its fields are read.
///
/// # Errors
/// [`HandshakeError::UnsupportedProtocolVersion`] for a newer major version: checked first,
/// so such a descriptor is refused for its version rather than for the fields it added.
fn reading(value: &serde_json::Value) -> Result<Reading> {
    let seen = declared_version(value);
    if let Some(seen) = seen.filter(|s| !s.is_supported()) {
        return Err(HandshakeError::UnsupportedProtocolVersion {
            seen,
            supported: ProtocolVersion::CURRENT,
        });
    }
    let newer_minor = seen.is_some_and(|s| s > ProtocolVersion::CURRENT);
    let unknown: Vec<String> = match value.as_object() {
        Some(fields) if newer_minor => fields
            .keys()
            .filter(|k| !known_fields().contains(k.as_str()))
            .cloned()
            .collect(),
        _ => Vec::new(),
    };
    Ok(if unknown.is_empty() {
        Reading::Strict
    } else {
        Reading::IgnoringNewer(unknown)
    })
}

/// A descriptor from a JSON value under the version rules.
fn from_value(mut value: serde_json::Value) -> Result<PeerDescriptor> {
    let unknown = match reading(&value)? {
        Reading::Strict => Vec::new(),
        Reading::IgnoringNewer(unknown) => {
            if let Some(fields) = value.as_object_mut() {
                fields.retain(|k, _| !unknown.contains(k));
            }
            unknown
        }
    };
    let mut d = PeerDescriptor::deserialize(value).map_err(|e| json_error(&e))?;
    d.unknown_fields = unknown;
    d.unknown_fields.sort();
    Ok(d)
}

/// [`HandshakeError::Json`] from a serde_json error.
fn json_error(e: &serde_json::Error) -> HandshakeError {
    let mut message = e.to_string();
    // serde_json appends " at line L column C"; they are reported separately.
    if let Some(cut) = message.rfind(" at line ") {
        message.truncate(cut);
    }
    HandshakeError::Json {
        line: e.line(),
        column: e.column(),
        message,
    }
}

impl Serialize for PeerDescriptor {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        PeerDescriptor::serialize(self, s)
    }
}

impl<'de> Deserialize<'de> for PeerDescriptor {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(d)?;
        from_value(value).map_err(serde::de::Error::custom)
    }
}

/// The `kv_layout` of head-major MHA pages: a page of one entry holds, head by head, each
/// token's row of that head (vLLM's CPU KV cache, `[num_blocks, kv_heads, block_size,
/// 2·head_size]` per layer, described as one entry per layer with `head_dim = 2·head_size`).
/// When both sides name it, the planner slices heads as whole runs of a page
/// (`kvbridge_geometry::HeadSharding::head_major_page_ranges`; docs/planning.md, "Head-major
/// pages"); any other layout name, or none, is token-major.
pub const HEAD_MAJOR_KV_LAYOUT: &str = "LBHNC";

impl PeerDescriptor {
    /// Whether this rank's pages are head-major (`kv_layout` is [`HEAD_MAJOR_KV_LAYOUT`]).
    #[must_use]
    pub fn is_head_major(&self) -> bool {
        self.kv_layout.as_deref() == Some(HEAD_MAJOR_KV_LAYOUT)
    }
}

impl PeerDescriptor {
    /// Parse a descriptor from JSON.
    ///
    /// # Errors
    /// [`HandshakeError::Json`] (with line and column) for invalid JSON, unknown or missing
    /// fields and wrong types; [`HandshakeError::UnsupportedProtocolVersion`] for a descriptor
    /// from a newer major version (checked first, so a newer descriptor is refused for its
    /// version rather than for the fields it added). Unknown fields of a newer minor version
    /// are no error: see [`unknown_fields`](Self::unknown_fields).
    pub fn from_json(text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| json_error(&e))?;
        match reading(&value)? {
            // From the text, not the value, so that errors keep their line and column.
            Reading::Strict => {
                let mut de = serde_json::Deserializer::from_str(text);
                PeerDescriptor::deserialize(&mut de)
                    .and_then(|d| de.end().map(|()| d))
                    .map_err(|e| json_error(&e))
            }
            Reading::IgnoringNewer(_) => from_value(value),
        }
    }

    /// The fields of a newer minor version that this build does not know and so ignored
    /// (sorted; empty for a descriptor of this build's version or built in Rust). A newer minor
    /// version only adds fields whose defaults keep the old meaning, so the descriptor reads
    /// correctly without them; `check` reports them as the warning `KVB-W003`.
    pub fn unknown_fields(&self) -> &[String] {
        &self.unknown_fields
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

impl FromStr for PeerDescriptor {
    type Err = HandshakeError;

    fn from_str(s: &str) -> Result<Self> {
        Self::from_json(s)
    }
}

/// Bytes per element for dtype strings whose size is known (`auto` and unknown names: `None`).
pub fn dtype_bytes(dtype: &str) -> Option<u64> {
    match dtype.to_ascii_lowercase().as_str() {
        "fp8" | "fp8_e4m3" | "fp8_e5m2" | "float8_e4m3fn" | "float8_e5m2" | "int8" | "uint8" => {
            Some(1)
        }
        "bf16" | "bfloat16" | "fp16" | "float16" | "half" => Some(2),
        "fp32" | "float32" | "float" => Some(4),
        _ => None,
    }
}
