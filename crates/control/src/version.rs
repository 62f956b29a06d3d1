//! Protocol versions and their negotiation (docs/control-protocol.md, "Versions").
//!
//! A version is `major.minor`. Peers talk when their majors are equal; they then speak the
//! lower of the two minors. A minor only adds: new optional message fields (a receiver ignores
//! fields it does not know, and a missing one takes its default) and new message types (a
//! receiver skips a type it does not know). Anything else is a new major.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A protocol version, `major.minor`.
///
/// Inside a message its serde form is the two fields `"protocol"` (the major) and
/// `"protocol_minor"` (absent before minors existed: read as 0), flattened into the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ProtocolVersion {
    /// Incompatible changes; peers with different majors refuse each other.
    #[serde(rename = "protocol")]
    pub major: u16,
    /// Compatible additions; peers speak the lower minor.
    #[serde(rename = "protocol_minor", default)]
    pub minor: u16,
}

impl ProtocolVersion {
    /// The version `major.minor`.
    pub const fn new(major: u16, minor: u16) -> Self {
        Self { major, minor }
    }

    /// The version both sides speak when this side (`self`) meets a peer at `peer`: the same
    /// major and the lower minor, or `None` when the majors differ.
    pub fn negotiate(self, peer: ProtocolVersion) -> Option<ProtocolVersion> {
        (self.major == peer.major)
            .then(|| ProtocolVersion::new(self.major, self.minor.min(peer.minor)))
    }
}

impl fmt::Display for ProtocolVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const OURS: ProtocolVersion = ProtocolVersion::new(1, 3);

    #[test]
    fn equal_versions_speak_themselves() {
        assert_eq!(OURS.negotiate(OURS), Some(OURS));
    }

    #[test]
    fn an_older_minor_is_spoken_with_an_older_peer() {
        assert_eq!(
            OURS.negotiate(ProtocolVersion::new(1, 0)),
            Some(ProtocolVersion::new(1, 0))
        );
    }

    #[test]
    fn a_newer_minor_peer_is_met_at_ours() {
        assert_eq!(OURS.negotiate(ProtocolVersion::new(1, 9)), Some(OURS));
    }

    #[test]
    fn another_major_is_refused() {
        assert_eq!(OURS.negotiate(ProtocolVersion::new(2, 0)), None);
        assert_eq!(OURS.negotiate(ProtocolVersion::new(0, 3)), None);
    }

    #[test]
    fn the_message_form_is_two_fields_and_the_minor_defaults_to_0() {
        assert_eq!(
            serde_json::to_string(&OURS).unwrap(),
            r#"{"protocol":1,"protocol_minor":3}"#
        );
        assert_eq!(
            serde_json::from_str::<ProtocolVersion>(r#"{"protocol":1}"#).unwrap(),
            ProtocolVersion::new(1, 0)
        );
    }

    proptest! {
        /// Negotiation is symmetric, never above either side, and defined exactly for equal
        /// majors.
        #[test]
        fn negotiation_is_symmetric_and_the_minimum(a in 0u16..3, b in any::<u16>(), c in 0u16..3, d in any::<u16>()) {
            let (x, y) = (ProtocolVersion::new(a, b), ProtocolVersion::new(c, d));
            prop_assert_eq!(x.negotiate(y), y.negotiate(x));
            match x.negotiate(y) {
                Some(v) => {
                    prop_assert_eq!(a, c);
                    prop_assert_eq!(v, ProtocolVersion::new(a, b.min(d)));
                }
                None => prop_assert_ne!(a, c),
            }
        }
    }
}
