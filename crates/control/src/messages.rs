//! Control messages, as plain serde data (docs/control-protocol.md, "Messages").
//!
//! Every message carries everything a process boundary needs: endpoints to reply to, region
//! ids *as the peer's transport knows them*, the transport descriptor bytes, the room and its
//! generation. Nothing refers to memory of the sending process. The JSON form is
//! `{"type": "<kind>", ...fields}` (e.g. `{"type":"ping","nonce":7}`); within one major
//! [`CONTROL_PROTOCOL_VERSION`] a newer minor only adds optional fields and message types, so a
//! receiver ignores fields it does not know and [`ControlMessage::from_json`] skips types it
//! does not know.

use serde::{Deserialize, Serialize};

use kvbridge_handshake::PeerDescriptor;

use crate::endpoint::Endpoint;
use crate::ids::{Generation, RoomId, SessionId};
use crate::state::{FailureCause, RoomState};
use crate::trace::TraceParent;
use crate::version::ProtocolVersion;

/// Version of the control messages. Agents whose majors differ refuse each other's
/// registration; otherwise they speak the lower minor. Minor 1 added `protocol_minor` and the
/// rule that unknown message types are skipped; minor 2 the optional `traceparent` of
/// [`TransferInfo`].
pub const CONTROL_PROTOCOL_VERSION: ProtocolVersion = ProtocolVersion::new(1, 2);

/// One control message. See each payload for its fields and when it is sent.
///
/// Every message carries everything a process boundary needs: endpoints to reply to, region
/// ids *as the peer's transport knows them*, the transport descriptor bytes, the room and its
/// generation; nothing refers to memory of the sending process. The JSON form is
/// `{"type": "<kind>", ...fields}` (e.g. `{"type":"ping","nonce":7}`), stable within a
/// major [`CONTROL_PROTOCOL_VERSION`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ControlMessage {
    /// Decode rank → each target prefill rank, once per peer pair.
    Register(Registration),
    /// Prefill rank → decode rank: the answer to a [`Registration`].
    RegisterReply(RegistrationReply),
    /// Decode rank → each target prefill rank, once per room (SGLang's "TransferInfo").
    TransferInfo(TransferInfo),
    /// Prefill rank → decode rank: a room's state on the prefill (Success / Failed).
    Status(StatusUpdate),
    /// Decode rank → each prefill peer of a room: stop, and acknowledge when nothing of the
    /// room can land any more.
    Abort(AbortRequest),
    /// Prefill rank → decode rank: no byte of the room can land any more.
    AbortAck(AbortAck),
    /// Heartbeat request (decode → prefill).
    Ping(Heartbeat),
    /// Heartbeat answer (prefill → decode), echoing the nonce.
    Pong(Heartbeat),
}

impl ControlMessage {
    /// Every message kind of this version, as in the JSON `type` field.
    pub const KINDS: [&'static str; 8] = [
        "register",
        "register_reply",
        "transfer_info",
        "status",
        "abort",
        "abort_ack",
        "ping",
        "pong",
    ];

    /// Parses one message from its JSON form. `Ok(None)` is a message whose `type` this
    /// version does not know (a newer minor's addition), which a receiver skips.
    ///
    /// # Errors
    /// The JSON error when the bytes are not a message: not JSON, no string `type`, or a known
    /// type with missing or mistyped fields.
    pub fn from_json(bytes: &[u8]) -> Result<Option<ControlMessage>, serde_json::Error> {
        #[derive(Deserialize)]
        struct Kind<'a> {
            #[serde(rename = "type", borrow)]
            kind: std::borrow::Cow<'a, str>,
        }
        match serde_json::from_slice(bytes) {
            Ok(m) => Ok(Some(m)),
            Err(e) => match serde_json::from_slice::<Kind<'_>>(bytes) {
                Ok(k) if !Self::KINDS.contains(&&*k.kind) => Ok(None),
                _ => Err(e),
            },
        }
    }

    /// The message kind, as in the JSON `type` field.
    pub fn kind(&self) -> &'static str {
        match self {
            ControlMessage::Register(_) => "register",
            ControlMessage::RegisterReply(_) => "register_reply",
            ControlMessage::TransferInfo(_) => "transfer_info",
            ControlMessage::Status(_) => "status",
            ControlMessage::Abort(_) => "abort",
            ControlMessage::AbortAck(_) => "abort_ack",
            ControlMessage::Ping(_) => "ping",
            ControlMessage::Pong(_) => "pong",
        }
    }

    /// The room the message is about, if any.
    pub fn room(&self) -> Option<RoomId> {
        match self {
            ControlMessage::TransferInfo(m) => Some(m.room),
            ControlMessage::Status(m) => Some(m.room),
            ControlMessage::Abort(m) => Some(m.room),
            ControlMessage::AbortAck(m) => Some(m.room),
            _ => None,
        }
    }
}

/// A piece of registered memory as the owning side's transport knows it: `len` bytes at
/// `offset` inside region `region`. One per KV entry (target then draft) and one per aux buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WireRegion {
    /// The region id on the owner's transport (`RegionId.0`).
    pub region: u64,
    /// Byte offset of the entry inside the region.
    pub offset: u64,
    /// Bytes of the entry.
    pub len: u64,
}

/// How to reach a side's `KvTransport`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportInfo {
    /// The transport's `name()`; both sides must use the same kind of transport.
    pub name: String,
    /// The transport's `local_descriptor()` bytes, hex encoded in JSON.
    #[serde(with = "hex_bytes")]
    pub descriptor: Vec<u8>,
}

/// Decode rank → prefill rank, once per peer pair: who the decode is and where its memory is
/// (docs/control-protocol.md, "register").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    /// [`CONTROL_PROTOCOL_VERSION`] of the sender (the JSON fields `protocol` and
    /// `protocol_minor`).
    #[serde(flatten)]
    pub protocol: ProtocolVersion,
    /// The decode rank's control endpoint (status, acks and pongs go here).
    pub decode_endpoint: Endpoint,
    /// A value unique to this incarnation of the decode agent; a new value from the same
    /// endpoint means the decode restarted, and its old rooms are failed.
    pub session: SessionId,
    /// The decode rank's descriptor (checked against the prefill's with `kvbridge_handshake`).
    pub descriptor: PeerDescriptor,
    /// How to reach the decode's transport.
    pub transport: TransportInfo,
    /// One region per KV entry, in descriptor order (target then draft).
    pub kv_regions: Vec<WireRegion>,
    /// One region per aux buffer, in descriptor order.
    pub aux_regions: Vec<WireRegion>,
}

/// One compatibility problem on the wire (code, message, remedy), as `kvbridge_handshake`
/// reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireProblem {
    /// Stable problem code, e.g. `KVB-E007`.
    pub code: String,
    /// What is wrong, with the values seen.
    pub message: String,
    /// How to fix it.
    pub remedy: String,
}

impl From<&kvbridge_handshake::Problem> for WireProblem {
    fn from(p: &kvbridge_handshake::Problem) -> Self {
        WireProblem {
            code: p.code.as_str().to_owned(),
            message: p.message.clone(),
            remedy: p.remedy.clone(),
        }
    }
}

impl std::fmt::Display for WireProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} (fix: {})", self.code, self.message, self.remedy)
    }
}

/// Renders every problem on one line each, prefixed by a count.
pub fn render_problems(problems: &[WireProblem]) -> String {
    let mut out = format!(
        "prefill and decode are incompatible ({} problem{}):",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    );
    for p in problems {
        out.push_str("\n  ");
        out.push_str(&p.to_string());
    }
    out
}

/// The outcome of a registration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum RegistrationOutcome {
    /// The prefill will serve this decode rank.
    Accepted {
        /// The prefill rank's descriptor.
        descriptor: PeerDescriptor,
    },
    /// The prefill refuses this decode rank; every problem is listed.
    Rejected {
        /// Every problem found (never empty).
        problems: Vec<WireProblem>,
    },
}

/// Prefill rank → decode rank: the answer to a [`Registration`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegistrationReply {
    /// [`CONTROL_PROTOCOL_VERSION`] of the sender (the JSON fields `protocol` and
    /// `protocol_minor`).
    #[serde(flatten)]
    pub protocol: ProtocolVersion,
    /// The prefill rank's control endpoint.
    pub prefill_endpoint: Endpoint,
    /// The prefill rank's unique rank, which its status messages carry
    /// (docs/control-protocol.md, "Ranks").
    pub prefill_rank: u32,
    /// The decode session this answers.
    pub session: SessionId,
    /// Accepted or rejected.
    pub result: RegistrationOutcome,
}

/// Decode rank → prefill rank, once per room: where this decode rank wants the room's KV.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferInfo {
    /// The room.
    pub room: RoomId,
    /// The room's generation on the decode (echoed in statuses).
    pub generation: Generation,
    /// The decode rank's control endpoint.
    pub decode_endpoint: Endpoint,
    /// The decode session (must match the registration).
    pub session: SessionId,
    /// Destination page ids for the whole send range (virtual pages under DCP); empty for a
    /// dummy peer.
    pub dst_pages: Vec<u64>,
    /// The decode's aux (metadata) row for this room; `None` for a dummy peer.
    pub dst_aux_index: Option<u64>,
    /// This prefill rank sends nothing for this decode rank (it only learns the room).
    pub is_dummy: bool,
    /// How many decode ranks register this room at this prefill rank.
    pub required_dst_info_num: u32,
    /// Tokens the decode already holds; the prefill sends from here.
    pub decode_prefix_len: u64,
    /// The decode room's W3C trace context (minor 2), so the prefill's spans of the room join
    /// the decode's trace. Optional both ways: absent from the JSON when `None`, ignored by
    /// a minor-1 receiver, and a value that is not a well-formed `traceparent` reads as
    /// `None` (the room goes on untraced, the message is not refused).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::trace::lenient"
    )]
    pub traceparent: Option<TraceParent>,
}

/// Prefill rank → decode rank: a room's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusUpdate {
    /// The room.
    pub room: RoomId,
    /// The generation from the room's [`TransferInfo`].
    pub generation: Generation,
    /// The state (Success or Failed; others are ignored by the decode).
    pub state: RoomState,
    /// The sender's prefill unique rank.
    pub prefill_rank: u32,
    /// The failure reason, when Failed.
    pub reason: Option<String>,
    /// The failure cause, when Failed.
    pub cause: Option<FailureCause>,
}

/// Decode rank → prefill rank: abort the room and acknowledge once nothing can land.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortRequest {
    /// The room.
    pub room: RoomId,
    /// A fresh generation armed for this abort; only acks carrying it count.
    pub generation: Generation,
    /// Where to send the ack.
    pub decode_endpoint: Endpoint,
    /// Why (for the prefill's log and its room's failure reason).
    pub reason: String,
}

/// Prefill rank → decode rank: no byte of the room can land any more (every batch of the room
/// reached a final state, and none will be posted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortAck {
    /// The room.
    pub room: RoomId,
    /// The generation of the abort being acknowledged.
    pub generation: Generation,
    /// The acknowledging prefill unique rank.
    pub prefill_rank: u32,
    /// The acknowledging prefill endpoint.
    pub prefill_endpoint: Endpoint,
}

/// Heartbeat payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Echoed by the answer.
    pub nonce: u64,
}

mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(bytes.len() * 2);
        for b in bytes {
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 15) as usize] as char);
        }
        s.serialize_str(&out)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        if s.len() % 2 != 0 {
            return Err(serde::de::Error::custom(format!(
                "hex string has odd length {}",
                s.len()
            )));
        }
        let nibble = |c: u8| -> Result<u8, D::Error> {
            match c {
                b'0'..=b'9' => Ok(c - b'0'),
                b'a'..=b'f' => Ok(c - b'a' + 10),
                b'A'..=b'F' => Ok(c - b'A' + 10),
                _ => Err(serde::de::Error::custom(format!(
                    "invalid hex digit {:?}",
                    c as char
                ))),
            }
        };
        s.as_bytes()
            .chunks_exact(2)
            .map(|p| Ok((nibble(p[0])? << 4) | nibble(p[1])?))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_shape_is_tagged_and_round_trips() {
        let m = ControlMessage::Ping(Heartbeat { nonce: 7 });
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"type":"ping","nonce":7}"#
        );
        let t = TransportInfo {
            name: "loopback".into(),
            descriptor: vec![0, 1, 0xab, 0xff],
        };
        let j = serde_json::to_string(&t).unwrap();
        assert_eq!(j, r#"{"name":"loopback","descriptor":"0001abff"}"#);
        assert_eq!(serde_json::from_str::<TransportInfo>(&j).unwrap(), t);
        assert!(
            serde_json::from_str::<TransportInfo>(r#"{"name":"x","descriptor":"0g"}"#).is_err()
        );
        let s = ControlMessage::Status(StatusUpdate {
            room: RoomId(9),
            generation: Generation(2),
            state: RoomState::Failed,
            prefill_rank: 1,
            reason: Some("boom".into()),
            cause: Some(FailureCause::TransferError),
        });
        let j = serde_json::to_string(&s).unwrap();
        assert!(j.starts_with(r#"{"type":"status","room":9"#), "{j}");
        assert_eq!(serde_json::from_str::<ControlMessage>(&j).unwrap(), s);
        assert_eq!(s.room(), Some(RoomId(9)));
        assert_eq!(s.kind(), "status");
    }

    /// A minor-1 `transfer_info` (no `traceparent`), as an older decode sends it.
    const OLD_INFO: &str = r#"{"type":"transfer_info","room":5,"generation":1,"decode_endpoint":"d:1","session":3,"dst_pages":[1,2],"dst_aux_index":0,"is_dummy":false,"required_dst_info_num":1,"decode_prefix_len":0}"#;

    #[test]
    fn transfer_info_without_traceparent_decodes_as_before_and_encodes_the_same() {
        let m = ControlMessage::from_json(OLD_INFO.as_bytes())
            .unwrap()
            .unwrap();
        let ControlMessage::TransferInfo(info) = &m else {
            panic!("{m:?}")
        };
        assert_eq!(info.traceparent, None);
        assert_eq!(info.dst_pages, vec![1, 2]);
        // Without a trace context the message is byte for byte what minor 1 sent.
        assert_eq!(serde_json::to_string(&m).unwrap(), OLD_INFO);
    }

    #[test]
    fn transfer_info_carries_a_traceparent_and_drops_a_malformed_one() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let with = OLD_INFO.replace('}', &format!(r#","traceparent":"{tp}"}}"#));
        let m = ControlMessage::from_json(with.as_bytes()).unwrap().unwrap();
        let ControlMessage::TransferInfo(info) = &m else {
            panic!("{m:?}")
        };
        assert_eq!(info.traceparent, TraceParent::parse(tp));
        assert!(info.traceparent.is_some());
        assert_eq!(serde_json::to_string(&m).unwrap(), with);
        for bad in [r#""garbage""#, "17", "null", r#"{"x":1}"#, r#""00-zz""#] {
            let j = OLD_INFO.replace('}', &format!(r#","traceparent":{bad}}}"#));
            let m = ControlMessage::from_json(j.as_bytes())
                .unwrap_or_else(|e| panic!("{bad}: {e}"))
                .unwrap();
            let ControlMessage::TransferInfo(info) = m else {
                panic!("{bad}")
            };
            assert_eq!(info.traceparent, None, "{bad}");
            assert_eq!(info.room, RoomId(5), "{bad}");
        }
    }

    fn registration() -> Registration {
        Registration {
            protocol: CONTROL_PROTOCOL_VERSION,
            decode_endpoint: Endpoint::new("d:1"),
            session: SessionId(3),
            descriptor: PeerDescriptor::mla(kvbridge_handshake::Role::Decode, 16, 2, 64)
                .build()
                .unwrap(),
            transport: TransportInfo {
                name: "tcp".into(),
                descriptor: vec![1],
            },
            kv_regions: vec![WireRegion {
                region: 1,
                offset: 0,
                len: 8,
            }],
            aux_regions: vec![],
        }
    }

    #[test]
    fn every_kind_is_listed() {
        let m = ControlMessage::Register(registration());
        let kinds = [
            m.kind(),
            ControlMessage::Ping(Heartbeat { nonce: 0 }).kind(),
            ControlMessage::Pong(Heartbeat { nonce: 0 }).kind(),
        ];
        for k in kinds {
            assert!(ControlMessage::KINDS.contains(&k), "{k}");
        }
    }

    #[test]
    fn the_version_travels_as_protocol_and_protocol_minor() {
        let j = serde_json::to_value(ControlMessage::Register(registration())).unwrap();
        assert_eq!(j["protocol"], 1);
        assert_eq!(j["protocol_minor"], CONTROL_PROTOCOL_VERSION.minor);
        assert_eq!(j["session"], 3, "typed ids stay bare numbers");
    }

    /// A registration of an older release (no `protocol_minor`) reads as minor 0, and one of a
    /// newer minor with fields this version does not know still parses.
    #[test]
    fn older_and_newer_minor_registrations_parse() {
        let mut j = serde_json::to_value(ControlMessage::Register(registration())).unwrap();
        j.as_object_mut().unwrap().remove("protocol_minor");
        let old = ControlMessage::from_json(&serde_json::to_vec(&j).unwrap()).unwrap();
        let Some(ControlMessage::Register(old)) = old else {
            panic!("{old:?}")
        };
        assert_eq!(old.protocol, ProtocolVersion::new(1, 0));
        assert_eq!(
            CONTROL_PROTOCOL_VERSION.negotiate(old.protocol),
            Some(ProtocolVersion::new(1, 0))
        );

        j["protocol_minor"] = 7.into();
        j["a_field_of_minor_7"] = serde_json::json!({"x": [1, 2]});
        let new = ControlMessage::from_json(&serde_json::to_vec(&j).unwrap()).unwrap();
        let Some(ControlMessage::Register(new)) = new else {
            panic!("{new:?}")
        };
        assert_eq!(new.protocol, ProtocolVersion::new(1, 7));
        assert_eq!(
            CONTROL_PROTOCOL_VERSION.negotiate(new.protocol),
            Some(CONTROL_PROTOCOL_VERSION)
        );
        let want = Registration {
            protocol: ProtocolVersion::new(1, 7),
            ..registration()
        };
        assert_eq!(new, want);
    }

    #[test]
    fn unknown_types_are_skipped_and_broken_known_ones_refused() {
        assert_eq!(
            ControlMessage::from_json(br#"{"type":"added_in_minor_9","x":1}"#).unwrap(),
            None
        );
        assert!(ControlMessage::from_json(br#"{"type":"ping"}"#).is_err());
        assert!(ControlMessage::from_json(br#"{"nonce":1}"#).is_err());
        assert!(ControlMessage::from_json(b"[1]").is_err());
        assert!(ControlMessage::from_json(b"\xff").is_err());
        assert_eq!(
            ControlMessage::from_json(br#"{"type":"ping","nonce":2,"new":true}"#).unwrap(),
            Some(ControlMessage::Ping(Heartbeat { nonce: 2 }))
        );
    }
}
