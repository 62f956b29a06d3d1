//! A W3C Trace Context `traceparent` (<https://www.w3.org/TR/trace-context/#traceparent-header>),
//! the one field that joins a decode's and a prefill's spans of one room into one trace
//! (docs/control-protocol.md, "transfer_info"; docs/tracing.md).
//!
//! Plain data with no OpenTelemetry dependency: the coordinator turns it into a span context.
//! A malformed value a peer sends is dropped (the room goes on untraced), never an error: a
//! trace is diagnostics, not part of the transfer.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A parsed `traceparent`: version `00`, a 16-byte trace id, an 8-byte parent span id (neither
/// all zeros) and the trace flags (bit 0: sampled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    /// The trace id (never all zeros).
    pub trace_id: [u8; 16],
    /// The sender's span id, the receiver's parent (never all zeros).
    pub span_id: [u8; 8],
    /// The trace flags; bit 0 says the sender sampled the trace.
    pub flags: u8,
}

impl TraceParent {
    /// Parses the header's text form `00-<32 hex>-<16 hex>-<2 hex>`, lower case. `None` for
    /// anything else: another length, upper-case or non-hex digits, version `ff`, all-zero
    /// ids. A version above `00` is read as `00` when its first four fields fit (the
    /// specification's rule for future versions), trailing fields ignored.
    pub fn parse(s: &str) -> Option<TraceParent> {
        let b = s.as_bytes();
        if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        let version = hex::<1>(&b[0..2])?[0];
        if version == 0xff || (version == 0 && b.len() != 55) || (b.len() > 55 && b[55] != b'-') {
            return None;
        }
        let trace_id = hex::<16>(&b[3..35])?;
        let span_id = hex::<8>(&b[36..52])?;
        let flags = hex::<1>(&b[53..55])?[0];
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Whether the sender sampled the trace (flag bit 0).
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

/// `N` bytes from `2N` lower-case hex digits.
fn hex<const N: usize>(digits: &[u8]) -> Option<[u8; N]> {
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    if digits.len() != 2 * N {
        return None;
    }
    let mut out = [0; N];
    for (o, p) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *o = (nibble(p[0])? << 4) | nibble(p[1])?;
    }
    Some(out)
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        self.trace_id
            .iter()
            .try_for_each(|b| write!(f, "{b:02x}"))?;
        f.write_str("-")?;
        self.span_id.iter().try_for_each(|b| write!(f, "{b:02x}"))?;
        write!(f, "-{:02x}", self.flags)
    }
}

impl Serialize for TraceParent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The field's lenient reading: any JSON value that is not a well-formed `traceparent` string
/// (a number, an object, a malformed string) reads as `None`, so a peer's bad trace context
/// never fails the message that carries it.
pub(crate) fn lenient<'de, D: Deserializer<'de>>(d: D) -> Result<Option<TraceParent>, D::Error> {
    let value = serde_json::Value::deserialize(d)?;
    Ok(value.as_str().and_then(TraceParent::parse))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_formats_the_specification_example() {
        let t = TraceParent::parse(GOOD).unwrap();
        assert_eq!(t.trace_id[0], 0x4b);
        assert_eq!(t.span_id[7], 0xb7);
        assert!(t.sampled());
        assert_eq!(t.to_string(), GOOD);
    }

    #[test]
    fn refuses_what_the_specification_refuses() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
        // A future version: its first four fields are read, the rest ignored.
        let future = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-next";
        assert!(TraceParent::parse(future).is_some());
    }
}
