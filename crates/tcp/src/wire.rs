//! The kvbridge-tcp wire format, sans-IO: pure encoders and decoders over byte slices.
//!
//! Nothing here touches a socket, a clock or a region; the connection code reads bytes and
//! hands them to [`decode_header`] / [`decode_body`] (or [`decode_frame`] over a buffer).
//! Decoders never panic, never allocate more than the frame body they were given (which the
//! caller has already bounded with [`decode_header`]), and check every length with checked
//! arithmetic. See `docs/tcp-protocol.md` for the full specification.
//!
//! ```text
//! preface (48 bytes, each direction): magic "KVBTCP\r\n" | version u16 | flags u16 | reserved u32 | nonce [32]
//! frame header (8 bytes):             type u8 | flags u8 = 0 | reserved u16 = 0 | body_len u32
//! ```
//! All integers are big-endian. A `Data` (or `Rows`) frame's body holds only its descriptors;
//! the payload (the sum of the descriptor lengths, in descriptor order, row by row) follows the
//! frame on the stream and is not counted in `body_len`.

use bytes::Bytes;

use crate::error::{Result, TcpError};

/// The 8 bytes every connection starts with, in both directions.
pub const MAGIC: [u8; 8] = *b"KVBTCP\r\n";
/// The protocol version this build speaks.
pub const VERSION: u16 = 3;
/// Length of a connection preface.
pub const PREFACE_LEN: usize = 48;
/// Length of a frame header.
pub const HEADER_LEN: usize = 8;
/// Length of one write descriptor in a `Data` frame.
pub const OP_LEN: usize = 24;
/// Length of one row descriptor in a `Rows` frame.
pub const ROWS_OP_LEN: usize = 40;
/// Length of a `Begin` body without its region table and notification.
pub const BEGIN_FIXED: u64 = 38;
/// Entries of one `Regions` frame at most (so it fits the smallest frame limit, 4 KiB).
pub const REGIONS_PER_FRAME: usize = 255;
/// Length of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;
/// Length of a preface nonce.
pub const NONCE_LEN: usize = 32;
/// Preface flag: this side is configured with a connection secret.
pub const FLAG_SECRET: u16 = 1;
/// The largest body any configuration may allow (16 MiB).
pub const WIRE_MAX_FRAME_LEN: u32 = 16 << 20;
/// Most connections one session may have (`Hello`'s connection count).
pub const MAX_CONNECTIONS: u16 = 16;
/// Longest error message put on the wire, in bytes.
pub const MAX_ERROR_TEXT: usize = 1024;

/// The connection preface each side sends first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preface {
    /// Protocol version.
    pub version: u16,
    /// [`FLAG_SECRET`] or 0.
    pub flags: u16,
    /// Fresh random challenge for the peer's proof of the secret.
    pub nonce: [u8; NONCE_LEN],
}

impl Preface {
    /// Encodes the preface.
    pub fn encode(&self) -> [u8; PREFACE_LEN] {
        let mut out = [0u8; PREFACE_LEN];
        out[..8].copy_from_slice(&MAGIC);
        out[8..10].copy_from_slice(&self.version.to_be_bytes());
        out[10..12].copy_from_slice(&self.flags.to_be_bytes());
        out[16..48].copy_from_slice(&self.nonce);
        out
    }

    /// Decodes and checks a preface: magic, version, known flags, zero reserved bits.
    pub fn decode(bytes: &[u8; PREFACE_LEN]) -> Result<Self> {
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&bytes[..8]);
        if magic != MAGIC {
            return Err(TcpError::BadMagic {
                got: magic,
                expected: MAGIC,
            });
        }
        let version = u16::from_be_bytes([bytes[8], bytes[9]]);
        if version != VERSION {
            return Err(TcpError::UnsupportedVersion {
                got: version,
                supported: VERSION,
            });
        }
        let flags = u16::from_be_bytes([bytes[10], bytes[11]]);
        if flags & !FLAG_SECRET != 0 {
            return Err(TcpError::ReservedNotZero {
                field: "preface flags (unknown bits)",
                value: u64::from(flags),
            });
        }
        let reserved = u32::from_be_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
        if reserved != 0 {
            return Err(TcpError::ReservedNotZero {
                field: "preface reserved word",
                value: u64::from(reserved),
            });
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&bytes[16..48]);
        Ok(Self {
            version,
            flags,
            nonce,
        })
    }
}

/// Frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameType {
    /// Client → listener after the prefaces: session, connection index, proof of the secret.
    Hello = 1,
    /// Listener → client: accepted, with the listener's proof of the secret.
    Welcome = 2,
    /// Either way: a fatal error with a code and a message; the connection closes after it.
    Error = 3,
    /// Either way: keep-alive and probe request.
    Ping = 4,
    /// Either way: the answer to a ping.
    Pong = 5,
    /// Client → listener: a batch starts (its deadline, size, notification, remote regions).
    Begin = 6,
    /// Listener → client: the batch is accepted or refused, with the lengths of its regions.
    BeginAck = 7,
    /// Client → listener: write descriptors; their payload follows the frame.
    Data = 8,
    /// Listener → client: every byte of the batch is in memory and its notification is queued.
    Done = 9,
    /// Client → listener: drop the rest of a batch.
    Cancel = 10,
    /// Listener → client: no byte of the batch is applied after this on this connection.
    CancelAck = 11,
    /// Listener → client: entries of its region table (at connect, and when regions change).
    Regions = 12,
    /// Client → listener: strided write descriptors (rows at a stride); their payload, row
    /// after row, follows the frame.
    Rows = 13,
}

impl FrameType {
    /// The type for a byte, if known.
    pub fn from_u8(ty: u8) -> Option<Self> {
        Some(match ty {
            1 => Self::Hello,
            2 => Self::Welcome,
            3 => Self::Error,
            4 => Self::Ping,
            5 => Self::Pong,
            6 => Self::Begin,
            7 => Self::BeginAck,
            8 => Self::Data,
            9 => Self::Done,
            10 => Self::Cancel,
            11 => Self::CancelAck,
            12 => Self::Regions,
            13 => Self::Rows,
            _ => return None,
        })
    }

    /// The type's name, for errors.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hello => "Hello",
            Self::Welcome => "Welcome",
            Self::Error => "Error",
            Self::Ping => "Ping",
            Self::Pong => "Pong",
            Self::Begin => "Begin",
            Self::BeginAck => "BeginAck",
            Self::Data => "Data",
            Self::Done => "Done",
            Self::Cancel => "Cancel",
            Self::CancelAck => "CancelAck",
            Self::Regions => "Regions",
            Self::Rows => "Rows",
        }
    }
}

/// One write descriptor: `len` payload bytes go to `region[offset..offset + len]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireOp {
    /// The receiver's region id.
    pub region: u64,
    /// Offset in that region.
    pub offset: u64,
    /// Payload bytes for this descriptor.
    pub len: u64,
}

/// One strided write descriptor: `rows` rows of `len` payload bytes, row `i` going to
/// `region[offset + i * stride..][..len]`. A [`WireOp`] is one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireRows {
    /// The receiver's region id.
    pub region: u64,
    /// Offset of the first row in that region.
    pub offset: u64,
    /// Payload bytes per row.
    pub len: u64,
    /// Number of rows (zero moves nothing).
    pub rows: u64,
    /// Distance between the starts of consecutive rows in the region.
    pub stride: u64,
}

impl WireRows {
    /// Payload bytes of all rows ([`decode_body`] checked that this does not overflow).
    pub fn total(&self) -> u64 {
        self.len.saturating_mul(self.rows)
    }

    /// Whether the rows are adjacent in the region (one range), or there is only one.
    pub fn is_contiguous(&self) -> bool {
        self.rows <= 1 || self.stride == self.len
    }
}

impl From<WireOp> for WireRows {
    fn from(op: WireOp) -> Self {
        Self {
            region: op.region,
            offset: op.offset,
            len: op.len,
            rows: 1,
            stride: op.len,
        }
    }
}

/// A region a batch will write, and the end of the furthest byte it writes there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionNeed {
    /// The receiver's region id.
    pub region: u64,
    /// One past the last byte written (`u64::MAX` when a descriptor's end overflowed).
    pub end: u64,
}

/// A region's length as the receiver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionLen {
    /// The receiver's region id.
    pub region: u64,
    /// Its length, or `None` when it is not registered.
    pub len: Option<u64>,
}

/// Whether the receiver accepted a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BeginStatus {
    /// Accepted: data may follow.
    Accepted = 0,
    /// A region is unknown or too short (see the lengths).
    RegionRefused = 1,
    /// The receiver has too many batches in flight from this peer.
    Busy = 2,
}

/// What a cancel found on the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelStatus {
    /// The batch was pending; the rest of it is dropped.
    Dropped = 0,
    /// The batch is not pending: it already completed (its `Done` is on the way).
    NotPending = 1,
}

/// A decoded frame (without a `Data` frame's payload, which follows it on the stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// See [`FrameType::Hello`].
    Hello {
        /// Random id grouping the connections of one outbound peer.
        session: u64,
        /// Index of this connection in the session.
        conn_index: u16,
        /// Number of connections in the session.
        conn_count: u16,
        /// The client's keep-alive interval in milliseconds.
        keepalive_ms: u32,
        /// HMAC proof of the secret, when one is configured.
        mac: Option<[u8; MAC_LEN]>,
    },
    /// See [`FrameType::Welcome`].
    Welcome {
        /// HMAC proof of the secret, when one is configured.
        mac: Option<[u8; MAC_LEN]>,
    },
    /// See [`FrameType::Error`].
    Error {
        /// Error code ([`TcpError::code`]).
        code: u16,
        /// Human-readable reason.
        message: String,
    },
    /// See [`FrameType::Ping`].
    Ping {
        /// Echoed in the pong.
        nonce: u64,
    },
    /// See [`FrameType::Pong`].
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// See [`FrameType::Begin`].
    Begin {
        /// Batch id (the sender's).
        batch: u64,
        /// The time reference of `remaining_ms`: 0 for the `Welcome` of connection 0, otherwise
        /// the nonce of a `Pong` the listener sent on this session.
        epoch: u64,
        /// Milliseconds from the epoch's frame (as the sender received it) to the deadline.
        remaining_ms: u64,
        /// Payload bytes the batch will send in total.
        total_bytes: u64,
        /// Regions it writes and how far.
        regions: Vec<RegionNeed>,
        /// Delivered after the data.
        notification: Option<Bytes>,
        /// Answer with a `BeginAck` even when accepted (otherwise only a refusal is answered,
        /// and the batch's data follows without waiting).
        ack: bool,
    },
    /// See [`FrameType::BeginAck`].
    BeginAck {
        /// Batch id.
        batch: u64,
        /// Accepted or why not.
        status: BeginStatus,
        /// Lengths of the regions named in the `Begin`.
        regions: Vec<RegionLen>,
    },
    /// See [`FrameType::Data`].
    Data {
        /// Batch id.
        batch: u64,
        /// Descriptors, in payload order.
        ops: Vec<WireOp>,
    },
    /// See [`FrameType::Rows`].
    Rows {
        /// Batch id.
        batch: u64,
        /// Descriptors, in payload order.
        ops: Vec<WireRows>,
    },
    /// See [`FrameType::Done`].
    Done {
        /// Batch id.
        batch: u64,
    },
    /// See [`FrameType::Cancel`].
    Cancel {
        /// Batch id.
        batch: u64,
    },
    /// See [`FrameType::CancelAck`].
    CancelAck {
        /// Batch id.
        batch: u64,
        /// What the cancel found.
        status: CancelStatus,
    },
    /// See [`FrameType::Regions`].
    Regions {
        /// The last frame of the table sent at connect (every later announcement sets it too).
        last: bool,
        /// Regions and their lengths; `None` means deregistered.
        regions: Vec<RegionLen>,
    },
}

impl Frame {
    /// The frame's type.
    pub fn frame_type(&self) -> FrameType {
        match self {
            Frame::Hello { .. } => FrameType::Hello,
            Frame::Welcome { .. } => FrameType::Welcome,
            Frame::Error { .. } => FrameType::Error,
            Frame::Ping { .. } => FrameType::Ping,
            Frame::Pong { .. } => FrameType::Pong,
            Frame::Begin { .. } => FrameType::Begin,
            Frame::BeginAck { .. } => FrameType::BeginAck,
            Frame::Data { .. } => FrameType::Data,
            Frame::Done { .. } => FrameType::Done,
            Frame::Cancel { .. } => FrameType::Cancel,
            Frame::CancelAck { .. } => FrameType::CancelAck,
            Frame::Regions { .. } => FrameType::Regions,
            Frame::Rows { .. } => FrameType::Rows,
        }
    }

    /// Payload bytes that follow this frame on the stream (non-zero only for `Data` and
    /// `Rows`). Decoded frames never overflow here: [`decode_body`] checked the sum.
    pub fn payload_len(&self) -> u64 {
        match self {
            Frame::Data { ops, .. } => ops.iter().fold(0u64, |a, op| a.saturating_add(op.len)),
            Frame::Rows { ops, .. } => ops.iter().fold(0u64, |a, op| a.saturating_add(op.total())),
            _ => 0,
        }
    }

    /// Encodes the frame: header and body (for `Data`, the caller writes the payload after it).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len_hint());
        self.encode_into(&mut out);
        out
    }

    /// About the encoded length (header and body, exact for the frames of a small batch), so
    /// a buffer sized by it is allocated once.
    pub fn encoded_len_hint(&self) -> usize {
        HEADER_LEN
            + match self {
                Frame::Begin {
                    regions,
                    notification,
                    ..
                } => {
                    BEGIN_FIXED as usize
                        + 16 * regions.len()
                        + notification.as_ref().map_or(0, |n| n.len())
                }
                Frame::BeginAck { regions, .. } | Frame::Regions { regions, .. } => {
                    13 + 16 * regions.len()
                }
                Frame::Error { message, .. } => 2 + message.len().min(MAX_ERROR_TEXT),
                Frame::Data { ops, .. } => 12 + ops.len() * OP_LEN,
                Frame::Rows { ops, .. } => 12 + ops.len() * ROWS_OP_LEN,
                _ => 64,
            }
    }

    /// Appends the encoded frame to `out` (see [`encode`](Self::encode)): the body is written
    /// in place after a header whose length is filled in at the end, nothing is copied twice.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0u8; HEADER_LEN]);
        let body = &mut *out;
        match self {
            Frame::Hello {
                session,
                conn_index,
                conn_count,
                keepalive_ms,
                mac,
            } => {
                body.extend_from_slice(&session.to_be_bytes());
                body.extend_from_slice(&conn_index.to_be_bytes());
                body.extend_from_slice(&conn_count.to_be_bytes());
                body.extend_from_slice(&keepalive_ms.to_be_bytes());
                put_mac(body, mac);
            }
            Frame::Welcome { mac } => put_mac(body, mac),
            Frame::Error { code, message } => {
                body.extend_from_slice(&code.to_be_bytes());
                body.extend_from_slice(truncate_utf8(message, MAX_ERROR_TEXT).as_bytes());
            }
            Frame::Ping { nonce } | Frame::Pong { nonce } => {
                body.extend_from_slice(&nonce.to_be_bytes())
            }
            Frame::Begin {
                batch,
                epoch,
                remaining_ms,
                total_bytes,
                regions,
                notification,
                ack,
            } => {
                body.extend_from_slice(&batch.to_be_bytes());
                body.extend_from_slice(&epoch.to_be_bytes());
                body.extend_from_slice(&remaining_ms.to_be_bytes());
                body.extend_from_slice(&total_bytes.to_be_bytes());
                body.extend_from_slice(&(regions.len() as u32).to_be_bytes());
                body.push(u8::from(notification.is_some()));
                body.push(u8::from(*ack));
                for r in regions {
                    body.extend_from_slice(&r.region.to_be_bytes());
                    body.extend_from_slice(&r.end.to_be_bytes());
                }
                if let Some(n) = notification {
                    body.extend_from_slice(n);
                }
            }
            Frame::BeginAck {
                batch,
                status,
                regions,
            } => {
                body.extend_from_slice(&batch.to_be_bytes());
                body.push(*status as u8);
                put_region_lens(body, regions);
            }
            Frame::Data { batch, ops } => {
                out.truncate(start);
                out.extend_from_slice(&encode_data_header(*batch, ops));
                return;
            }
            Frame::Rows { batch, ops } => {
                out.truncate(start);
                out.extend_from_slice(&encode_rows_header(*batch, ops));
                return;
            }
            Frame::Done { batch } | Frame::Cancel { batch } => {
                body.extend_from_slice(&batch.to_be_bytes())
            }
            Frame::CancelAck { batch, status } => {
                body.extend_from_slice(&batch.to_be_bytes());
                body.push(*status as u8);
            }
            Frame::Regions { last, regions } => {
                body.push(u8::from(*last));
                put_region_lens(body, regions);
            }
        }
        let body_len = (out.len() - start - HEADER_LEN) as u32;
        out[start..start + HEADER_LEN].copy_from_slice(&encode_header(self.frame_type(), body_len));
    }
}

/// A count and the (region, len or `u64::MAX`) pairs of `BeginAck` and `Regions`.
fn put_region_lens(body: &mut Vec<u8>, regions: &[RegionLen]) {
    body.extend_from_slice(&(regions.len() as u32).to_be_bytes());
    for r in regions {
        body.extend_from_slice(&r.region.to_be_bytes());
        body.extend_from_slice(&r.len.unwrap_or(u64::MAX).to_be_bytes());
    }
}

fn put_mac(body: &mut Vec<u8>, mac: &Option<[u8; MAC_LEN]>) {
    match mac {
        Some(m) => {
            body.push(1);
            body.extend_from_slice(m);
        }
        None => body.push(0),
    }
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Encodes a frame header.
pub fn encode_header(ty: FrameType, body_len: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0] = ty as u8;
    h[4..8].copy_from_slice(&body_len.to_be_bytes());
    h
}

/// Encodes a `Data` frame's header and descriptors; the payload follows on the stream.
pub fn encode_data_header(batch: u64, ops: &[WireOp]) -> Vec<u8> {
    let body_len = 12 + ops.len() * OP_LEN;
    let mut out = Vec::with_capacity(HEADER_LEN + body_len);
    out.extend_from_slice(&encode_header(FrameType::Data, body_len as u32));
    out.extend_from_slice(&batch.to_be_bytes());
    out.extend_from_slice(&(ops.len() as u32).to_be_bytes());
    for op in ops {
        out.extend_from_slice(&op.region.to_be_bytes());
        out.extend_from_slice(&op.offset.to_be_bytes());
        out.extend_from_slice(&op.len.to_be_bytes());
    }
    out
}

/// Encodes a `Rows` frame's header and descriptors; the payload (row after row) follows on
/// the stream.
pub fn encode_rows_header(batch: u64, ops: &[WireRows]) -> Vec<u8> {
    let body_len = 12 + ops.len() * ROWS_OP_LEN;
    let mut out = Vec::with_capacity(HEADER_LEN + body_len);
    out.extend_from_slice(&encode_header(FrameType::Rows, body_len as u32));
    out.extend_from_slice(&batch.to_be_bytes());
    out.extend_from_slice(&(ops.len() as u32).to_be_bytes());
    for op in ops {
        for v in [op.region, op.offset, op.len, op.rows, op.stride] {
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
    out
}

/// Decodes and checks a frame header against `max_body` (the configured frame limit).
pub fn decode_header(h: &[u8; HEADER_LEN], max_body: u32) -> Result<(FrameType, u32)> {
    let ty = FrameType::from_u8(h[0]).ok_or(TcpError::UnknownFrameType { ty: h[0] })?;
    if h[1] != 0 {
        return Err(TcpError::ReservedNotZero {
            field: "frame flags",
            value: u64::from(h[1]),
        });
    }
    let reserved = u16::from_be_bytes([h[2], h[3]]);
    if reserved != 0 {
        return Err(TcpError::ReservedNotZero {
            field: "frame reserved bits",
            value: u64::from(reserved),
        });
    }
    let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
    if len > max_body.min(WIRE_MAX_FRAME_LEN) {
        return Err(TcpError::FrameTooLarge {
            kind: ty.name(),
            len: u64::from(len),
            max: u64::from(max_body.min(WIRE_MAX_FRAME_LEN)),
        });
    }
    Ok((ty, len))
}

/// Reads big-endian fields off a body whose total length has already been checked.
struct Fields<'a> {
    buf: &'a [u8],
    kind: &'static str,
}

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(TcpError::BadLength {
                kind: self.kind,
                need: n as u64,
                got: self.buf.len() as u64,
            });
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
    fn mac(&mut self) -> Result<Option<[u8; MAC_LEN]>> {
        match self.u8()? {
            0 => Ok(None),
            1 => {
                let mut m = [0u8; MAC_LEN];
                m.copy_from_slice(self.take(MAC_LEN)?);
                Ok(Some(m))
            }
            other => Err(TcpError::ReservedNotZero {
                field: "mac presence byte (must be 0 or 1)",
                value: u64::from(other),
            }),
        }
    }
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
    /// The body must be fully consumed.
    fn end(&self, need: u64) -> Result<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(TcpError::BadLength {
                kind: self.kind,
                need,
                got: need + self.buf.len() as u64,
            })
        }
    }
}

/// Checks that a body is exactly `fixed + count * each` bytes, with overflow checks, so a
/// claimed count never sizes an allocation beyond the body that is already in memory.
fn check_counted(kind: &'static str, body: usize, fixed: u64, count: u32, each: u64) -> Result<()> {
    let need = u64::from(count)
        .checked_mul(each)
        .and_then(|v| v.checked_add(fixed))
        .ok_or(TcpError::LengthOverflow {
            what: "descriptor table length",
            a: u64::from(count),
            b: each,
        })?;
    if need != body as u64 {
        return Err(TcpError::BadLength {
            kind,
            need,
            got: body as u64,
        });
    }
    Ok(())
}

/// The batch and descriptor count of a `Data` or `Rows` body, the count checked against the
/// body length (descriptors of `each` bytes) and at least 1.
fn descriptor_table(
    f: &mut Fields<'_>,
    kind: &'static str,
    body: usize,
    each: usize,
) -> Result<(u64, u32)> {
    let batch = f.u64()?;
    let count = f.u32()?;
    check_counted(kind, body, 12, count, each as u64)?;
    if count == 0 {
        return Err(TcpError::BadLength {
            kind,
            need: 12 + each as u64,
            got: body as u64,
        });
    }
    Ok((batch, count))
}

/// `count` (region, len) pairs, the count already checked against the body length.
fn region_lens(f: &mut Fields<'_>, count: u32) -> Result<Vec<RegionLen>> {
    let mut regions = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let region = f.u64()?;
        let len = f.u64()?;
        regions.push(RegionLen {
            region,
            len: (len != u64::MAX).then_some(len),
        });
    }
    Ok(regions)
}

/// Decodes a frame body of type `ty` (its length already checked by [`decode_header`]).
pub fn decode_body(ty: FrameType, body: &[u8]) -> Result<Frame> {
    let kind = ty.name();
    let mut f = Fields { buf: body, kind };
    let frame = match ty {
        FrameType::Hello => decode_hello(&mut f, body.len())?,
        FrameType::Welcome => {
            let mac = f.mac()?;
            f.end(body.len() as u64 - f.buf.len() as u64)?;
            Frame::Welcome { mac }
        }
        FrameType::Error => {
            let code = f.u16()?;
            let text = f.rest();
            let message = std::str::from_utf8(text)
                .map_err(|_| TcpError::BadText { kind })?
                .to_owned();
            Frame::Error { code, message }
        }
        FrameType::Ping | FrameType::Pong | FrameType::Done | FrameType::Cancel => {
            let v = f.u64()?;
            f.end(8)?;
            match ty {
                FrameType::Ping => Frame::Ping { nonce: v },
                FrameType::Pong => Frame::Pong { nonce: v },
                FrameType::Done => Frame::Done { batch: v },
                _ => Frame::Cancel { batch: v },
            }
        }
        FrameType::CancelAck => {
            let batch = f.u64()?;
            let status = match f.u8()? {
                0 => CancelStatus::Dropped,
                1 => CancelStatus::NotPending,
                other => {
                    return Err(TcpError::ReservedNotZero {
                        field: "CancelAck status (must be 0 or 1)",
                        value: u64::from(other),
                    });
                }
            };
            f.end(9)?;
            Frame::CancelAck { batch, status }
        }
        FrameType::Begin => decode_begin(&mut f, kind, body.len())?,
        FrameType::Regions => {
            let last = match f.u8()? {
                0 => false,
                1 => true,
                other => {
                    return Err(TcpError::ReservedNotZero {
                        field: "Regions last byte (must be 0 or 1)",
                        value: u64::from(other),
                    });
                }
            };
            let count = f.u32()?;
            check_counted(kind, body.len(), 5, count, 16)?;
            let regions = region_lens(&mut f, count)?;
            Frame::Regions { last, regions }
        }
        FrameType::BeginAck => {
            let batch = f.u64()?;
            let status = match f.u8()? {
                0 => BeginStatus::Accepted,
                1 => BeginStatus::RegionRefused,
                2 => BeginStatus::Busy,
                other => {
                    return Err(TcpError::ReservedNotZero {
                        field: "BeginAck status (must be 0, 1 or 2)",
                        value: u64::from(other),
                    });
                }
            };
            let count = f.u32()?;
            check_counted(kind, body.len(), 13, count, 16)?;
            let regions = region_lens(&mut f, count)?;
            Frame::BeginAck {
                batch,
                status,
                regions,
            }
        }
        FrameType::Data => decode_data(&mut f, kind, body.len())?,
        FrameType::Rows => decode_rows(&mut f, kind, body.len())?,
    };
    Ok(frame)
}

/// The body of a `Hello` frame, its connection index and count checked.
fn decode_hello(f: &mut Fields<'_>, body_len: usize) -> Result<Frame> {
    let session = f.u64()?;
    let conn_index = f.u16()?;
    let conn_count = f.u16()?;
    let keepalive_ms = f.u32()?;
    let mac = f.mac()?;
    f.end(body_len as u64 - f.buf.len() as u64)?;
    if !(1..=MAX_CONNECTIONS).contains(&conn_count) {
        return Err(TcpError::ReservedNotZero {
            field: "Hello connection count (must be 1..=16)",
            value: u64::from(conn_count),
        });
    }
    if conn_index >= conn_count {
        return Err(TcpError::ReservedNotZero {
            field: "Hello connection index (must be below the count)",
            value: u64::from(conn_index),
        });
    }
    Ok(Frame::Hello {
        session,
        conn_index,
        conn_count,
        keepalive_ms,
        mac,
    })
}

/// The body of a `Begin` frame after its kind.
fn decode_begin(f: &mut Fields<'_>, kind: &'static str, body_len: usize) -> Result<Frame> {
    let batch = f.u64()?;
    let epoch = f.u64()?;
    let remaining_ms = f.u64()?;
    let total_bytes = f.u64()?;
    let count = f.u32()?;
    let has_notification = f.u8()?;
    if has_notification > 1 {
        return Err(TcpError::ReservedNotZero {
            field: "Begin notification presence byte (must be 0 or 1)",
            value: u64::from(has_notification),
        });
    }
    let ack = f.u8()?;
    if ack > 1 {
        return Err(TcpError::ReservedNotZero {
            field: "Begin acknowledgement byte (must be 0 or 1)",
            value: u64::from(ack),
        });
    }
    let table = u64::from(count)
        .checked_mul(16)
        .ok_or(TcpError::LengthOverflow {
            what: "region table length",
            a: u64::from(count),
            b: 16,
        })?;
    if table > f.buf.len() as u64 {
        return Err(TcpError::BadLength {
            kind,
            need: BEGIN_FIXED + table,
            got: body_len as u64,
        });
    }
    let mut regions = Vec::with_capacity(count as usize);
    for _ in 0..count {
        regions.push(RegionNeed {
            region: f.u64()?,
            end: f.u64()?,
        });
    }
    let notification = if has_notification == 1 {
        Some(Bytes::copy_from_slice(f.rest()))
    } else {
        f.end(BEGIN_FIXED + table)?;
        None
    };
    Ok(Frame::Begin {
        batch,
        epoch,
        remaining_ms,
        total_bytes,
        regions,
        notification,
        ack: ack == 1,
    })
}

/// The descriptors of a `Data` frame, each range and their sum checked for overflow.
fn decode_data(f: &mut Fields<'_>, kind: &'static str, body_len: usize) -> Result<Frame> {
    let (batch, count) = descriptor_table(f, kind, body_len, OP_LEN)?;
    let mut ops = Vec::with_capacity(count as usize);
    let mut total = 0u64;
    for _ in 0..count {
        let op = WireOp {
            region: f.u64()?,
            offset: f.u64()?,
            len: f.u64()?,
        };
        op.offset
            .checked_add(op.len)
            .ok_or(TcpError::LengthOverflow {
                what: "descriptor offset + len",
                a: op.offset,
                b: op.len,
            })?;
        total = total.checked_add(op.len).ok_or(TcpError::LengthOverflow {
            what: "Data frame payload length",
            a: total,
            b: op.len,
        })?;
        ops.push(op);
    }
    Ok(Frame::Data { batch, ops })
}

/// The descriptors of a `Rows` frame, each strided range and their sum checked for overflow.
fn decode_rows(f: &mut Fields<'_>, kind: &'static str, body_len: usize) -> Result<Frame> {
    let (batch, count) = descriptor_table(f, kind, body_len, ROWS_OP_LEN)?;
    // Only the descriptors are allocated (bounded by the body); rows are never
    // materialised, whatever count a descriptor claims.
    let mut ops = Vec::with_capacity(count as usize);
    let mut total = 0u64;
    for _ in 0..count {
        let op = WireRows {
            region: f.u64()?,
            offset: f.u64()?,
            len: f.u64()?,
            rows: f.u64()?,
            stride: f.u64()?,
        };
        kvbridge_transport::memory::rows_end(op.offset, op.stride, op.len, op.rows).ok_or(
            TcpError::LengthOverflow {
                what: "Rows descriptor offset + (rows - 1) * stride + len",
                a: op.offset,
                b: op.rows,
            },
        )?;
        let bytes = op
            .len
            .checked_mul(op.rows)
            .ok_or(TcpError::LengthOverflow {
                what: "Rows descriptor len * rows",
                a: op.len,
                b: op.rows,
            })?;
        total = total.checked_add(bytes).ok_or(TcpError::LengthOverflow {
            what: "Rows frame payload length",
            a: total,
            b: bytes,
        })?;
        ops.push(op);
    }
    Ok(Frame::Rows { batch, ops })
}

/// Result of [`decode_frame`] over a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// The buffer holds less than one frame; at least this many bytes in total are needed.
    NeedMore(usize),
    /// One frame, and how many bytes of the buffer it used (header and body; a `Data` frame's
    /// payload follows and is not counted).
    Frame(Frame, usize),
}

/// Decodes the frame at the start of `buf`, sans IO. Never panics; never asks for more than
/// `HEADER_LEN + max_body` bytes.
pub fn decode_frame(buf: &[u8], max_body: u32) -> Result<Decoded> {
    let Some(h) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(Decoded::NeedMore(HEADER_LEN));
    };
    let (ty, len) = decode_header(h, max_body)?;
    let end = HEADER_LEN + len as usize;
    if buf.len() < end {
        return Ok(Decoded::NeedMore(end));
    }
    let frame = decode_body(ty, &buf[HEADER_LEN..end])?;
    Ok(Decoded::Frame(frame, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(frame: Frame) {
        let bytes = frame.encode();
        match decode_frame(&bytes, 1 << 20).unwrap() {
            Decoded::Frame(got, used) => {
                assert_eq!(got, frame);
                assert_eq!(used, bytes.len());
            }
            other => panic!("expected a frame, got {other:?}"),
        }
        // Every strict prefix asks for more and never errors.
        for cut in 0..bytes.len() {
            match decode_frame(&bytes[..cut], 1 << 20).unwrap() {
                Decoded::NeedMore(n) => assert!(n > cut && n <= bytes.len()),
                other => panic!("prefix of {cut} bytes decoded as {other:?}"),
            }
        }
    }

    #[test]
    fn every_frame_round_trips() {
        round_trip(Frame::Hello {
            session: 7,
            conn_index: 1,
            conn_count: 2,
            keepalive_ms: 1000,
            mac: Some([9; 32]),
        });
        round_trip(Frame::Hello {
            session: 7,
            conn_index: 0,
            conn_count: 1,
            keepalive_ms: 5,
            mac: None,
        });
        round_trip(Frame::Welcome { mac: None });
        round_trip(Frame::Welcome { mac: Some([1; 32]) });
        round_trip(Frame::Error {
            code: 11,
            message: "wrong secret".into(),
        });
        round_trip(Frame::Ping { nonce: 1 });
        round_trip(Frame::Pong { nonce: u64::MAX });
        round_trip(Frame::Begin {
            batch: 3,
            epoch: 0,
            remaining_ms: 100,
            total_bytes: 1 << 40,
            regions: vec![RegionNeed { region: 1, end: 10 }],
            notification: Some(Bytes::from_static(b"room 1")),
            ack: false,
        });
        round_trip(Frame::Begin {
            batch: 3,
            epoch: 9,
            remaining_ms: 100,
            total_bytes: 0,
            regions: vec![],
            notification: None,
            ack: true,
        });
        round_trip(Frame::Regions {
            last: true,
            regions: vec![
                RegionLen {
                    region: 1,
                    len: Some(4096),
                },
                RegionLen {
                    region: 2,
                    len: None,
                },
            ],
        });
        round_trip(Frame::Regions {
            last: false,
            regions: vec![],
        });
        round_trip(Frame::BeginAck {
            batch: 3,
            status: BeginStatus::RegionRefused,
            regions: vec![
                RegionLen {
                    region: 1,
                    len: Some(4),
                },
                RegionLen {
                    region: 2,
                    len: None,
                },
            ],
        });
        round_trip(Frame::Data {
            batch: 9,
            ops: vec![
                WireOp {
                    region: 1,
                    offset: 0,
                    len: 5,
                },
                WireOp {
                    region: 2,
                    offset: 8,
                    len: 3,
                },
            ],
        });
        round_trip(Frame::Rows {
            batch: 2,
            ops: vec![
                WireRows {
                    region: 1,
                    offset: 64,
                    len: 1152,
                    rows: 64,
                    stride: 4608,
                },
                WireRows {
                    region: 2,
                    offset: 0,
                    len: 0,
                    rows: 0,
                    stride: 0,
                },
            ],
        });
        round_trip(Frame::Done { batch: 2 });
        round_trip(Frame::Cancel { batch: 2 });
        round_trip(Frame::CancelAck {
            batch: 2,
            status: CancelStatus::NotPending,
        });
    }

    #[test]
    fn rows_descriptors_that_overflow_are_refused() {
        let rows = |offset, len, rows, stride| Frame::Rows {
            batch: 1,
            ops: vec![WireRows {
                region: 1,
                offset,
                len,
                rows,
                stride,
            }],
        };
        for bad in [
            // The last row starts past 2^64.
            rows(8, 4, 2, u64::MAX),
            // Its end does.
            rows(u64::MAX - 8, 16, 1, 16),
            // Its byte count does (at stride 0 the rows' span does not; overlap is the
            // receiver's check).
            rows(0, 1 << 40, 1 << 30, 0),
        ] {
            assert!(
                matches!(
                    decode_frame(&bad.encode(), 1 << 20),
                    Err(TcpError::LengthOverflow { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn preface_checks_magic_version_and_reserved_bits() {
        let p = Preface {
            version: VERSION,
            flags: FLAG_SECRET,
            nonce: [5; 32],
        };
        let bytes = p.encode();
        assert_eq!(Preface::decode(&bytes).unwrap(), p);
        let mut bad = bytes;
        bad[0] = b'X';
        assert!(matches!(
            Preface::decode(&bad),
            Err(TcpError::BadMagic { .. })
        ));
        let mut bad = bytes;
        // Version 2 had no `Rows` frame: a peer of that version is refused at the preface.
        bad[9] = 2;
        assert_eq!(
            Preface::decode(&bad),
            Err(TcpError::UnsupportedVersion {
                got: 2,
                supported: VERSION
            })
        );
        let mut bad = bytes;
        bad[11] |= 4;
        assert!(matches!(
            Preface::decode(&bad),
            Err(TcpError::ReservedNotZero { .. })
        ));
        let mut bad = bytes;
        bad[14] = 1;
        assert!(matches!(
            Preface::decode(&bad),
            Err(TcpError::ReservedNotZero { .. })
        ));
    }

    #[test]
    fn header_limits_unknown_types_and_reserved_bits() {
        let h = encode_header(FrameType::Data, 2000);
        assert_eq!(
            decode_header(&h, 1000),
            Err(TcpError::FrameTooLarge {
                kind: "Data",
                len: 2000,
                max: 1000
            })
        );
        let mut h = encode_header(FrameType::Ping, 8);
        h[0] = 0xEE;
        assert_eq!(
            decode_header(&h, 1000),
            Err(TcpError::UnknownFrameType { ty: 0xEE })
        );
        let mut h = encode_header(FrameType::Ping, 8);
        h[1] = 1;
        assert!(matches!(
            decode_header(&h, 1000),
            Err(TcpError::ReservedNotZero { .. })
        ));
        // A frame longer than the wire cap is refused even if the caller's limit is higher.
        let h = encode_header(FrameType::Data, WIRE_MAX_FRAME_LEN + 1);
        assert!(matches!(
            decode_header(&h, u32::MAX),
            Err(TcpError::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn data_frames_reject_overflow_and_count_mismatch() {
        let op = |offset, len| WireOp {
            region: 1,
            offset,
            len,
        };
        let bytes = Frame::Data {
            batch: 1,
            ops: vec![op(u64::MAX - 1, 5)],
        }
        .encode();
        assert!(matches!(
            decode_frame(&bytes, 1 << 20),
            Err(TcpError::LengthOverflow { .. })
        ));
        let bytes = Frame::Data {
            batch: 1,
            ops: vec![op(0, u64::MAX), op(0, 1)],
        }
        .encode();
        assert!(matches!(
            decode_frame(&bytes, 1 << 20),
            Err(TcpError::LengthOverflow { .. })
        ));
        // A count claiming 4 billion descriptors in a 36-byte body is a length error, and
        // nothing is allocated for the claim.
        let mut bytes = Frame::Data {
            batch: 1,
            ops: vec![op(0, 1)],
        }
        .encode();
        bytes[16..20].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            decode_frame(&bytes, 1 << 20),
            Err(TcpError::BadLength { .. })
        ));
        // Zero descriptors is refused.
        let mut bytes = encode_data_header(1, &[]);
        bytes.truncate(HEADER_LEN + 12);
        assert!(matches!(
            decode_frame(&bytes, 1 << 20),
            Err(TcpError::BadLength { .. })
        ));
    }

    #[test]
    fn begin_with_huge_region_count_is_a_length_error() {
        let mut bytes = Frame::Begin {
            batch: 1,
            epoch: 0,
            remaining_ms: 1,
            total_bytes: 1,
            regions: vec![RegionNeed { region: 1, end: 1 }],
            notification: None,
            ack: true,
        }
        .encode();
        // Region count lives at body offset 32.
        bytes[HEADER_LEN + 32..HEADER_LEN + 36].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            decode_frame(&bytes, 1 << 20),
            Err(TcpError::BadLength { .. })
        ));
    }
}
