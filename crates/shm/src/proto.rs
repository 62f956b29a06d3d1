//! The control protocol spoken over the Unix socket: small length-prefixed frames.
//!
//! Sans-IO and safe: encoding, decoding and every length check live here and are unit-tested
//! (and run under Miri). A frame is `[body_len: u32 LE][kind: u8][body]`; integers are little
//! endian. Region file descriptors travel as `SCM_RIGHTS` ancillary data with the first byte of
//! the `Region` frame that announces them.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Protocol version carried in `Hello` / `Welcome`.
pub(crate) const VERSION: u32 = 3;
/// Largest notification payload accepted (and sent).
pub(crate) const MAX_NOTIFICATION: usize = 16 << 20;
/// Largest frame body accepted: a notification plus headroom. A peer claiming more is cut off
/// before anything is allocated for it.
pub(crate) const MAX_BODY: usize = MAX_NOTIFICATION + 64;
/// Bytes before the body.
pub(crate) const HEADER: usize = 5;

/// What a peer answered about one of its regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RegionStatus {
    /// Shared memory; its file descriptor comes with the frame (none when `len == 0`).
    Shared,
    /// Not registered (or deregistered).
    Unknown,
    /// Registered, but not memory allocated by the shared-memory transport.
    NotShared,
}

/// One control frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Frame {
    /// Client → server, first frame: protocol version and the server's token.
    Hello { version: u32, token: [u8; 16] },
    /// Server → client: accepted. The file of the connection's doorbell ring (`ring` bytes of
    /// shared memory, see `crate::doorbell`) comes with the frame.
    Welcome { version: u32, ring: u64 },
    /// Server → client, right after `Welcome`: the file of the server's bell page (`len`
    /// bytes), whose futex word the client bumps and wakes after it publishes a frame while the
    /// server's reader sleeps. One page serves every connection of the server, so one thread
    /// reads all their rings (see `crate::doorbell::Hub`).
    Bell { len: u64 },
    /// Either way: refused, with the reason; the connection closes after it.
    Reject { reason: String },
    /// Client → server: please send region `region` (answered by `Region` with the same `req`).
    GetRegion { req: u64, region: u64 },
    /// Server → client: the answer to `GetRegion`.
    Region {
        req: u64,
        region: u64,
        status: RegionStatus,
        len: u64,
    },
    /// Client → server: a batch's notification, sent after all its bytes were copied.
    Notify { payload: Bytes },
    /// Either way: liveness check.
    Ping { nonce: u64 },
    /// Either way: answer to `Ping`.
    Pong { nonce: u64 },
    /// Server → client: stop writing into `region` and acknowledge with `RevokeAck { id }`.
    Revoke { id: u64, region: u64 },
    /// Client → server: no byte will land in the revoked region any more.
    RevokeAck { id: u64 },
}

/// A frame that breaks the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProtoError(pub(crate) String);

impl std::fmt::Display for ProtoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

mod kind {
    pub(super) const HELLO: u8 = 1;
    pub(super) const WELCOME: u8 = 2;
    pub(super) const REJECT: u8 = 3;
    pub(super) const GET_REGION: u8 = 4;
    pub(super) const REGION: u8 = 5;
    pub(super) const NOTIFY: u8 = 6;
    pub(super) const PING: u8 = 7;
    pub(super) const PONG: u8 = 8;
    pub(super) const REVOKE: u8 = 9;
    pub(super) const REVOKE_ACK: u8 = 10;
    pub(super) const BELL: u8 = 11;
}

impl Frame {
    /// Encodes the frame with its header. Callers keep notification payloads within
    /// [`MAX_NOTIFICATION`] (checked when a batch is posted).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(32);
        let k = match self {
            Frame::Hello { version, token } => {
                body.put_u32_le(*version);
                body.put_slice(token);
                kind::HELLO
            }
            Frame::Welcome { version, ring } => {
                body.put_u32_le(*version);
                body.put_u64_le(*ring);
                kind::WELCOME
            }
            Frame::Bell { len } => {
                body.put_u64_le(*len);
                kind::BELL
            }
            Frame::Reject { reason } => {
                // Keep reasons short; they are for people.
                let r = reason.as_bytes();
                body.put_slice(&r[..r.len().min(4096)]);
                kind::REJECT
            }
            Frame::GetRegion { req, region } => {
                body.put_u64_le(*req);
                body.put_u64_le(*region);
                kind::GET_REGION
            }
            Frame::Region {
                req,
                region,
                status,
                len,
            } => {
                body.put_u64_le(*req);
                body.put_u64_le(*region);
                body.put_u8(match status {
                    RegionStatus::Shared => 0,
                    RegionStatus::Unknown => 1,
                    RegionStatus::NotShared => 2,
                });
                body.put_u64_le(*len);
                kind::REGION
            }
            Frame::Notify { payload } => {
                body.put_slice(payload);
                kind::NOTIFY
            }
            Frame::Ping { nonce } => {
                body.put_u64_le(*nonce);
                kind::PING
            }
            Frame::Pong { nonce } => {
                body.put_u64_le(*nonce);
                kind::PONG
            }
            Frame::Revoke { id, region } => {
                body.put_u64_le(*id);
                body.put_u64_le(*region);
                kind::REVOKE
            }
            Frame::RevokeAck { id } => {
                body.put_u64_le(*id);
                kind::REVOKE_ACK
            }
        };
        let mut out = Vec::with_capacity(HEADER + body.len());
        // Bodies are bounded by MAX_BODY (< 4 GiB), so the length fits in a u32.
        out.put_u32_le(u32::try_from(body.len()).unwrap_or(u32::MAX));
        out.put_u8(k);
        out.extend_from_slice(&body);
        out
    }

    /// The frame's kind, for messages.
    pub(crate) fn kind_name(&self) -> &'static str {
        match self {
            Frame::Hello { .. } => "Hello",
            Frame::Welcome { .. } => "Welcome",
            Frame::Bell { .. } => "Bell",
            Frame::Reject { .. } => "Reject",
            Frame::GetRegion { .. } => "GetRegion",
            Frame::Region { .. } => "Region",
            Frame::Notify { .. } => "Notify",
            Frame::Ping { .. } => "Ping",
            Frame::Pong { .. } => "Pong",
            Frame::Revoke { .. } => "Revoke",
            Frame::RevokeAck { .. } => "RevokeAck",
        }
    }

    /// Whether a file descriptor travels with this frame.
    pub(crate) fn carries_fd(&self) -> bool {
        match self {
            Frame::Region {
                status: RegionStatus::Shared,
                len,
                ..
            } => *len > 0,
            Frame::Welcome { ring, .. } => *ring > 0,
            Frame::Bell { len } => *len > 0,
            _ => false,
        }
    }
}

fn exact(kind_name: &str, body: &Bytes, want: usize) -> Result<(), ProtoError> {
    if body.len() == want {
        Ok(())
    } else {
        Err(ProtoError(format!(
            "a {kind_name} frame must carry {want} bytes, got {}",
            body.len()
        )))
    }
}

/// Decodes one frame body of kind `k`.
pub(crate) fn decode(k: u8, mut body: Bytes) -> Result<Frame, ProtoError> {
    Ok(match k {
        kind::HELLO => {
            exact("Hello", &body, 20)?;
            let version = body.get_u32_le();
            let mut token = [0u8; 16];
            body.copy_to_slice(&mut token);
            Frame::Hello { version, token }
        }
        kind::WELCOME => {
            exact("Welcome", &body, 12)?;
            Frame::Welcome {
                version: body.get_u32_le(),
                ring: body.get_u64_le(),
            }
        }
        kind::BELL => {
            exact("Bell", &body, 8)?;
            Frame::Bell {
                len: body.get_u64_le(),
            }
        }
        kind::REJECT => Frame::Reject {
            reason: String::from_utf8_lossy(&body[..body.len().min(4096)]).into_owned(),
        },
        kind::GET_REGION => {
            exact("GetRegion", &body, 16)?;
            Frame::GetRegion {
                req: body.get_u64_le(),
                region: body.get_u64_le(),
            }
        }
        kind::REGION => {
            exact("Region", &body, 25)?;
            let req = body.get_u64_le();
            let region = body.get_u64_le();
            let status = match body.get_u8() {
                0 => RegionStatus::Shared,
                1 => RegionStatus::Unknown,
                2 => RegionStatus::NotShared,
                other => {
                    return Err(ProtoError(format!(
                        "a Region frame has status {other}; known are 0, 1 and 2"
                    )));
                }
            };
            Frame::Region {
                req,
                region,
                status,
                len: body.get_u64_le(),
            }
        }
        kind::NOTIFY => {
            if body.len() > MAX_NOTIFICATION {
                return Err(ProtoError(format!(
                    "a notification of {} bytes exceeds the limit of {MAX_NOTIFICATION}",
                    body.len()
                )));
            }
            Frame::Notify { payload: body }
        }
        kind::PING => {
            exact("Ping", &body, 8)?;
            Frame::Ping {
                nonce: body.get_u64_le(),
            }
        }
        kind::PONG => {
            exact("Pong", &body, 8)?;
            Frame::Pong {
                nonce: body.get_u64_le(),
            }
        }
        kind::REVOKE => {
            exact("Revoke", &body, 16)?;
            Frame::Revoke {
                id: body.get_u64_le(),
                region: body.get_u64_le(),
            }
        }
        kind::REVOKE_ACK => {
            exact("RevokeAck", &body, 8)?;
            Frame::RevokeAck {
                id: body.get_u64_le(),
            }
        }
        other => {
            return Err(ProtoError(format!(
                "unknown frame kind {other} (this side speaks version {VERSION})"
            )));
        }
    })
}

/// Accumulates received bytes and cuts them into frames.
#[derive(Debug, Default)]
pub(crate) struct FrameDecoder {
    buf: BytesMut,
}

impl FrameDecoder {
    /// Appends received bytes.
    pub(crate) fn extend(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Bytes received but not yet consumed as a frame.
    pub(crate) fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete frame, if there is one. A body length above [`MAX_BODY`] is refused
    /// from the header alone, before anything is allocated for it.
    pub(crate) fn next_frame(&mut self) -> Result<Option<Frame>, ProtoError> {
        if self.buf.len() < HEADER {
            return Ok(None);
        }
        let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > MAX_BODY {
            return Err(ProtoError(format!(
                "a frame claims a body of {len} bytes; the limit is {MAX_BODY}"
            )));
        }
        if self.buf.len() < HEADER + len {
            self.buf.reserve(HEADER + len - self.buf.len());
            return Ok(None);
        }
        let k = self.buf[4];
        self.buf.advance(HEADER);
        let body = self.buf.split_to(len).freeze();
        decode(k, body).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_frames() -> Vec<Frame> {
        vec![
            Frame::Hello {
                version: VERSION,
                token: [7; 16],
            },
            Frame::Welcome {
                version: VERSION,
                ring: 4096,
            },
            Frame::Bell { len: 4096 },
            Frame::Reject {
                reason: "uid 5 not allowed".into(),
            },
            Frame::GetRegion { req: 1, region: 2 },
            Frame::Region {
                req: 3,
                region: 4,
                status: RegionStatus::Shared,
                len: 1 << 40,
            },
            Frame::Region {
                req: 3,
                region: 4,
                status: RegionStatus::NotShared,
                len: 9,
            },
            Frame::Notify {
                payload: Bytes::from_static(b"room 42"),
            },
            Frame::Notify {
                payload: Bytes::new(),
            },
            Frame::Ping { nonce: u64::MAX },
            Frame::Pong { nonce: 0 },
            Frame::Revoke { id: 5, region: 6 },
            Frame::RevokeAck { id: 5 },
        ]
    }

    #[test]
    fn every_frame_round_trips_even_byte_by_byte() {
        let frames = all_frames();
        let mut wire = Vec::new();
        for f in &frames {
            wire.extend(f.encode());
        }
        let mut dec = FrameDecoder::default();
        let mut out = Vec::new();
        for b in wire {
            dec.extend(&[b]);
            while let Some(f) = dec.next_frame().unwrap() {
                out.push(f);
            }
        }
        assert_eq!(out, frames);
        assert_eq!(dec.buffered(), 0);
    }

    #[test]
    fn oversized_claim_is_refused_from_the_header() {
        let mut dec = FrameDecoder::default();
        dec.extend(&u32::MAX.to_le_bytes());
        dec.extend(&[kind::NOTIFY]);
        let err = dec.next_frame().unwrap_err();
        assert!(err.0.contains("4294967295"), "{err}");
        // Nothing was reserved for the claimed body.
        assert!(dec.buf.capacity() < 1 << 20);
    }

    #[test]
    fn malformed_bodies_are_protocol_errors() {
        assert!(decode(kind::PING, Bytes::from_static(&[1, 2, 3])).is_err());
        assert!(
            decode(99, Bytes::new())
                .unwrap_err()
                .0
                .contains("unknown frame kind 99")
        );
        let mut region = Frame::Region {
            req: 1,
            region: 1,
            status: RegionStatus::Shared,
            len: 1,
        }
        .encode();
        region[HEADER + 16] = 7;
        let mut dec = FrameDecoder::default();
        dec.extend(&region);
        assert!(dec.next_frame().unwrap_err().0.contains("status 7"));
    }

    #[test]
    fn only_nonempty_shared_regions_carry_a_descriptor() {
        let shared = |len| Frame::Region {
            req: 0,
            region: 0,
            status: RegionStatus::Shared,
            len,
        };
        assert!(shared(1).carries_fd());
        assert!(!shared(0).carries_fd());
        assert!(!Frame::Ping { nonce: 1 }.carries_fd());
        assert!(
            Frame::Welcome {
                version: VERSION,
                ring: 1
            }
            .carries_fd()
        );
        assert!(Frame::Bell { len: 4096 }.carries_fd());
        assert!(!Frame::Bell { len: 0 }.carries_fd());
    }
}
