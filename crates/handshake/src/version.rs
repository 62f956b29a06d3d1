//! The descriptor protocol version, [`ProtocolVersion`].

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A descriptor protocol version, `MAJOR.MINOR`.
///
/// A newer minor version only adds optional fields whose defaults keep the old meaning; a newer
/// major version may change meanings and is refused
/// ([`crate::HandshakeError::UnsupportedProtocolVersion`]). In JSON it is a string such as `"1.0"`
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

/// The `protocol_version` a JSON value declares, if it is an object with a readable one.
pub(crate) fn declared_version(value: &serde_json::Value) -> Option<ProtocolVersion> {
    let raw = value.get("protocol_version")?;
    let raw = RawVersion::deserialize(raw).ok()?;
    ProtocolVersion::try_from(raw).ok()
}
