//! The messages kvbridge-nixl sends as NIXL notifications: the caller's own notifications, and
//! the control messages that keep a sender's view of the receiver's regions exact.
//!
//! Every notification starts with a tag byte, so a caller's payload can never be mistaken for a
//! control message. Layout after the tag (little-endian): `User`: the payload; `Hello`: u64
//! sequence number, the sender's descriptor; `Ack`/`Probe`: u64 sequence number; `Update`: u64
//! sequence number, u32 count, count × (u64 id, u64 addr, u64 len, u8 kind, u32 device), the
//! NIXL metadata of new regions (possibly empty); `Bye`: nothing.

use crate::descriptor::{MAX_METADATA, MAX_REGIONS, RemoteRegion};

const USER: u8 = 0;
const HELLO: u8 = 1;
const ACK: u8 = 2;
const PROBE: u8 = 3;
const UPDATE: u8 = 4;
const BYE: u8 = 5;
const REGION_BYTES: usize = 29;

/// One message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Control {
    /// A batch's notification (or an empty batch's), for `recv_notification`.
    User(Vec<u8>),
    /// A sender introduces itself at `connect` with its descriptor, so the receiver can answer.
    Hello { seq: u64, descriptor: Vec<u8> },
    /// Acknowledges `Hello`, `Probe` or `Update` number `seq`.
    Ack { seq: u64 },
    /// Asks for an `Ack`: the peer's agent is alive and polling.
    Probe { seq: u64 },
    /// The receiver's whole region table, plus NIXL metadata of regions new in it. The sender
    /// acknowledges once its batches into regions missing from the table have ended.
    Update {
        seq: u64,
        regions: Vec<RemoteRegion>,
        metadata: Vec<u8>,
    },
    /// The agent shut down or disconnected.
    Bye,
}

impl Control {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Control::User(p) => {
                out.push(USER);
                out.extend_from_slice(p);
            }
            Control::Hello { seq, descriptor } => {
                out.push(HELLO);
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(descriptor);
            }
            Control::Ack { seq } => {
                out.push(ACK);
                out.extend_from_slice(&seq.to_le_bytes());
            }
            Control::Probe { seq } => {
                out.push(PROBE);
                out.extend_from_slice(&seq.to_le_bytes());
            }
            Control::Update {
                seq,
                regions,
                metadata,
            } => {
                out.push(UPDATE);
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
                for r in regions {
                    out.extend_from_slice(&r.id.to_le_bytes());
                    out.extend_from_slice(&r.addr.to_le_bytes());
                    out.extend_from_slice(&r.len.to_le_bytes());
                    out.push(u8::from(r.device.is_some()));
                    out.extend_from_slice(&r.device.unwrap_or(0).to_le_bytes());
                }
                out.extend_from_slice(metadata);
            }
            Control::Bye => out.push(BYE),
        }
        out
    }

    /// Parses a message; sizes are checked against the bytes present before allocating.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, String> {
        let (&tag, rest) = bytes
            .split_first()
            .ok_or_else(|| "an empty notification".to_owned())?;
        let seq = |rest: &[u8]| -> Result<(u64, usize), String> {
            let b: [u8; 8] = rest
                .get(..8)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| {
                    format!("a control message of {} bytes is truncated", bytes.len())
                })?;
            Ok((u64::from_le_bytes(b), 8))
        };
        match tag {
            USER => Ok(Control::User(rest.to_vec())),
            HELLO => {
                let (seq, n) = seq(rest)?;
                Ok(Control::Hello {
                    seq,
                    descriptor: rest[n..].to_vec(),
                })
            }
            ACK | PROBE => {
                let (seq, n) = seq(rest)?;
                if rest.len() != n {
                    return Err(format!(
                        "{} trailing bytes after a control message",
                        rest.len() - n
                    ));
                }
                Ok(if tag == ACK {
                    Control::Ack { seq }
                } else {
                    Control::Probe { seq }
                })
            }
            UPDATE => {
                let (seq, n) = seq(rest)?;
                let rest = &rest[n..];
                let count: [u8; 4] = rest
                    .get(..4)
                    .and_then(|b| b.try_into().ok())
                    .ok_or_else(|| "a region update without its count".to_owned())?;
                let count = u32::from_le_bytes(count) as usize;
                let rest = &rest[4..];
                if count > MAX_REGIONS || rest.len() < count * REGION_BYTES {
                    return Err(format!(
                        "a region update lists {count} regions in {} bytes",
                        rest.len()
                    ));
                }
                let (table, metadata) = rest.split_at(count * REGION_BYTES);
                if metadata.len() > MAX_METADATA {
                    return Err(format!("{} bytes of region metadata", metadata.len()));
                }
                let mut regions = Vec::with_capacity(count);
                for r in table.chunks_exact(REGION_BYTES) {
                    let u = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().expect("8 bytes"));
                    let device = u32::from_le_bytes(r[25..29].try_into().expect("4 bytes"));
                    let (id, addr, len) = (u(0), u(8), u(16));
                    if addr.checked_add(len).is_none() {
                        return Err(format!(
                            "region {id} runs past the end of the address space"
                        ));
                    }
                    regions.push(RemoteRegion {
                        id,
                        addr,
                        len,
                        device: match r[24] {
                            0 => None,
                            1 => Some(device),
                            k => return Err(format!("region {id} has unknown memory kind {k}")),
                        },
                    });
                }
                Ok(Control::Update {
                    seq,
                    regions,
                    metadata: metadata.to_vec(),
                })
            }
            BYE if rest.is_empty() => Ok(Control::Bye),
            other => Err(format!(
                "unknown control message tag {other} ({} bytes)",
                bytes.len()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_message_round_trips() {
        let region = RemoteRegion {
            id: 3,
            addr: 0x1000,
            len: 64,
            device: Some(1),
        };
        for m in [
            Control::User(b"room 1".to_vec()),
            Control::User(Vec::new()),
            Control::Hello {
                seq: 9,
                descriptor: vec![1, 2, 3],
            },
            Control::Ack { seq: u64::MAX },
            Control::Probe { seq: 0 },
            Control::Update {
                seq: 5,
                regions: vec![
                    region,
                    RemoteRegion {
                        device: None,
                        ..region
                    },
                ],
                metadata: vec![8; 40],
            },
            Control::Bye,
        ] {
            assert_eq!(Control::decode(&m.encode()).unwrap(), m);
        }
    }

    #[test]
    fn a_user_payload_that_looks_like_control_stays_a_user_payload() {
        let tricky = Control::Ack { seq: 1 }.encode();
        let m = Control::User(tricky.clone());
        assert_eq!(Control::decode(&m.encode()).unwrap(), Control::User(tricky));
    }

    #[test]
    fn truncated_updates_are_refused() {
        let m = Control::Update {
            seq: 1,
            regions: vec![RemoteRegion {
                id: 1,
                addr: 0,
                len: 8,
                device: None,
            }],
            metadata: Vec::new(),
        }
        .encode();
        for cut in 1..m.len() {
            assert!(Control::decode(&m[..cut]).is_err(), "cut at {cut}");
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..120)) {
            let _ = Control::decode(&bytes);
        }
    }
}
