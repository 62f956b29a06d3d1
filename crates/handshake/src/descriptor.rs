//! What one rank advertises: [`PeerDescriptor`] and its JSON form.

use std::fmt;
use std::str::FromStr;

use kvbridge_geometry::PoolKind;
use serde::{Deserialize, Serialize};

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
/// ignored.
///
/// ```
/// use kvbridge_handshake::{PeerDescriptor, Role};
/// let d: PeerDescriptor = r#"{
///     "role": "decode", "page_size": 64, "kv_cache_dtype": "auto", "kv_pool": "mla",
///     "attn_tp_size": 4, "attn_tp_rank": 1, "dcp_size": 4, "dcp_rank": 1,
///     "kv_item_lens": [18432, 18432]
/// }"#.parse()?;
/// assert_eq!(d.role, Role::Decode);
/// assert_eq!(d.pp_size, 1);
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
