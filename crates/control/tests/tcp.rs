//! The TCP control channel: delivery and order, secrets, versions, limits, loss and hostile
//! peers.

use std::time::Duration;

use kvbridge_control::tcp::{TCP_WIRE_VERSION, TcpControlChannel, TcpControlConfig};
use kvbridge_control::{
    AbortRequest, ControlChannel, ControlError, ControlMessage, Endpoint, Envelope, Heartbeat,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn cfg() -> TcpControlConfig {
    TcpControlConfig::default()
        .with_handshake_timeout(Duration::from_secs(2))
        .with_frame_timeout(Duration::from_secs(2))
}

fn ping(n: u64) -> ControlMessage {
    ControlMessage::Ping(Heartbeat { nonce: n })
}

async fn recv(ch: &TcpControlChannel) -> Envelope {
    tokio::time::timeout(Duration::from_secs(30), ch.recv())
        .await
        .expect("a message within 30 s")
        .unwrap()
}

/// Polls `f` until it holds (bounded), for counters updated by background tasks.
async fn eventually(what: &str, f: impl Fn() -> bool) {
    for _ in 0..3000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what} did not happen within 30 s");
}

#[tokio::test]
async fn messages_arrive_in_order_with_the_senders_endpoint() {
    let a = TcpControlChannel::bind(cfg()).await.unwrap();
    let b = TcpControlChannel::bind(cfg()).await.unwrap();
    assert_eq!(a.name(), "tcp");
    assert!(a.local_endpoint().as_str().starts_with("127.0.0.1:"));
    for n in 0..500 {
        a.send(&b.local_endpoint(), ping(n)).await.unwrap();
    }
    for n in 0..500 {
        let env = recv(&b).await;
        assert_eq!(env.from, a.local_endpoint());
        assert_eq!(env.message, ping(n));
    }
    // Replies go back over b's own connection to a's listener.
    b.send(
        &a.local_endpoint(),
        ControlMessage::Pong(Heartbeat { nonce: 9 }),
    )
    .await
    .unwrap();
    assert_eq!(recv(&a).await.from, b.local_endpoint());
    assert_eq!(
        a.stats().connects,
        1,
        "one connection reused for every message"
    );
    assert_eq!(b.stats().frames_received, 500);
    // A channel can send to itself.
    a.send(&a.local_endpoint(), ping(1)).await.unwrap();
    assert_eq!(recv(&a).await.from, a.local_endpoint());
}

#[tokio::test]
async fn a_shared_secret_is_required_and_checked_both_ways() {
    let good = || cfg().with_secret(b"right".to_vec());
    let a = TcpControlChannel::bind(good()).await.unwrap();
    let b = TcpControlChannel::bind(good()).await.unwrap();
    a.send(&b.local_endpoint(), ping(1)).await.unwrap();
    assert_eq!(recv(&b).await.message, ping(1));

    let wrong = TcpControlChannel::bind(cfg().with_secret(b"wrong".to_vec()))
        .await
        .unwrap();
    let e = wrong.send(&b.local_endpoint(), ping(2)).await.unwrap_err();
    assert!(matches!(e, ControlError::Send { .. }), "{e}");
    assert!(
        e.to_string().contains("could not prove the shared secret"),
        "{e}"
    );

    let none = TcpControlChannel::bind(cfg()).await.unwrap();
    let e = none
        .send(&b.local_endpoint(), ping(3))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("requires a shared secret"), "{e}");
    let e = a
        .send(&none.local_endpoint(), ping(4))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not use a shared secret"), "{e}");
    eventually("the refusals are counted", || b.stats().refused == 2).await;
    assert_eq!(b.stats().frames_received, 1, "nothing from refused peers");
}

#[tokio::test]
async fn sending_to_nobody_fails_at_once_and_close_stops_the_channel() {
    let a = TcpControlChannel::bind(cfg()).await.unwrap();
    let gone = TcpControlChannel::bind(cfg()).await.unwrap();
    let dead = gone.local_endpoint();
    drop(gone);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let e = tokio::time::timeout(Duration::from_secs(5), a.send(&dead, ping(1)))
        .await
        .expect("no hang")
        .unwrap_err();
    assert!(e.to_string().contains("cannot connect"), "{e}");
    let e = a
        .send(&Endpoint::new("not an address"), ping(1))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not an ip:port"), "{e}");

    let big = ControlMessage::Abort(AbortRequest {
        room: 1.into(),
        generation: 1.into(),
        decode_endpoint: a.local_endpoint(),
        reason: "x".repeat(2 << 20),
    });
    let e = a
        .send(&a.local_endpoint(), big)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("above max_frame_len"), "{e}");

    a.close();
    assert!(matches!(a.recv().await, Err(ControlError::Closed { .. })));
    assert!(a.send(&a.local_endpoint(), ping(1)).await.is_err());
}

#[tokio::test]
async fn a_restarted_peer_is_reached_again() {
    let a = TcpControlChannel::bind(cfg()).await.unwrap();
    let b = TcpControlChannel::bind(cfg()).await.unwrap();
    let ep = b.local_endpoint();
    a.send(&ep, ping(1)).await.unwrap();
    recv(&b).await;
    drop(b);
    let addr: std::net::SocketAddr = ep.as_str().parse().unwrap();
    let mut b2 = None;
    for _ in 0..200 {
        if let Ok(c) = TcpControlChannel::bind(cfg().with_bind_addr(addr)).await {
            b2 = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let b2 = b2.expect("the port is free again");
    // Messages sent while the old connection was dying may be lost; a later one gets through
    // over a new connection.
    let mut delivered = false;
    for n in 2..200 {
        let _ = a.send(&ep, ping(n)).await;
        if let Ok(Ok(env)) = tokio::time::timeout(Duration::from_millis(20), b2.recv()).await {
            assert_eq!(env.from, a.local_endpoint());
            delivered = true;
            break;
        }
    }
    assert!(delivered, "the restarted peer never got a message");
    assert!(a.stats().connects >= 2, "{:?}", a.stats());
}

#[tokio::test]
async fn queues_are_bounded_and_nothing_is_lost_under_backpressure() {
    let a = TcpControlChannel::bind(cfg().with_queue(2)).await.unwrap();
    let b = TcpControlChannel::bind(cfg().with_queue(2)).await.unwrap();
    let msg = |n: u64| {
        ControlMessage::Abort(AbortRequest {
            room: n.into(),
            generation: 0.into(),
            decode_endpoint: a.local_endpoint(),
            reason: "r".repeat(512 << 10),
        })
    };
    // b does not read: at some point a send must wait instead of buffering without bound.
    let mut sent = 0u64;
    let mut blocked = false;
    for n in 0..400 {
        match tokio::time::timeout(Duration::from_secs(1), a.send(&b.local_endpoint(), msg(n)))
            .await
        {
            Ok(r) => {
                r.unwrap();
                sent += 1;
            }
            Err(_) => {
                blocked = true;
                break;
            }
        }
    }
    assert!(
        blocked,
        "400 messages of 512 KiB were accepted without backpressure"
    );
    for n in 0..sent {
        assert_eq!(recv(&b).await.message.room(), Some(n.into()));
    }
}

/// A raw client: writes `bytes`, returns what the server answered before closing.
async fn raw(ep: &Endpoint, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(ep.as_str()).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("the channel closes a hostile connection instead of hanging")
        .ok();
    out
}

fn hello(version: u16, flags: u16, name: &[u8]) -> Vec<u8> {
    let mut h = b"KVBCTRL\0".to_vec();
    h.extend_from_slice(&version.to_be_bytes());
    h.extend_from_slice(&flags.to_be_bytes());
    h.extend_from_slice(&[7u8; 16]);
    h.extend_from_slice(&(name.len() as u16).to_be_bytes());
    h.extend_from_slice(name);
    h
}

/// A full client handshake without a secret, then `frames`.
fn session(frames: &[u8]) -> Vec<u8> {
    let mut v = hello(TCP_WIRE_VERSION.major, 0, b"127.0.0.1:1");
    v.extend_from_slice(&[0u8; 32]);
    v.extend_from_slice(frames);
    v
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

#[tokio::test]
async fn hostile_peers_are_closed_and_the_channel_keeps_serving() {
    let b = TcpControlChannel::bind(cfg()).await.unwrap();
    let ep = b.local_endpoint();

    // Not our protocol at all.
    let out = raw(&ep, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(out.is_empty(), "no answer to a foreign preface");
    // Another protocol version: the verdict names the mismatch.
    let mut v = hello(TCP_WIRE_VERSION.major + 1, 0, b"127.0.0.1:1");
    v.extend_from_slice(&[0u8; 32]);
    let out = raw(&ep, &v).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.contains("version mismatch"), "{text}");
    // Bad endpoint names.
    raw(&ep, &hello(TCP_WIRE_VERSION.major, 0, b"")).await;
    let mut bad_name = hello(TCP_WIRE_VERSION.major, 0, b"a\nb");
    bad_name.extend_from_slice(&[0u8; 32]);
    let out = raw(&ep, &bad_name).await;
    assert!(String::from_utf8_lossy(&out).contains("printable"));
    // Silence during the handshake, and inside frames after it: closed at the deadlines
    // (all four wait concurrently).
    let partial_hello = hello(TCP_WIRE_VERSION.major, 0, b"127.0.0.1:1");
    let (header, body) = (session(&[0, 0, 0]), session(&[0, 0, 0, 100, b'{']));
    tokio::join!(
        raw(&ep, b""),
        raw(&ep, &partial_hello[..10]),
        raw(&ep, &header),
        raw(&ep, &body),
    );
    eventually("six refused handshakes", || b.stats().refused == 6).await;

    // After a good handshake: bad frames.
    raw(&ep, &session(&u32::MAX.to_be_bytes())).await; // length above the limit
    raw(&ep, &session(&0u32.to_be_bytes())).await; // empty frame
    raw(&ep, &session(&frame(b"{not json"))).await;
    raw(&ep, &session(&frame(br#"{"type":"ping"}"#))).await; // a known type, fields missing
    raw(&ep, &session(&frame(br#"{"type":"ping","nonce":-1}"#))).await;
    eventually("seven protocol errors", || b.stats().protocol_errors == 7).await;
    assert_eq!(b.stats().unknown_skipped, 0);
    assert_eq!(b.stats().frames_received, 0);

    // A good frame after a good handshake is delivered, with the hello's endpoint.
    let mut s = TcpStream::connect(ep.as_str()).await.unwrap();
    s.write_all(&session(&frame(br#"{"type":"ping","nonce":5}"#)))
        .await
        .unwrap();
    let env = recv(&b).await;
    assert_eq!(env.from.as_str(), "127.0.0.1:1");
    assert_eq!(env.message, ping(5));

    // And real peers are still served.
    let a = TcpControlChannel::bind(cfg()).await.unwrap();
    a.send(&ep, ping(6)).await.unwrap();
    assert_eq!(recv(&b).await.message, ping(6));
}

#[tokio::test]
async fn connections_over_the_limit_are_closed() {
    let b = TcpControlChannel::bind(cfg().with_max_connections(1))
        .await
        .unwrap();
    let ep = b.local_endpoint();
    let a = TcpControlChannel::bind(cfg()).await.unwrap();
    a.send(&ep, ping(1)).await.unwrap();
    recv(&b).await;
    // a holds the only slot: a second peer is turned away with a clear error.
    let c = TcpControlChannel::bind(cfg()).await.unwrap();
    let e = c.send(&ep, ping(2)).await.unwrap_err().to_string();
    assert!(e.contains("connection limit"), "{e}");
    assert_eq!(b.stats().over_limit, 1);
}

#[tokio::test]
async fn idle_connections_are_closed_after_the_bound_and_free_their_slot() {
    let idle = Duration::from_millis(300);
    let b = TcpControlChannel::bind(cfg().with_max_connections(1).with_idle_timeout(idle))
        .await
        .unwrap();
    let ep = b.local_endpoint();
    // A client completes the handshake, then sends nothing: the server closes it (EOF after
    // the verdict) once the bound passes, and counts it.
    let mut s = TcpStream::connect(ep.as_str()).await.unwrap();
    s.write_all(&session(&[])).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .expect("an idle connection is closed by the server")
        .unwrap();
    // Server hello (28 + 32 bytes), then the verdict: accepted, no reason.
    assert_eq!(out.len(), 63, "{out:?}");
    assert!(out.ends_with(&[0, 0, 0]), "accepted, then closed: {out:?}");
    eventually("one idle close", || b.stats().idle_closed == 1).await;
    // Its slot is free again: a real peer gets through.
    let a = TcpControlChannel::bind(cfg()).await.unwrap();
    a.send(&ep, ping(1)).await.unwrap();
    assert_eq!(recv(&b).await.message, ping(1));
}

#[tokio::test]
async fn a_silent_handshake_gives_its_slot_back_at_the_deadline() {
    let b = TcpControlChannel::bind(
        cfg()
            .with_max_connections(1)
            .with_handshake_timeout(Duration::from_millis(300))
            .with_frame_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap();
    let ep = b.local_endpoint();
    // Holds the only slot without ever saying hello.
    let _silent = TcpStream::connect(ep.as_str()).await.unwrap();
    eventually("the silent handshake refused", || b.stats().refused == 1).await;
    let a = TcpControlChannel::bind(cfg()).await.unwrap();
    a.send(&ep, ping(2)).await.unwrap();
    assert_eq!(recv(&b).await.message, ping(2));
}

#[tokio::test]
async fn the_sender_closes_a_quiet_connection_first_and_reconnects_without_loss() {
    let idle = Duration::from_millis(400);
    let a = TcpControlChannel::bind(cfg().with_idle_timeout(idle))
        .await
        .unwrap();
    let b = TcpControlChannel::bind(cfg().with_idle_timeout(idle))
        .await
        .unwrap();
    a.send(&b.local_endpoint(), ping(1)).await.unwrap();
    assert_eq!(recv(&b).await.message, ping(1));
    // After half the bound without a frame a closes its side; b never had to.
    tokio::time::sleep(idle * 3).await;
    for n in 2..50 {
        a.send(&b.local_endpoint(), ping(n)).await.unwrap();
    }
    for n in 2..50 {
        assert_eq!(recv(&b).await.message, ping(n));
    }
    assert_eq!(a.stats().connects, 2, "one reconnect after the idle close");
    assert_eq!(b.stats().idle_closed, 0);
}

/// Writes `bytes` on a fresh raw connection and keeps it open (the caller reads the channel).
async fn raw_open(ep: &Endpoint, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(ep.as_str()).await.unwrap();
    s.write_all(bytes).await.unwrap();
    s
}

#[tokio::test]
async fn peers_of_the_same_major_are_served_whatever_their_minor() {
    let b = TcpControlChannel::bind(cfg()).await.unwrap();
    let ep = b.local_endpoint();
    // Equal: a real channel of this release.
    let a = TcpControlChannel::bind(cfg()).await.unwrap();
    a.send(&ep, ping(1)).await.unwrap();
    assert_eq!(recv(&b).await.message, ping(1));
    // Older minor: a client of minor 0 (a release from before minors: flags' high byte 0).
    let major = TCP_WIRE_VERSION.major;
    let mut old = hello(major, 0, b"127.0.0.1:1");
    old.extend_from_slice(&[0u8; 32]);
    old.extend_from_slice(&frame(br#"{"type":"ping","nonce":2}"#));
    let _old = raw_open(&ep, &old).await;
    assert_eq!(recv(&b).await.message, ping(2));
    // Newer minor: minor 200 in the flags' high byte, a message type this version does not
    // know and a field it does not know; the unknown message is skipped, the next delivered,
    // the connection kept.
    let mut new = hello(major, 200 << 8, b"127.0.0.1:2");
    new.extend_from_slice(&[0u8; 32]);
    new.extend_from_slice(&frame(br#"{"type":"added_in_a_later_minor","x":1}"#));
    new.extend_from_slice(&frame(br#"{"type":"ping","nonce":3,"added_field":true}"#));
    let _new = raw_open(&ep, &new).await;
    let env = recv(&b).await;
    assert_eq!(env.message, ping(3));
    assert_eq!(env.from.as_str(), "127.0.0.1:2");
    assert_eq!(b.stats().unknown_skipped, 1);
    assert_eq!(b.stats().protocol_errors, 0);
    assert_eq!(b.stats().refused, 0);
}

#[tokio::test]
async fn a_newer_major_is_refused_with_a_clear_error() {
    let b = TcpControlChannel::bind(cfg()).await.unwrap();
    let major = TCP_WIRE_VERSION.major;
    let mut v = hello(major + 1, 0, b"127.0.0.1:1");
    v.extend_from_slice(&[0u8; 32]);
    let out = raw(&b.local_endpoint(), &v).await;
    let text = String::from_utf8_lossy(&out);
    let want = format!(
        "the peer speaks {}.0, this side {TCP_WIRE_VERSION}; versions talk only within one major",
        major + 1
    );
    assert!(text.contains(&want), "{text}");
    assert!(text.contains("same major version on both sides"), "{text}");
    eventually("the handshake refused", || b.stats().refused == 1).await;
    assert_eq!(b.stats().accepted, 0);

    // The connecting side refuses a listener of another major too, before it sends a proof.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        // The client hello: head and name length, then the name.
        let mut head = [0u8; 28 + 2];
        s.read_exact(&mut head).await.unwrap();
        let mut name = vec![0u8; usize::from(u16::from_be_bytes([head[28], head[29]]))];
        s.read_exact(&mut name).await.unwrap();
        let mut reply = b"KVBCTRL\0".to_vec();
        reply.extend_from_slice(&(major + 1).to_be_bytes());
        reply.extend_from_slice(&0u16.to_be_bytes());
        reply.extend_from_slice(&[9u8; 16]);
        reply.extend_from_slice(&[0u8; 32]);
        s.write_all(&reply).await.unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest).await;
        rest
    });
    let e = b
        .send(&Endpoint::new(addr.to_string()), ping(1))
        .await
        .unwrap_err();
    assert!(matches!(e, ControlError::Send { .. }), "{e}");
    assert!(e.to_string().contains("version mismatch"), "{e}");
    assert!(
        server.await.unwrap().is_empty(),
        "no proof is sent to a peer of another major"
    );
}
