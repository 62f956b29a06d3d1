//! [`Endpoint`]: the address of an agent's control endpoint.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The address of an agent's control endpoint: an opaque string (`"prefill-0"` in process,
/// `"10.0.0.5:17000"` over TCP).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Endpoint(pub String);

impl Endpoint {
    /// An endpoint from any string.
    pub fn new(s: impl Into<String>) -> Self {
        Endpoint(s.into())
    }

    /// The string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for Endpoint {
    fn from(s: &str) -> Self {
        Endpoint(s.to_owned())
    }
}

impl From<String> for Endpoint {
    fn from(s: String) -> Self {
        Endpoint(s)
    }
}
