//! Hostile and broken peers, played by raw sockets speaking the documented wire format
//! (`docs/tcp-protocol.md`): every case gets a clear error frame and a closed connection, never
//! a byte outside (or inside) a region it may not write, and the transport keeps serving
//! well-behaved peers afterwards. Also: keep-alive against a silent peer.

use std::time::Duration;

use hmac::{Hmac, Mac};
use kvbridge_tcp::wire::{self, FLAG_SECRET, Frame, Preface, RegionNeed, WireOp};
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
}

impl Raw {
    /// Connects and sends `preface` (the server's preface is read and returned).
    async fn open(t: &TcpTransport, preface: [u8; 48]) -> (Self, [u8; 48]) {
        let mut s = TcpStream::connect(t.local_addr()).await.unwrap();
        s.write_all(&preface).await.unwrap();
        let mut theirs = [0u8; 48];
        s.read_exact(&mut theirs).await.unwrap();
        (Self { s }, theirs)
    }

    /// Completes a correct handshake (with the secret when `secret` is true).
    async fn handshake(t: &TcpTransport, secret: bool) -> Self {
        let mine = Preface {
            version: wire::VERSION,
            flags: if secret { FLAG_SECRET } else { 0 },
            nonce: [7; 32],
        }
        .encode();
        let (mut raw, theirs) = Raw::open(t, mine).await;
        let (session, index, count, keepalive) = (42u64, 0u16, 1u16, 1000u32);
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
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Ok(wire::Decoded::Frame(f, _)) = wire::decode_frame(&buf, 1 << 20) {
                return Some(f);
            }
            let n = tokio::time::timeout(LIMIT, self.s.read(&mut chunk))
                .await
                .expect("the transport neither answered nor closed")
                .unwrap_or(0);
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
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
                Some(Frame::BeginAck { .. } | Frame::Pong { .. }) => {}
                other => panic!("expected an Error frame with code {code}, got {other:?}"),
            }
        }
    }

    async fn begin(&mut self, batch: u64, region: RegionId, total: u64) {
        self.send(&Frame::Begin {
            batch,
            remaining_ms: 10_000,
            total_bytes: total,
            regions: vec![RegionNeed {
                region: region.0,
                end: 4096,
            }],
            notification: None,
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
    let op = TransferOp {
        local_region: src,
        local_offset: 0,
        remote_region: region,
        remote_offset: 100,
        len: 16,
    };
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
        remaining_ms: 1000,
        total_bytes: 8,
        regions: vec![RegionNeed {
            region: 999,
            end: 8,
        }],
        notification: None,
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

#[tokio::test]
async fn out_of_bounds_write_is_refused_before_its_payload() {
    let (t, region, mem) = target(TcpConfig::default()).await;
    let mut raw = Raw::handshake(&t, false).await;
    raw.begin(1, region, 200).await;
    // Two descriptors: an in-bounds one first, then one running past the end. Nothing of the
    // frame may land, and the refusal comes before any payload byte is sent.
    raw.send(&Frame::Data {
        batch: 1,
        ops: vec![
            WireOp {
                region: region.0,
                offset: 0,
                len: 100,
            },
            WireOp {
                region: region.0,
                offset: 4000,
                len: 100,
            },
        ],
    })
    .await;
    let msg = raw.expect_error(14).await;
    assert!(msg.contains("[4000, 4000+100)"), "{msg}");
    assert!(msg.contains("4096 bytes"), "{msg}");
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
        remaining_ms: 10_000,
        total_bytes: 6,
        regions: vec![RegionNeed {
            region: region.0,
            end: 16,
        }],
        notification: Some("note".into()),
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
/// never says anything again (but keeps the connection open).
async fn silent_listener(ack_begin: bool) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
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
        loop {
            while let Ok(wire::Decoded::Frame(f, used)) = wire::decode_frame(&buf, 1 << 20) {
                buf.drain(..used);
                match f {
                    Frame::Hello { .. } if !welcomed => {
                        welcomed = true;
                        s.write_all(&Frame::Welcome { mac: None }.encode())
                            .await
                            .unwrap();
                    }
                    Frame::Begin { batch, .. } if ack_begin => {
                        let ack = Frame::BeginAck {
                            batch,
                            status: wire::BeginStatus::Accepted,
                            regions: vec![],
                        };
                        s.write_all(&ack.encode()).await.unwrap();
                    }
                    _ => {}
                }
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    });
    (addr, task)
}

fn keepalive_config() -> TcpConfig {
    TcpConfig::default()
        .with_keepalive(Duration::from_millis(50), Duration::from_millis(300))
        .with_fence_grace(Duration::from_millis(200))
}

#[tokio::test]
async fn silent_peer_is_detected_by_keepalive() {
    let (addr, task) = silent_listener(false).await;
    let t = TcpTransport::bind(keepalive_config()).await.unwrap();
    let (src, _) = t.allocate_registered(64).await.unwrap();
    let peer = t
        .connect(format!("kvbridge-tcp/1@{addr}").as_bytes())
        .await
        .unwrap();
    let op = TransferOp {
        local_region: src,
        local_offset: 0,
        remote_region: RegionId(1),
        remote_offset: 0,
        len: 64,
    };
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
        .connect(format!("kvbridge-tcp/1@{addr}").as_bytes())
        .await
        .unwrap();
    let op = TransferOp {
        local_region: src,
        local_offset: 0,
        remote_region: RegionId(1),
        remote_offset: 0,
        len: 1 << 20,
    };
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
        .connect(format!("kvbridge-tcp/1@{addr}").as_bytes())
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
        b"kvbridge-tcp/1@nowhere",
        b"\xff\xfe",
    ] {
        let e = t.connect(bad).await.unwrap_err();
        assert!(
            matches!(e, TransportError::BadDescriptor { .. }),
            "{bad:?}: {e}"
        );
    }
    let text = String::from_utf8(t.local_descriptor().to_vec()).unwrap();
    assert!(text.starts_with("kvbridge-tcp/1@127.0.0.1:"), "{text}");
    for config in [
        TcpConfig::default().with_connections_per_peer(0),
        TcpConfig::default().with_secret(Vec::new()),
        TcpConfig::default().with_max_frame_len(16),
        TcpConfig::default().with_keepalive(Duration::from_secs(2), Duration::from_secs(1)),
    ] {
        let e = TcpTransport::bind(config).await.unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
    }
}
