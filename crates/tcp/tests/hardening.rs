//! Hostile and broken peers, played by raw sockets speaking the documented wire format
//! (`docs/tcp-protocol.md`): every case gets a clear error frame and a closed connection, never
//! a byte outside (or inside) a region it may not write, and the transport keeps serving
//! well-behaved peers afterwards. Also: keep-alive against a silent peer.

use std::time::Duration;

use hmac::{Hmac, Mac};
use kvbridge_tcp::wire::{
    self, FLAG_SECRET, Frame, Preface, RegionLen, RegionNeed, WireOp, WireRows,
};
use kvbridge_tcp::{TcpConfig, TcpTransport};
use kvbridge_transport::{
    KvTransport, KvTransportExt, MemoryRegion, RegionId, TransferBatch, TransferOp, TransportError,
};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const LIMIT: Duration = Duration::from_secs(5);
const SECRET: &[u8] = b"hardening secret";

/// A transport with one 4 KiB region filled with 0xAA.
async fn target(config: TcpConfig) -> (TcpTransport, RegionId, MemoryRegion) {
    let t = TcpTransport::bind(config).await.unwrap();
    let (id, mem) = t.allocate_registered(4096).await.unwrap();
    mem.fill(0, 4096, 0xAA).unwrap();
    (t, id, mem)
}

fn untouched(mem: &MemoryRegion) -> bool {
    mem.to_vec(0, mem.len() as u64)
        .unwrap()
        .iter()
        .all(|&b| b == 0xAA)
}

fn hmac(parts: &[&[u8]]) -> [u8; 32] {
    let mut m = Hmac::<Sha256>::new_from_slice(SECRET).unwrap();
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// A raw client: writes whatever the test says.
struct Raw {
    s: TcpStream,
    /// Bytes read but not yet decoded (several frames may arrive in one read).
    buf: Vec<u8>,
    /// The region table the listener sent after its `Welcome` (connection 0 only).
    table: Vec<RegionLen>,
}

impl Raw {
    /// Connects and sends `preface` (the server's preface is read and returned).
    async fn open(t: &TcpTransport, preface: [u8; 48]) -> (Self, [u8; 48]) {
        let mut s = TcpStream::connect(t.local_addr()).await.unwrap();
        s.write_all(&preface).await.unwrap();
        let mut theirs = [0u8; 48];
        s.read_exact(&mut theirs).await.unwrap();
        let raw = Self {
            s,
            buf: Vec::new(),
            table: Vec::new(),
        };
        (raw, theirs)
    }

    /// Sends a preface without a secret and then `hello` (any frame), as a client would.
    async fn hello(t: &TcpTransport, hello: Frame) -> Self {
        let mine = Preface {
            version: wire::VERSION,
            flags: 0,
            nonce: [6; 32],
        }
        .encode();
        let (mut raw, _) = Raw::open(t, mine).await;
        raw.send(&hello).await;
        raw
    }

    /// Completes a correct handshake (with the secret when `secret` is true).
    async fn handshake(t: &TcpTransport, secret: bool) -> Self {
        Self::handshake_as(t, secret, (42, 0, 1), 1000).await
    }

    /// [`handshake`](Self::handshake) as connection `index` of `count` of `session`,
    /// announcing a ping every `keepalive` ms.
    async fn handshake_as(
        t: &TcpTransport,
        secret: bool,
        (session, index, count): (u64, u16, u16),
        keepalive: u32,
    ) -> Self {
        let mine = Preface {
            version: wire::VERSION,
            flags: if secret { FLAG_SECRET } else { 0 },
            nonce: [7; 32],
        }
        .encode();
        let (mut raw, theirs) = Raw::open(t, mine).await;
        let mac = secret.then(|| {
            hmac(&[
                b"kvbridge-tcp/1 client",
                &mine,
                &theirs,
                &session.to_be_bytes(),
                &index.to_be_bytes(),
                &count.to_be_bytes(),
                &keepalive.to_be_bytes(),
            ])
        });
        raw.send(&Frame::Hello {
            session,
            conn_index: index,
            conn_count: count,
            keepalive_ms: keepalive,
            mac,
        })
        .await;
        match raw.frame().await {
            Some(Frame::Welcome { mac }) => {
                if secret {
                    let want = hmac(&[b"kvbridge-tcp/1 server", &mine, &theirs]);
                    assert_eq!(mac, Some(want), "the listener's proof of the secret");
                }
            }
            other => panic!("expected Welcome, got {other:?}"),
        }
        // Connection 0 gets the listener's region table next.
        let mut complete = index != 0;
        while !complete {
            match raw.frame().await {
                Some(Frame::Regions { last, regions }) => {
                    raw.table.extend(regions);
                    complete = last;
                }
                other => panic!("expected the region table, got {other:?}"),
            }
        }
        raw
    }

    async fn send(&mut self, f: &Frame) {
        self.bytes(&f.encode()).await;
    }

    async fn bytes(&mut self, b: &[u8]) {
        // The peer may already have closed; the test checks what it answered instead.
        let _ = self.s.write_all(b).await;
    }

    /// Reads the next frame, or `None` at end of stream.
    async fn frame(&mut self) -> Option<Frame> {
        let mut chunk = [0u8; 4096];
        loop {
            if let Ok(wire::Decoded::Frame(f, used)) = wire::decode_frame(&self.buf, 1 << 20) {
                self.buf.drain(..used);
                return Some(f);
            }
            let n = tokio::time::timeout(LIMIT, self.s.read(&mut chunk))
                .await
                .expect("the transport neither answered nor closed")
                .unwrap_or(0);
            if n == 0 {
                return None;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Expects an error frame with `code`, then the end of the stream.
    async fn expect_error(&mut self, code: u16) -> String {
        loop {
            match self.frame().await {
                Some(Frame::Error { code: got, message }) => {
                    assert_eq!(got, code, "error code (message: {message})");
                    assert!(self.frame().await.is_none(), "connection left open");
                    return message;
                }
                // Answers to frames sent before the bad one may come first.
                Some(Frame::BeginAck { .. } | Frame::Pong { .. } | Frame::Regions { .. }) => {}
                other => panic!("expected an Error frame with code {code}, got {other:?}"),
            }
        }
    }

    async fn begin(&mut self, batch: u64, region: RegionId, total: u64) {
        self.send(&Frame::Begin {
            batch,
            epoch: 0,
            remaining_ms: 10_000,
            total_bytes: total,
            regions: vec![RegionNeed {
                region: region.0,
                end: 4096,
            }],
            notification: None,
            ack: true,
        })
        .await;
        match self.frame().await {
            Some(Frame::BeginAck { status, .. }) => {
                assert_eq!(status, wire::BeginStatus::Accepted)
            }
            other => panic!("expected BeginAck, got {other:?}"),
        }
    }
}

/// The transport still serves a well-behaved peer, and `mem` was not written.
async fn still_serves(t: &TcpTransport, region: RegionId, mem: &MemoryRegion) {
    assert!(untouched(mem), "a refused peer changed the region");
    let good = TcpTransport::new().await.unwrap();
    let (src, src_mem) = good.allocate_registered(16).await.unwrap();
    src_mem.write_at(0, b"still serving ok").unwrap();
    let peer = good.connect(&t.local_descriptor()).await.unwrap();
    let op = TransferOp::new(src, 0, region, 100, 16);
    tokio::time::timeout(LIMIT, good.transfer(peer, TransferBatch::write(vec![op])))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(mem.to_vec(100, 16).unwrap(), b"still serving ok");
}

#[tokio::test]
async fn bad_magic_is_refused() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut junk = [b'G'; 48];
    junk[..4].copy_from_slice(b"GET ");
    let (mut raw, _) = Raw::open(&t, junk).await;
    let msg = raw.expect_error(1).await;
    assert!(msg.contains("magic"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn unsupported_version_is_refused() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut p = Preface {
        version: wire::VERSION,
        flags: 0,
        nonce: [1; 32],
    }
    .encode();
    p[8..10].copy_from_slice(&99u16.to_be_bytes());
    let (mut raw, _) = Raw::open(&t, p).await;
    let msg = raw.expect_error(2).await;
    assert!(msg.contains("version 99"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn missing_secret_is_refused() {
    let (t, _, mem) = target(TcpConfig::default().with_secret(SECRET.to_vec())).await;
    let p = Preface {
        version: wire::VERSION,
        flags: 0,
        nonce: [1; 32],
    }
    .encode();
    let (mut raw, theirs) = Raw::open(&t, p).await;
    assert_eq!(Preface::decode(&theirs).unwrap().flags, FLAG_SECRET);
    let msg = raw.expect_error(10).await;
    assert!(msg.contains("secret"), "{msg}");
    assert!(untouched(&mem));
}

#[tokio::test]
async fn wrong_secret_is_refused() {
    let (t, _, mem) = target(TcpConfig::default().with_secret(SECRET.to_vec())).await;
    let p = Preface {
        version: wire::VERSION,
        flags: FLAG_SECRET,
        nonce: [1; 32],
    }
    .encode();
    let (mut raw, _) = Raw::open(&t, p).await;
    raw.send(&Frame::Hello {
        session: 1,
        conn_index: 0,
        conn_count: 1,
        keepalive_ms: 1000,
        mac: Some([0x55; 32]),
    })
    .await;
    let msg = raw.expect_error(11).await;
    assert!(msg.contains("does not verify"), "{msg}");
    assert!(untouched(&mem));
}

#[tokio::test]
async fn transports_with_different_secrets_do_not_connect() {
    let server = TcpTransport::bind(TcpConfig::default().with_secret(b"one".to_vec()))
        .await
        .unwrap();
    let client = TcpTransport::bind(TcpConfig::default().with_secret(b"two".to_vec()))
        .await
        .unwrap();
    let e = client
        .connect(&server.local_descriptor())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("secret"), "{e}");
    let plain = TcpTransport::new().await.unwrap();
    let e = plain.connect(&server.local_descriptor()).await.unwrap_err();
    assert!(e.to_string().contains("secret"), "{e}");
    let e = client.connect(&plain.local_descriptor()).await.unwrap_err();
    assert!(e.to_string().contains("secret"), "{e}");
    // Same secret: fine.
    let same = TcpTransport::bind(TcpConfig::default().with_secret(b"one".to_vec()))
        .await
        .unwrap();
    let peer = same.connect(&server.local_descriptor()).await.unwrap();
    same.probe(peer, LIMIT).await.unwrap();
}

#[tokio::test]
async fn oversized_frame_is_refused_before_its_body() {
    let (t, region, mem) = target(TcpConfig::default().with_max_frame_len(4096)).await;
    let mut raw = Raw::handshake(&t, false).await;
    // Only the header: the transport must refuse without waiting for 4 GiB of body.
    raw.bytes(&wire::encode_header(wire::FrameType::Begin, u32::MAX))
        .await;
    let msg = raw.expect_error(3).await;
    assert!(msg.contains("4294967295"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn unknown_frame_type_is_refused() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    let mut h = wire::encode_header(wire::FrameType::Ping, 8);
    h[0] = 0x7F;
    raw.bytes(&h).await;
    raw.bytes(&[0; 8]).await;
    let msg = raw.expect_error(4).await;
    assert!(msg.contains("0x7f"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn truncated_frame_closes_the_connection() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    let bytes = Frame::Data {
        batch: 1,
        ops: vec![WireOp {
            region: region.0,
            offset: 0,
            len: 8,
        }],
    }
    .encode();
    raw.bytes(&bytes[..bytes.len() - 5]).await;
    raw.s.shutdown().await.unwrap();
    assert!(
        raw.frame().await.is_none(),
        "expected the connection closed"
    );
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn overflowing_lengths_are_refused() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    raw.begin(1, region, 5).await;
    raw.send(&Frame::Data {
        batch: 1,
        ops: vec![WireOp {
            region: region.0,
            offset: u64::MAX - 1,
            len: 5,
        }],
    })
    .await;
    raw.bytes(&[1; 5]).await;
    let msg = raw.expect_error(7).await;
    assert!(msg.contains("overflows"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn descriptor_count_larger_than_the_body_is_refused() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    let mut bytes = Frame::Data {
        batch: 1,
        ops: vec![WireOp {
            region: region.0,
            offset: 0,
            len: 1,
        }],
    }
    .encode();
    bytes[16..20].copy_from_slice(&u32::MAX.to_be_bytes());
    raw.bytes(&bytes).await;
    raw.expect_error(6).await;
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn unknown_region_is_refused() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    // A Begin naming it is answered with a refusal, not an error.
    raw.send(&Frame::Begin {
        batch: 1,
        epoch: 0,
        remaining_ms: 1000,
        total_bytes: 8,
        regions: vec![RegionNeed {
            region: 999,
            end: 8,
        }],
        notification: None,
        ack: true,
    })
    .await;
    match raw.frame().await {
        Some(Frame::BeginAck {
            status, regions, ..
        }) => {
            assert_eq!(status, wire::BeginStatus::RegionRefused);
            assert_eq!(regions[0].len, None);
        }
        other => panic!("expected BeginAck, got {other:?}"),
    }
    // Data aimed at it anyway closes the connection.
    raw.begin(2, region, 8).await;
    raw.send(&Frame::Data {
        batch: 2,
        ops: vec![WireOp {
            region: 999,
            offset: 0,
            len: 8,
        }],
    })
    .await;
    let msg = raw.expect_error(14).await;
    assert!(msg.contains("#999 which is not registered"), "{msg}");
    still_serves(&t, region, &mem).await;
}

/// Two descriptors of 100 bytes into a 4096-byte region: one in bounds, then one past its end.
fn straddling_ops(region: RegionId) -> Vec<WireOp> {
    [0, 4000]
        .map(|offset| WireOp {
            region: region.0,
            offset,
            len: 100,
        })
        .to_vec()
}

#[tokio::test]
async fn out_of_bounds_write_is_refused_before_its_payload() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    raw.begin(1, region, 200).await;
    // Two descriptors: an in-bounds one first, then one running past the end. Nothing of the
    // frame may land, and the refusal comes before any payload byte is sent.
    raw.send(&Frame::Data {
        batch: 1,
        ops: straddling_ops(region),
    })
    .await;
    let msg = raw.expect_error(14).await;
    assert!(msg.contains("[4000, 4000+100)"), "{msg}");
    assert!(msg.contains("4096 bytes"), "{msg}");
    still_serves(&t, region, &mem).await;
}

/// A `Rows` frame of one strided descriptor into the 4096-byte region.
fn rows_frame(region: RegionId, offset: u64, len: u64, rows: u64, stride: u64) -> Frame {
    Frame::Rows {
        batch: 1,
        ops: vec![WireRows {
            region: region.0,
            offset,
            len,
            rows,
            stride,
        }],
    }
}

#[tokio::test]
async fn strided_rows_past_the_region_are_refused_before_their_payload() {
    // 4 rows of 100 bytes every 1000 from 1000: the last one, at 4000, runs past the end.
    // Nothing of the frame may land, and the refusal comes before any payload byte is sent.
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    raw.begin(1, region, 400).await;
    raw.send(&rows_frame(region, 1000, 100, 4, 1000)).await;
    let msg = raw.expect_error(14).await;
    assert!(msg.contains("4 rows of 100 bytes"), "{msg}");
    assert!(msg.contains("4096 bytes"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn a_huge_row_count_is_refused_without_allocating_for_it() {
    // 2^40 rows of 1 byte: far beyond the region (and any buffer); refused from the
    // descriptor alone, and nothing of the (never sent) payload is waited for.
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    raw.begin(1, region, 4096).await;
    raw.send(&rows_frame(region, 0, 1, 1 << 40, 1)).await;
    let msg = raw.expect_error(14).await;
    assert!(msg.contains("1099511627776 rows"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn an_overflowing_row_stride_is_refused() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    raw.begin(1, region, 8).await;
    // The second row starts past 2^64.
    raw.send(&rows_frame(region, 8, 4, 2, u64::MAX)).await;
    raw.bytes(&[1; 8]).await;
    let msg = raw.expect_error(7).await;
    assert!(msg.contains("overflows"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn overlapping_rows_are_refused() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    raw.begin(1, region, 16).await;
    raw.send(&rows_frame(region, 0, 8, 2, 4)).await;
    raw.bytes(&[1; 16]).await;
    let msg = raw.expect_error(14).await;
    assert!(msg.contains("overlap"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn strided_rows_land_at_their_stride() {
    // The positive control: 3 rows of 4 bytes every 16, after a batch begun for them.
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    raw.begin(1, region, 12).await;
    raw.send(&rows_frame(region, 100, 4, 3, 16)).await;
    raw.bytes(b"aaaabbbbcccc").await;
    match raw.frame().await {
        Some(Frame::Done { batch: 1 }) => {}
        other => panic!("expected Done, got {other:?}"),
    }
    let got = mem.to_vec(100, 40).unwrap();
    assert_eq!(&got[..4], b"aaaa");
    assert_eq!(&got[16..20], b"bbbb");
    assert_eq!(&got[32..36], b"cccc");
    assert!(got[4..16].iter().chain(&got[20..32]).all(|&b| b == 0xAA));
}

#[tokio::test]
async fn payload_read_ahead_with_its_frame_lands_only_after_the_checks() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    // One write: a small batch's `Begin` (sent without waiting), its `Data` header with an
    // out-of-bounds second descriptor, and the payload. The listener's read-ahead takes the
    // payload in with the headers; none of it may reach the region.
    let mut bytes = Frame::Begin {
        batch: 1,
        epoch: 0,
        remaining_ms: 10_000,
        total_bytes: 200,
        regions: vec![RegionNeed {
            region: region.0,
            end: 4096,
        }],
        notification: None,
        ack: false,
    }
    .encode();
    bytes.extend(
        Frame::Data {
            batch: 1,
            ops: straddling_ops(region),
        }
        .encode(),
    );
    bytes.extend([0x55; 200]);
    raw.bytes(&bytes).await;
    let msg = raw.expect_error(14).await;
    assert!(msg.contains("[4000, 4000+100)"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn data_for_a_batch_never_begun_is_refused() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    raw.send(&Frame::Data {
        batch: 77,
        ops: vec![WireOp {
            region: region.0,
            offset: 0,
            len: 4,
        }],
    })
    .await;
    raw.bytes(&[1, 2, 3, 4]).await;
    let msg = raw.expect_error(14).await;
    assert!(msg.contains("batch 77"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn more_bytes_than_announced_are_refused() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    raw.begin(1, region, 10).await;
    raw.send(&Frame::Data {
        batch: 1,
        ops: vec![WireOp {
            region: region.0,
            offset: 0,
            len: 20,
        }],
    })
    .await;
    raw.bytes(&[1; 20]).await;
    let msg = raw.expect_error(14).await;
    assert!(msg.contains("announced 10 bytes"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn a_well_formed_raw_peer_writes_and_notifies() {
    // The positive control for the cases above: the same raw client, following the protocol.
    let (t, region, mem) = target(TcpConfig::default().with_secret(SECRET.to_vec())).await;
    let mut raw = Raw::handshake(&t, true).await;
    raw.send(&Frame::Begin {
        batch: 5,
        epoch: 0,
        remaining_ms: 10_000,
        total_bytes: 6,
        regions: vec![RegionNeed {
            region: region.0,
            end: 16,
        }],
        notification: Some("note".into()),
        ack: true,
    })
    .await;
    assert!(matches!(raw.frame().await, Some(Frame::BeginAck { .. })));
    raw.send(&Frame::Data {
        batch: 5,
        ops: vec![
            WireOp {
                region: region.0,
                offset: 0,
                len: 2,
            },
            WireOp {
                region: region.0,
                offset: 10,
                len: 4,
            },
        ],
    })
    .await;
    raw.bytes(b"abcdef").await;
    assert_eq!(raw.frame().await, Some(Frame::Done { batch: 5 }));
    let n = tokio::time::timeout(LIMIT, t.recv_notification())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&n.payload[..], b"note");
    assert_eq!(mem.to_vec(0, 2).unwrap(), b"ab");
    assert_eq!(mem.to_vec(10, 4).unwrap(), b"cdef");
    raw.send(&Frame::Ping { nonce: 9 }).await;
    assert_eq!(raw.frame().await, Some(Frame::Pong { nonce: 9 }));
}

/// A listener that completes the handshake, answers `Begin` frames if `ack_begin`, and then
/// never says anything again (but keeps the connection open). Its task ends when the peer
/// closes, with the `Error` frames the peer sent.
async fn silent_listener(
    ack_begin: bool,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<Vec<(u16, String)>>,
) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mine = Preface {
            version: wire::VERSION,
            flags: 0,
            nonce: [3; 32],
        }
        .encode();
        s.write_all(&mine).await.unwrap();
        let mut p = [0u8; 48];
        s.read_exact(&mut p).await.unwrap();
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 1 << 16];
        let mut welcomed = false;
        let mut errors = Vec::new();
        loop {
            while let Ok(wire::Decoded::Frame(f, used)) = wire::decode_frame(&buf, 1 << 20) {
                buf.drain(..used);
                match f {
                    Frame::Hello { .. } if !welcomed => {
                        welcomed = true;
                        s.write_all(&Frame::Welcome { mac: None }.encode())
                            .await
                            .unwrap();
                        let table = Frame::Regions {
                            last: true,
                            regions: vec![],
                        };
                        s.write_all(&table.encode()).await.unwrap();
                    }
                    Frame::Begin { batch, .. } if ack_begin => {
                        let ack = Frame::BeginAck {
                            batch,
                            status: wire::BeginStatus::Accepted,
                            regions: vec![],
                        };
                        s.write_all(&ack.encode()).await.unwrap();
                    }
                    Frame::Error { code, message } => errors.push((code, message)),
                    _ => {}
                }
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return errors,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    });
    (addr, task)
}

/// Fast keep-alive, one connection per peer (the silent listener answers one).
fn keepalive_config() -> TcpConfig {
    TcpConfig::default()
        .with_connections_per_peer(1)
        .with_keepalive_interval(Duration::from_millis(50))
        .with_keepalive_timeout(Duration::from_millis(300))
        .with_fence_grace(Duration::from_millis(200))
}

#[tokio::test]
async fn silent_peer_is_detected_by_keepalive() {
    let (addr, task) = silent_listener(false).await;
    let t = TcpTransport::bind(keepalive_config()).await.unwrap();
    let (src, _) = t.allocate_registered(1 << 17).await.unwrap();
    let peer = t
        .connect(format!("kvbridge-tcp/3@{addr}").as_bytes())
        .await
        .unwrap();
    // Above the size that goes out without waiting, so `post` waits for the listener's answer.
    let op = TransferOp::new(src, 0, RegionId(1), 0, 1 << 17);
    // The Begin is never answered; the keep-alive gives up long before this 60 s deadline.
    let posted = tokio::time::timeout(
        Duration::from_secs(10),
        t.post(
            peer,
            TransferBatch::write(vec![op]).with_timeout(Duration::from_secs(60)),
        ),
    )
    .await
    .expect("post hung on a silent peer");
    match posted {
        Err(TransportError::PeerLost { reason, .. }) => {
            assert!(reason.contains("keep-alive"), "{reason}")
        }
        other => panic!("expected PeerLost, got {other:?}"),
    }
    let probe = t.probe(peer, Duration::from_secs(1)).await;
    assert!(
        matches!(&probe, Err(TransportError::PeerLost { reason, .. }) if reason.contains("keep-alive")),
        "{probe:?}"
    );
    task.abort();
}

#[tokio::test]
async fn pending_batch_fails_by_its_deadline_when_the_peer_goes_silent() {
    let (addr, task) = silent_listener(true).await;
    let t = TcpTransport::bind(keepalive_config()).await.unwrap();
    let (src, _) = t.allocate_registered(1 << 20).await.unwrap();
    let peer = t
        .connect(format!("kvbridge-tcp/3@{addr}").as_bytes())
        .await
        .unwrap();
    let op = TransferOp::new(src, 0, RegionId(1), 0, 1 << 20);
    let deadline = Duration::from_secs(1);
    let id = t
        .post(peer, TransferBatch::write(vec![op]).with_timeout(deadline))
        .await
        .unwrap();
    let r = tokio::time::timeout(deadline + LIMIT, t.wait(id))
        .await
        .expect("wait hung past the deadline");
    assert!(
        matches!(
            r,
            Err(TransportError::PeerLost { .. } | TransportError::TimedOut { .. })
        ),
        "{r:?}"
    );
    assert!(t.probe(peer, Duration::from_millis(200)).await.is_err());
    task.abort();
}

#[tokio::test]
async fn garbage_from_a_listener_fails_connect_clearly() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let _ = s
            .write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n-----------------------")
            .await;
        tokio::time::sleep(LIMIT).await;
    });
    let t = TcpTransport::new().await.unwrap();
    let e = t
        .connect(format!("kvbridge-tcp/3@{addr}").as_bytes())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("magic"), "{e}");
    task.abort();
}

#[tokio::test]
async fn bad_descriptors_and_configs_are_refused() {
    let t = TcpTransport::new().await.unwrap();
    for bad in [
        &b"tcp://127.0.0.1:1"[..],
        b"kvbridge-tcp/2@127.0.0.1:1",
        b"kvbridge-tcp/4@127.0.0.1:1",
        b"kvbridge-tcp/3@nowhere",
        b"\xff\xfe",
    ] {
        let e = t.connect(bad).await.unwrap_err();
        assert!(
            matches!(e, TransportError::BadDescriptor { .. }),
            "{bad:?}: {e}"
        );
    }
    let text = String::from_utf8(t.local_descriptor().to_vec()).unwrap();
    assert!(text.starts_with("kvbridge-tcp/3@127.0.0.1:"), "{text}");
    for config in [
        TcpConfig::default().with_connections_per_peer(0),
        TcpConfig::default().with_secret(Vec::new()),
        TcpConfig::default().with_max_frame_len(16),
        TcpConfig::default()
            .with_keepalive_interval(Duration::from_secs(2))
            .with_keepalive_timeout(Duration::from_secs(1)),
        TcpConfig::default().with_max_inbound_pending_bytes(1 << 20),
        TcpConfig::default().with_max_inbound_pending_bytes_total(1 << 20),
        TcpConfig::default().with_max_inbound_connections(0),
    ] {
        let e = TcpTransport::bind(config).await.unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
    }
}

/// A `Begin` of exactly `body` bytes for a batch that writes 4096 bytes of `region` (so it
/// never completes unless data follows), or none (`total` 0: it completes at once).
fn big_begin(batch: u64, region: RegionId, total: u64, body: usize) -> Frame {
    Frame::Begin {
        batch,
        epoch: 0,
        remaining_ms: 60_000,
        total_bytes: total,
        regions: vec![RegionNeed {
            region: region.0,
            end: 4096,
        }],
        notification: Some(vec![b'n'; body - 38 - 16].into()),
        ack: true,
    }
}

/// What one pending batch with a `body`-byte `Begin` is charged (docs/tcp-protocol.md).
fn charge(body: usize) -> u64 {
    body as u64 + kvbridge_tcp::BATCH_STATE_BYTES
}

/// Sends `Begin`s until the listener refuses one; returns how many it accepted first.
async fn begin_until_refused(raw: &mut Raw, region: RegionId, total: u64, body: usize) -> u64 {
    for batch in 0..256u64 {
        raw.send(&big_begin(batch, region, total, body)).await;
        loop {
            match raw.frame().await {
                Some(Frame::BeginAck { status, .. }) => {
                    assert_eq!(status, wire::BeginStatus::Accepted);
                    break;
                }
                Some(Frame::Done { .. }) => {}
                Some(Frame::Error { code, message }) => {
                    assert_eq!(code, 15, "{message}");
                    assert!(message.contains("max_inbound_pending_bytes"), "{message}");
                    assert!(raw.frame().await.is_none(), "connection left open");
                    return batch;
                }
                other => panic!("expected BeginAck or Error, got {other:?}"),
            }
        }
    }
    panic!("256 Begins of {body} bytes that never complete were all accepted");
}

/// The live peers' charge drops to `want` once the refused session is gone.
async fn charged_eventually(t: &TcpTransport, want: u64) {
    for _ in 0..500 {
        if t.inbound_pending_stats().0 == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "inbound peers still charged {:?}",
        t.inbound_pending_stats()
    );
}

#[tokio::test]
async fn begins_that_never_complete_are_bounded_by_the_pending_budget() {
    // The attack: one unauthenticated connection begins batches with ~1 MiB notifications
    // and never sends their data. Default limits: 1 MiB frames, 32 MiB per peer.
    let (t, region, mem) = target(TcpConfig::default()).await;
    let budget = t.config().max_inbound_pending_bytes;
    let body = 1 << 20;
    let mut raw = Raw::handshake(&t, false).await;
    let accepted = begin_until_refused(&mut raw, region, 4096, body).await;
    // A kept batch holds at least its Begin body (its `BeginAck` part is released once sent).
    assert!(
        accepted >= 1 && accepted <= budget / body as u64,
        "{accepted} Begins accepted"
    );
    let (_, peak) = t.inbound_pending_stats();
    assert!(
        peak <= budget,
        "a peer was charged {peak} bytes, above {budget}"
    );
    assert!(
        peak + charge(body) > budget,
        "refused at {peak} of {budget} bytes"
    );
    charged_eventually(&t, 0).await;
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn many_peers_together_are_bounded_by_the_listeners_total_budget() {
    // Each peer stays within its own budget (4 pending batches); together they may not pin
    // more than the listener's total (6).
    let body = 3000;
    let config = TcpConfig::default()
        .with_max_frame_len(4096)
        .with_max_inbound_pending_bytes(4 * charge(body))
        .with_max_inbound_pending_bytes_total(6 * charge(body));
    let (t, region, mem) = target(config).await;
    let mut first = Raw::handshake_as(&t, false, (51, 0, 1), 1000).await;
    for batch in 0..4 {
        first.send(&big_begin(batch, region, 4096, body)).await;
        assert!(matches!(first.frame().await, Some(Frame::BeginAck { .. })));
    }
    let mut second = Raw::handshake_as(&t, false, (52, 0, 1), 1000).await;
    let mut accepted = 0;
    let message = loop {
        second.send(&big_begin(accepted, region, 4096, body)).await;
        match second.frame().await {
            Some(Frame::BeginAck { status, .. }) => {
                assert_eq!(status, wire::BeginStatus::Accepted);
                accepted += 1;
                assert!(accepted <= 4, "the second peer's Begins were all accepted");
            }
            Some(Frame::Error { code, message }) => {
                assert_eq!(code, 15, "{message}");
                assert!(second.frame().await.is_none(), "connection left open");
                break message;
            }
            other => panic!("expected BeginAck or Error, got {other:?}"),
        }
    };
    // The second peer met the total (6 batches in all), not its own budget (4).
    assert_eq!(accepted, 2, "{message}");
    assert!(
        message.contains("max_inbound_pending_bytes_total"),
        "{message}"
    );
    // Both peers' charges are released once they are gone.
    drop(first);
    charged_eventually(&t, 0).await;
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn queued_notifications_stay_charged_until_the_application_takes_them() {
    let body = 3000;
    let config = TcpConfig::default()
        .with_max_frame_len(4096)
        .with_max_inbound_pending_bytes(4 * charge(body));
    let (t, region, mem) = target(config).await;
    let mut raw = Raw::handshake(&t, false).await;
    // Batches of 0 bytes complete at once; their notifications wait for the application.
    for batch in 0..4 {
        raw.send(&big_begin(batch, region, 0, body)).await;
        assert!(matches!(raw.frame().await, Some(Frame::BeginAck { .. })));
        assert_eq!(raw.frame().await, Some(Frame::Done { batch }));
    }
    let held = t.inbound_pending_stats().0;
    assert!(
        (4 * body as u64..=4 * charge(body)).contains(&held),
        "{held} bytes charged"
    );
    for _ in 0..4 {
        let n = tokio::time::timeout(LIMIT, t.recv_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n.payload.len(), body - 54);
    }
    assert_eq!(
        t.inbound_pending_stats().0,
        0,
        "taken notifications release their charge"
    );
    // The budget is whole again: 4 more fit, the fifth does not.
    let accepted = begin_until_refused(&mut raw, region, 0, body).await;
    assert_eq!(accepted, 4);
    assert!(t.inbound_pending_stats().1 <= 4 * charge(body));
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn a_lost_peer_error_names_the_listeners_reason() {
    // The listener's application never takes notifications, so the second batch goes above
    // its budget: the sender's error says so, not just "broken pipe".
    let listener_cfg = TcpConfig::default()
        .with_max_frame_len(4096)
        .with_max_inbound_pending_bytes(4096 + kvbridge_tcp::BATCH_STATE_BYTES);
    let (t, region, _mem) = target(listener_cfg).await;
    let sender = TcpTransport::new().await.unwrap();
    let (src, _) = sender.allocate_registered(16).await.unwrap();
    let peer = sender.connect(&t.local_descriptor()).await.unwrap();
    let batch = || {
        let op = TransferOp::new(src, 0, region, 0, 16);
        TransferBatch::write(vec![op]).with_notification(vec![b'x'; 3000].into())
    };
    tokio::time::timeout(LIMIT, sender.transfer(peer, batch()))
        .await
        .unwrap()
        .unwrap();
    let e = tokio::time::timeout(LIMIT, sender.transfer(peer, batch()))
        .await
        .unwrap()
        .unwrap_err();
    match e {
        TransportError::PeerLost { reason, .. } => {
            assert!(reason.contains("error 15"), "{reason}");
            assert!(reason.contains("max_inbound_pending_bytes"), "{reason}");
        }
        other => panic!("expected PeerLost, got {other:?}"),
    }
}

#[tokio::test]
async fn an_idle_connection_is_closed_whatever_interval_it_announces() {
    // The peer claims it pings every 49 days and then says nothing: the listener still closes
    // it (after at most 4 x its own keep-alive timeout) and says why.
    let config = TcpConfig::default()
        .with_keepalive_interval(Duration::from_millis(100))
        .with_keepalive_timeout(Duration::from_millis(500));
    let (t, region, mem) = target(config).await;
    let mut raw = Raw::handshake_as(&t, false, (7, 0, 1), u32::MAX).await;
    let msg = raw.expect_error(16).await;
    assert!(msg.contains("heard nothing"), "{msg}");
    assert!(msg.contains("keepalive_timeout"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn a_slow_handshake_ends_at_the_connect_timeout() {
    // Each part of the Hello arrives within the timeout, the whole handshake does not.
    let timeout = Duration::from_secs(3);
    let mut config = TcpConfig::default();
    config.connect_timeout = timeout;
    let (t, region, mem) = target(config).await;
    let mine = Preface {
        version: wire::VERSION,
        flags: 0,
        nonce: [5; 32],
    }
    .encode();
    let (mut raw, _) = Raw::open(&t, mine).await;
    let hello = Frame::Hello {
        session: 9,
        conn_index: 0,
        conn_count: 1,
        keepalive_ms: 1000,
        mac: None,
    }
    .encode();
    let (header, body) = hello.split_at(wire::HEADER_LEN);
    for part in [header, body] {
        let gap = timeout * 4 / 5 / part.len() as u32;
        for b in part {
            tokio::time::sleep(gap).await;
            raw.bytes(&[*b]).await;
        }
    }
    assert_eq!(raw.frame().await, None, "the slow handshake was accepted");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn the_other_connections_of_a_session_learn_why_it_ended() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut first = Raw::handshake_as(&t, false, (11, 0, 2), 1000).await;
    let mut second = Raw::handshake_as(&t, false, (11, 1, 2), 1000).await;
    second.bytes(&[0x7f, 0, 0, 0, 0, 0, 0, 0]).await;
    second.expect_error(4).await;
    let msg = first.expect_error(16).await;
    assert!(msg.contains("connection 1 of this session ended"), "{msg}");
    assert!(msg.contains("unknown frame type"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn a_hello_announcing_more_than_16_connections_is_refused() {
    // The listener keeps one slot per announced connection: the count is checked first.
    let (t, region, mem) = target(TcpConfig::default()).await;
    let hello = Frame::Hello {
        session: 3,
        conn_index: 0,
        conn_count: u16::MAX,
        keepalive_ms: 1000,
        mac: None,
    };
    let mut raw = Raw::hello(&t, hello).await;
    let msg = raw.expect_error(5).await;
    assert!(msg.contains("connection count"), "{msg}");
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn a_sender_giving_up_on_a_silent_listener_tells_it_why() {
    let (addr, task) = silent_listener(false).await;
    let t = TcpTransport::bind(keepalive_config()).await.unwrap();
    let peer = t
        .connect(format!("kvbridge-tcp/3@{addr}").as_bytes())
        .await
        .unwrap();
    let errors = tokio::time::timeout(LIMIT, task)
        .await
        .expect("the sender never gave up on a silent listener")
        .unwrap();
    match &errors[..] {
        [(16, message)] => assert!(message.contains("heard nothing"), "{message}"),
        other => panic!("expected one Error frame with code 16, got {other:?}"),
    }
    let probe = t.probe(peer, Duration::from_secs(1)).await;
    assert!(
        matches!(probe, Err(TransportError::PeerLost { .. })),
        "{probe:?}"
    );
}

#[tokio::test]
async fn connections_beyond_the_limit_are_refused_until_one_closes() {
    let (t, _, mem) = target(TcpConfig::default().with_max_inbound_connections(2)).await;
    let first = Raw::handshake_as(&t, false, (1, 0, 1), 1000).await;
    let _second = Raw::handshake_as(&t, false, (2, 0, 1), 1000).await;
    let hello = Frame::Hello {
        session: 3,
        conn_index: 0,
        conn_count: 1,
        keepalive_ms: 1000,
        mac: None,
    };
    let mut third = Raw::hello(&t, hello).await;
    let msg = third.expect_error(16).await;
    assert!(msg.contains("max_inbound_connections"), "{msg}");
    // Once a connection closes, its slot serves the next peer (of one connection).
    drop(first);
    let good = TcpTransport::bind(TcpConfig::default().with_connections_per_peer(1))
        .await
        .unwrap();
    let mut admitted = false;
    for _ in 0..200 {
        match good.connect(&t.local_descriptor()).await {
            Ok(_) => {
                admitted = true;
                break;
            }
            Err(e) if e.to_string().contains("max_inbound_connections") => {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            Err(e) => panic!("unexpected refusal: {e}"),
        }
    }
    assert!(admitted, "the closed connection's slot was never freed");
    assert!(untouched(&mem));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_begins_on_every_connection_share_one_budget() {
    // One session, four connections, each beginning batches as fast as it can: the charges
    // of all of them together never pass the peer's budget.
    let body = 60 << 10;
    let budget = 8 * charge(body);
    let config = TcpConfig::default()
        .with_max_frame_len(64 << 10)
        .with_max_inbound_pending_bytes(budget);
    let (t, region, mem) = target(config).await;
    let mut conns = Vec::new();
    for index in 0..4u16 {
        conns.push(Raw::handshake_as(&t, false, (77, index, 4), 1000).await);
    }
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(i, mut raw)| {
            tokio::spawn(async move {
                let mut accepted = 0u64;
                for k in 0..64u64 {
                    raw.send(&big_begin(i as u64 * 1000 + k, region, 4096, body))
                        .await;
                    match raw.frame().await {
                        Some(Frame::BeginAck { .. }) => accepted += 1,
                        Some(Frame::Error { code, .. }) => return (accepted, Some(code)),
                        None => return (accepted, None),
                        other => panic!("expected BeginAck or Error, got {other:?}"),
                    }
                }
                (accepted, None)
            })
        })
        .collect();
    let mut accepted = 0;
    let mut codes = Vec::new();
    for task in tasks {
        let (n, code) = tokio::time::timeout(LIMIT * 2, task)
            .await
            .unwrap()
            .unwrap();
        accepted += n;
        codes.extend(code);
    }
    assert!(
        codes.contains(&15),
        "no connection was refused for the budget: {codes:?}"
    );
    assert!(
        accepted <= 8,
        "{accepted} batches accepted within a budget of 8"
    );
    let (_, peak) = t.inbound_pending_stats();
    assert!(
        peak <= budget,
        "the session was charged {peak} bytes, above {budget}"
    );
    charged_eventually(&t, 0).await;
    still_serves(&t, region, &mem).await;
}

#[tokio::test]
async fn the_region_table_is_sent_at_connect_and_announced_on_change() {
    let (t, region, _mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    assert_eq!(
        raw.table,
        vec![RegionLen {
            region: region.0,
            len: Some(4096),
        }]
    );
    let (later, _) = t.allocate_registered(100).await.unwrap();
    assert_eq!(
        raw.frame().await,
        Some(Frame::Regions {
            last: true,
            regions: vec![RegionLen {
                region: later.0,
                len: Some(100),
            }],
        })
    );
    t.deregister(later).await.unwrap();
    assert_eq!(
        raw.frame().await,
        Some(Frame::Regions {
            last: true,
            regions: vec![RegionLen {
                region: later.0,
                len: None,
            }],
        })
    );
}

/// A `Begin` sent without waiting for its answer, followed at once by its data.
fn unasked(batch: u64, region: u64, offset: u64, data: &[u8]) -> Vec<u8> {
    let op = WireOp {
        region,
        offset,
        len: data.len() as u64,
    };
    let mut bytes = Frame::Begin {
        batch,
        epoch: 0,
        remaining_ms: 60_000,
        total_bytes: data.len() as u64,
        regions: vec![RegionNeed {
            region,
            end: offset + data.len() as u64,
        }],
        notification: None,
        ack: false,
    }
    .encode();
    bytes.extend(
        Frame::Data {
            batch,
            ops: vec![op],
        }
        .encode(),
    );
    bytes.extend_from_slice(data);
    bytes
}

#[tokio::test]
async fn a_refused_batch_sent_without_waiting_is_dropped_and_the_connection_kept() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    // Unknown region, then out of bounds: each is refused, its data read and dropped.
    for (batch, target, offset, len) in [(1, 999, 0, None), (2, region.0, 4090, Some(4096))] {
        raw.bytes(&unasked(batch, target, offset, &[9; 64])).await;
        match raw.frame().await {
            Some(Frame::BeginAck {
                batch: b,
                status,
                regions,
            }) => {
                assert_eq!((b, status), (batch, wire::BeginStatus::RegionRefused));
                assert_eq!(regions[0].len, len);
            }
            other => panic!("expected a refusal of batch {batch}, got {other:?}"),
        }
        raw.send(&Frame::Cancel { batch }).await;
        assert_eq!(
            raw.frame().await,
            Some(Frame::CancelAck {
                batch,
                status: wire::CancelStatus::Dropped,
            })
        );
    }
    assert!(untouched(&mem), "a refused batch wrote memory");
    // The same connection goes on: a good batch sent the same way is applied, unanswered
    // until its `Done`.
    raw.bytes(&unasked(3, region.0, 8, b"in place")).await;
    assert_eq!(raw.frame().await, Some(Frame::Done { batch: 3 }));
    assert_eq!(mem.to_vec(8, 8).unwrap(), b"in place");
    // More data than a refused batch announced is still a protocol error.
    raw.bytes(&unasked(4, 999, 0, &[4; 8])).await;
    assert!(matches!(raw.frame().await, Some(Frame::BeginAck { .. })));
    raw.send(&Frame::Data {
        batch: 4,
        ops: vec![WireOp {
            region: 999,
            offset: 0,
            len: 8,
        }],
    })
    .await;
    raw.bytes(&[4; 8]).await;
    let msg = raw.expect_error(14).await;
    assert!(msg.contains("announced 8 bytes"), "{msg}");
}

#[tokio::test]
async fn a_begin_deadline_counts_from_its_epoch_not_from_its_arrival() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    // A deadline 1 ms after the Welcome has passed once this Begin arrives, however late it
    // was read: the data is dropped, not written.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut bytes = unasked(1, region.0, 0, &[7; 8]);
    // remaining_ms at body offset 16, after the batch id and the epoch.
    bytes[wire::HEADER_LEN + 16..wire::HEADER_LEN + 24].copy_from_slice(&1u64.to_be_bytes());
    raw.bytes(&bytes).await;
    // The Cancel is answered once the Data frame before it was handled (FIFO).
    raw.send(&Frame::Cancel { batch: 1 }).await;
    assert_eq!(
        raw.frame().await,
        Some(Frame::CancelAck {
            batch: 1,
            status: wire::CancelStatus::Dropped,
        })
    );
    assert!(untouched(&mem), "a batch past its deadline wrote memory");
    // An epoch that is a Pong this side sent counts from that Pong.
    raw.send(&Frame::Ping { nonce: 77 }).await;
    assert_eq!(raw.frame().await, Some(Frame::Pong { nonce: 77 }));
    let mut bytes = unasked(2, region.0, 0, b"fresh");
    // Epoch field at body offset 8, after the batch id.
    bytes[wire::HEADER_LEN + 8..wire::HEADER_LEN + 16].copy_from_slice(&77u64.to_be_bytes());
    raw.bytes(&bytes).await;
    assert_eq!(raw.frame().await, Some(Frame::Done { batch: 2 }));
    assert_eq!(mem.to_vec(0, 5).unwrap(), b"fresh");
}

#[tokio::test]
async fn posts_check_remote_bounds_against_the_announced_table() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let sender = TcpTransport::new().await.unwrap();
    let (src, src_mem) = sender.allocate_registered(4096).await.unwrap();
    src_mem.fill(0, 4096, 0x55).unwrap();
    let peer = sender.connect(&t.local_descriptor()).await.unwrap();
    let op = |remote_region, remote_offset, len| {
        TransferOp::new(src, 0, remote_region, remote_offset, len)
    };
    // Out of bounds of a region in the table: refused by `post` itself.
    let e = sender
        .post(peer, TransferBatch::write(vec![op(region, 4000, 200)]))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            TransportError::OutOfBounds {
                side: kvbridge_transport::Side::Remote,
                region_len: 4096,
                ..
            }
        ),
        "{e}"
    );
    // Registered after connect: announced, and written.
    let (late, late_mem) = t.allocate_registered(512).await.unwrap();
    sender
        .transfer(peer, TransferBatch::write(vec![op(late, 0, 512)]))
        .await
        .unwrap();
    assert_eq!(late_mem.to_vec(0, 512).unwrap(), vec![0x55; 512]);
    // Deregistered after connect: the receiver refuses it; `wait` names the region and
    // nothing is written.
    t.deregister(late).await.unwrap();
    let r = sender
        .transfer(peer, TransferBatch::write(vec![op(late, 0, 16)]))
        .await;
    assert!(
        matches!(
            r,
            Err(TransportError::UnknownRegion {
                side: kvbridge_transport::Side::Remote,
                region,
                ..
            }) if region == late
        ),
        "{r:?}"
    );
    assert!(untouched(&mem));
    // The connection is still good.
    sender
        .transfer(peer, TransferBatch::write(vec![op(region, 0, 64)]))
        .await
        .unwrap();
    assert_eq!(mem.to_vec(0, 64).unwrap(), vec![0x55; 64]);
}

/// One session's `Data` frame whose descriptors overlap, its payload sent after the frame,
/// must not hold up the listener's other sessions: the listener answers a `Ping` on another
/// session within 100 ms meanwhile (a claim that waited for the frame's own earlier slices
/// blocked the runtime's worker for a second per descriptor), and still applies the frame's
/// writes in order.
#[test]
fn overlapping_descriptors_do_not_stall_the_listeners_other_sessions() {
    // The listener alone on a runtime with one worker: a blocking wait there stalls every
    // session, as it would every worker of a busy runtime.
    let listener_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (t, region, mem) = listener_rt.block_on(target(TcpConfig::default()));
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    const OPS: u64 = 30;
    client_rt.block_on(async {
        let mut hostile = Raw::handshake_as(&t, false, (42, 0, 1), 1000).await;
        let mut pinger = Raw::handshake_as(&t, false, (43, 0, 1), 1000).await;
        hostile.begin(1, region, OPS * 8).await;
        // Op `i` writes 8 bytes of `i + 1` at `4 * i`: each overlaps the next by 4 bytes.
        let ops = (0..OPS)
            .map(|i| WireOp {
                region: region.0,
                offset: 4 * i,
                len: 8,
            })
            .collect();
        hostile.send(&Frame::Data { batch: 1, ops }).await;
        // The frame is parsed on its own before any payload byte arrives.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let payload: Vec<u8> = (0..OPS).flat_map(|i| [i as u8 + 1; 8]).collect();
        hostile.bytes(&payload).await;

        let mut best = Duration::MAX;
        for nonce in 0..5 {
            let sent = std::time::Instant::now();
            pinger.send(&Frame::Ping { nonce }).await;
            assert_eq!(pinger.frame().await, Some(Frame::Pong { nonce }));
            best = best.min(sent.elapsed());
        }
        assert!(
            best < Duration::from_millis(100),
            "the listener took {best:?} (best of 5) to answer a Ping on another session while one \
             session wrote overlapping descriptors"
        );

        assert_eq!(hostile.frame().await, Some(Frame::Done { batch: 1 }));
        // In order, later descriptors win where they overlap.
        let mut want: Vec<u8> = (0..OPS).flat_map(|i| [i as u8 + 1; 4]).collect();
        want.extend([OPS as u8; 4]);
        assert_eq!(mem.to_vec(0, 4 * OPS + 4).unwrap(), want);
        assert!(
            mem.to_vec(4 * OPS + 4, 16)
                .unwrap()
                .iter()
                .all(|&b| b == 0xAA)
        );
    });
    listener_rt.block_on(async move { drop(t) });
}

/// A write whose destination bytes a local access holds waits for it on the runtime's timer
/// (the worker goes on serving) and lands once it ends, whichever way the listener receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_write_into_held_bytes_waits_for_them_and_lands() {
    for in_place in [true, false] {
        let (t, region, mem) = target(TcpConfig::default().with_receive_in_place(in_place)).await;
        let sender = TcpTransport::new().await.unwrap();
        let (src, src_mem) = sender.allocate_registered(16).await.unwrap();
        src_mem.write_at(0, b"landed when free").unwrap();
        let peer = sender.connect(&t.local_descriptor()).await.unwrap();
        // The bytes are held on a thread of the test, released 200 ms later.
        let held = mem.borrow_mut(100, 16).unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(held);
        });
        // Meanwhile the listener answers other work on its only worker.
        let batch = TransferBatch::write(vec![TransferOp::new(src, 0, region, 100, 16)]);
        let write = tokio::spawn(async move {
            let r = sender.transfer(peer, batch).await;
            (sender, r)
        });
        let mut other = Raw::handshake_as(&t, false, (44, 0, 1), 1000).await;
        other.send(&Frame::Ping { nonce: 1 }).await;
        assert_eq!(other.frame().await, Some(Frame::Pong { nonce: 1 }));
        release.join().unwrap();
        let (_sender, r) = tokio::time::timeout(LIMIT, write).await.unwrap().unwrap();
        r.unwrap_or_else(|e| panic!("in place {in_place}: {e}"));
        assert_eq!(mem.to_vec(100, 16).unwrap(), b"landed when free");
    }
}
