//! Corpus-driven fuzzing of everything a peer's bytes reach first: seed frames kept in
//! `tests/corpus/` are mutated (bit flips, byte overwrites, truncations, insertions, removals,
//! splices of two seeds, extreme length, count and 64-bit fields) and fed to the sans-IO
//! decoder as a stream, and to a live listener after a real handshake. The decoder never
//! panics, never asks for more than one header plus the frame limit, never keeps more heap
//! than the bytes it consumed justify, and re-encodes what it accepts to the same bytes; the
//! listener never panics, closes every hostile connection, keeps its pending budget, and
//! serves a well-behaved peer afterwards. Case counts are fixed, so a run is bounded.
//!
//! The seeds are regenerated from the codec with
//! `cargo test -p kvbridge-tcp --test frame_fuzz -- --ignored write_corpus`.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use kvbridge_conformance::SplitMix64;
use kvbridge_tcp::wire::{
    self, BeginStatus, CancelStatus, Decoded, Frame, HEADER_LEN, Preface, RegionLen, RegionNeed,
    WireOp, WireRows,
};
use kvbridge_tcp::{TcpConfig, TcpTransport};
use kvbridge_transport::{KvTransport, KvTransportExt, TransferBatch, TransferOp};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Frame limit of the decoder runs (small, so extreme lengths cross it both ways).
const MAX: u32 = 64 << 10;
/// Frames decoded from one mutated stream at most.
const MAX_FRAMES: usize = 64;

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus")
}

/// The seeds, by file name: one of each frame type (with and without optional parts), a
/// stream of several frames with a `Data` payload, and a preface.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let begin = |notification: Option<Bytes>| Frame::Begin {
        batch: 7,
        epoch: 0,
        remaining_ms: 5_000,
        total_bytes: 24,
        regions: vec![
            RegionNeed { region: 1, end: 64 },
            RegionNeed {
                region: 2,
                end: 4096,
            },
        ],
        notification,
        ack: false,
    };
    let data = Frame::Data {
        batch: 7,
        ops: vec![
            WireOp {
                region: 1,
                offset: 0,
                len: 8,
            },
            WireOp {
                region: 2,
                offset: 100,
                len: 16,
            },
        ],
    };
    let mut stream = Frame::Ping { nonce: 1 }.encode();
    stream.extend(begin(Some("room 3".into())).encode());
    stream.extend(data.encode());
    stream.extend([0x5a; 24]);
    stream.extend(Frame::Cancel { batch: 7 }.encode());
    let frames = [
        (
            "hello.bin",
            Frame::Hello {
                session: 42,
                conn_index: 1,
                conn_count: 2,
                keepalive_ms: 1000,
                mac: None,
            },
        ),
        (
            "hello_mac.bin",
            Frame::Hello {
                session: 42,
                conn_index: 0,
                conn_count: 1,
                keepalive_ms: 1000,
                mac: Some([0xab; 32]),
            },
        ),
        ("welcome.bin", Frame::Welcome { mac: None }),
        ("welcome_mac.bin", Frame::Welcome { mac: Some([3; 32]) }),
        (
            "error.bin",
            Frame::Error {
                code: 14,
                message: "refused a write from the peer".into(),
            },
        ),
        ("ping.bin", Frame::Ping { nonce: 9 }),
        ("pong.bin", Frame::Pong { nonce: 9 }),
        ("begin.bin", begin(None)),
        ("begin_note.bin", begin(Some("chunk 0 of room 12".into()))),
        (
            "begin_ack.bin",
            Frame::BeginAck {
                batch: 7,
                status: BeginStatus::RegionRefused,
                regions: vec![
                    RegionLen {
                        region: 1,
                        len: Some(64),
                    },
                    RegionLen {
                        region: 2,
                        len: None,
                    },
                ],
            },
        ),
        (
            "regions.bin",
            Frame::Regions {
                last: true,
                regions: vec![
                    RegionLen {
                        region: 1,
                        len: Some(4096),
                    },
                    RegionLen {
                        region: 3,
                        len: None,
                    },
                ],
            },
        ),
        ("data.bin", data),
        (
            "rows.bin",
            Frame::Rows {
                batch: 7,
                ops: vec![
                    WireRows {
                        region: 2,
                        offset: 0,
                        len: 4,
                        rows: 3,
                        stride: 16,
                    },
                    WireRows {
                        region: 1,
                        offset: 8,
                        len: 8,
                        rows: 1,
                        stride: 8,
                    },
                ],
            },
        ),
        ("done.bin", Frame::Done { batch: 7 }),
        ("cancel.bin", Frame::Cancel { batch: 7 }),
        (
            "cancel_ack.bin",
            Frame::CancelAck {
                batch: 7,
                status: CancelStatus::NotPending,
            },
        ),
    ];
    let mut out: Vec<_> = frames.into_iter().map(|(n, f)| (n, f.encode())).collect();
    out.push(("stream.bin", stream));
    let preface = Preface {
        version: wire::VERSION,
        flags: wire::FLAG_SECRET,
        nonce: [0x11; 32],
    };
    out.push(("preface.bin", preface.encode().to_vec()));
    out
}

/// The corpus as kept in the repository (frame seeds only; the preface seed separately).
fn corpus() -> Vec<Vec<u8>> {
    let mut names: Vec<_> = std::fs::read_dir(corpus_dir())
        .expect("tests/corpus is missing")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .filter(|p| !p.ends_with("preface.bin"))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect()
}

fn preface_seed() -> Vec<u8> {
    std::fs::read(corpus_dir().join("preface.bin")).unwrap()
}

#[test]
#[ignore = "rewrites tests/corpus from the codec"]
fn write_corpus() {
    std::fs::create_dir_all(corpus_dir()).unwrap();
    for (name, bytes) in seeds() {
        std::fs::write(corpus_dir().join(name), bytes).unwrap();
    }
}

#[test]
fn the_corpus_is_the_codecs_current_encoding() {
    // A codec change that alters the seeds must regenerate them (see the module docs).
    for (name, bytes) in seeds() {
        let kept = std::fs::read(corpus_dir().join(name))
            .unwrap_or_else(|e| panic!("tests/corpus/{name}: {e}"));
        assert_eq!(kept, bytes, "tests/corpus/{name} is stale");
    }
    assert_eq!(
        corpus().len() + 1,
        seeds().len(),
        "unknown files in tests/corpus"
    );
}

/// Values that sit on or around every limit a length, count or 64-bit field meets.
const EXTREMES_32: [u32; 10] = [
    0,
    1,
    16,
    MAX - 1,
    MAX,
    MAX + 1,
    wire::WIRE_MAX_FRAME_LEN,
    wire::WIRE_MAX_FRAME_LEN + 1,
    u32::MAX / 24 + 1,
    u32::MAX,
];
const EXTREMES_64: [u64; 6] = [0, 1, u32::MAX as u64, 1 << 63, u64::MAX - 1, u64::MAX];

#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(usize, u8),
    SetByte(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    /// This input up to the first index, then another seed from the second.
    Splice(usize, usize, usize),
    /// The header's body length, to an extreme (or off by one from the true length).
    SetLen(usize),
    /// The descriptor or connection count of the first frame, to an extreme.
    SetCount(usize),
    /// An 8-byte big-endian field at an offset, to an extreme.
    SetU64(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Mutation::SetByte(i, v)),
        any::<usize>().prop_map(Mutation::Truncate),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), 1usize..32).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (any::<usize>(), any::<usize>(), any::<usize>())
            .prop_map(|(s, a, b)| Mutation::Splice(s, a, b)),
        (0usize..EXTREMES_32.len() + 2).prop_map(Mutation::SetLen),
        (0usize..EXTREMES_32.len()).prop_map(Mutation::SetCount),
        (any::<usize>(), 0usize..EXTREMES_64.len()).prop_map(|(i, v)| Mutation::SetU64(i, v)),
    ]
}

fn mutate(corpus: &[Vec<u8>], mut bytes: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        let n = bytes.len();
        match m {
            Mutation::FlipBit(i, b) if n > 0 => bytes[i % n] ^= 1 << b,
            Mutation::SetByte(i, v) if n > 0 => bytes[i % n] = *v,
            Mutation::Truncate(i) => bytes.truncate(i % (n + 1)),
            Mutation::Insert(i, b) => {
                let at = i % (n + 1);
                bytes.splice(at..at, b.iter().copied());
            }
            Mutation::Remove(i, k) if n > 0 => {
                let at = i % n;
                bytes.drain(at..(at + k).min(n));
            }
            Mutation::Splice(s, a, b) => {
                let other = &corpus[s % corpus.len()];
                bytes.truncate(a % (n + 1));
                bytes.extend_from_slice(&other[b % (other.len() + 1)..]);
            }
            Mutation::SetLen(k) if n >= HEADER_LEN => {
                let real = (n - HEADER_LEN) as u32;
                let len = match k.checked_sub(2) {
                    None if *k == 0 => real.wrapping_sub(1),
                    None => real + 1,
                    Some(k) => EXTREMES_32[k],
                };
                bytes[4..8].copy_from_slice(&len.to_be_bytes());
            }
            Mutation::SetCount(k) => {
                // Where each counted frame keeps its count (docs/tcp-protocol.md).
                let at = match bytes.first().copied().and_then(wire::FrameType::from_u8) {
                    Some(wire::FrameType::Begin) => HEADER_LEN + 24,
                    Some(wire::FrameType::BeginAck) => HEADER_LEN + 9,
                    Some(wire::FrameType::Data | wire::FrameType::Rows) => HEADER_LEN + 8,
                    _ => continue,
                };
                if n >= at + 4 {
                    bytes[at..at + 4].copy_from_slice(&EXTREMES_32[*k].to_be_bytes());
                }
            }
            Mutation::SetU64(i, v) if n >= 8 => {
                let at = i % (n - 7);
                bytes[at..at + 8].copy_from_slice(&EXTREMES_64[*v].to_be_bytes());
            }
            _ => {}
        }
    }
    bytes
}

/// Heap bytes a decoded frame keeps (by capacity: what was actually allocated for it).
fn kept_bytes(f: &Frame) -> usize {
    match f {
        Frame::Begin {
            regions,
            notification,
            ..
        } => {
            regions.capacity() * size_of::<RegionNeed>()
                + notification.as_ref().map_or(0, Bytes::len)
        }
        Frame::BeginAck { regions, .. } | Frame::Regions { regions, .. } => {
            regions.capacity() * size_of::<RegionLen>()
        }
        Frame::Data { ops, .. } => ops.capacity() * size_of::<WireOp>(),
        Frame::Rows { ops, .. } => ops.capacity() * size_of::<WireRows>(),
        Frame::Error { message, .. } => message.capacity(),
        _ => 0,
    }
}

/// Decodes `buf` as a stream, frame after frame (skipping `Data` payloads), checking every
/// result; returns how many frames were accepted.
fn drive(buf: &[u8]) -> Result<usize, TestCaseError> {
    let mut at = 0;
    let mut frames = 0;
    while at < buf.len() && frames < MAX_FRAMES {
        let rest = &buf[at..];
        match wire::decode_frame(rest, MAX) {
            Err(e) => {
                // Every refusal has a code for the Error frame and explains itself.
                prop_assert!((1..=16).contains(&e.code()), "code {} for {e}", e.code());
                prop_assert!(!e.to_string().is_empty());
                break;
            }
            Ok(Decoded::NeedMore(n)) => {
                prop_assert!(n > rest.len(), "NeedMore({n}) with {} bytes", rest.len());
                prop_assert!(n <= HEADER_LEN + MAX as usize, "asked for {n} bytes");
                break;
            }
            Ok(Decoded::Frame(f, used)) => {
                prop_assert!((HEADER_LEN..=rest.len()).contains(&used));
                // What it keeps is bounded by what it consumed (at most 1.5x: a BeginAck's
                // optional lengths), so never beyond the frame limit.
                let kept = kept_bytes(&f);
                prop_assert!(kept * 2 <= used * 3, "{kept} bytes kept from {used}");
                let canonical = !matches!(&f, Frame::Error { message, .. }
                    if message.len() > wire::MAX_ERROR_TEXT);
                if canonical {
                    prop_assert_eq!(&f.encode()[..], &rest[..used]);
                }
                let payload = usize::try_from(f.payload_len()).unwrap_or(usize::MAX);
                at += used;
                at = at.saturating_add(payload);
                frames += 1;
            }
        }
    }
    Ok(frames)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn mutated_corpus_streams_decode_safely(
        seed in any::<usize>(),
        muts in proptest::collection::vec(mutation(), 1..6),
    ) {
        let corpus = corpus();
        let input = mutate(&corpus, corpus[seed % corpus.len()].clone(), &muts);
        drive(&input)?;
    }

    #[test]
    fn mutated_prefaces_decode_safely(muts in proptest::collection::vec(mutation(), 1..4)) {
        let bytes = mutate(&[preface_seed()], preface_seed(), &muts);
        let Some(raw) = bytes.first_chunk::<{ wire::PREFACE_LEN }>() else {
            return Ok(());
        };
        if let Ok(p) = Preface::decode(raw) {
            // Only what version 1 allows is accepted.
            prop_assert_eq!(p.version, wire::VERSION);
            prop_assert_eq!(p.flags & !wire::FLAG_SECRET, 0);
            prop_assert_eq!(&p.encode()[..], &raw[..]);
        }
    }
}

#[test]
fn every_seed_decodes_whole() {
    for seed in corpus() {
        let frames = drive(&seed).unwrap();
        assert!(frames >= 1, "a seed did not decode: {seed:02x?}");
    }
}

/// One random mutation, from a fixed-seed generator (same inputs every run).
fn random_mutation(rng: &mut SplitMix64) -> Mutation {
    let r = rng.next_u64() as usize;
    let s = rng.next_u64() as usize;
    match rng.next_u64() % 9 {
        0 => Mutation::FlipBit(r, (s % 8) as u8),
        1 => Mutation::SetByte(r, s as u8),
        2 => Mutation::Truncate(r),
        3 => Mutation::Insert(r, vec![s as u8; 1 + s % 8]),
        4 => Mutation::Remove(r, 1 + s % 16),
        5 => Mutation::Splice(r, s, rng.next_u64() as usize),
        6 => Mutation::SetLen(r % (EXTREMES_32.len() + 2)),
        7 => Mutation::SetCount(r % EXTREMES_32.len()),
        _ => Mutation::SetU64(r, s % EXTREMES_64.len()),
    }
}

/// Connects with a correct handshake (no secret), then sends `stream` and half-closes;
/// returns once the listener has closed the connection.
async fn hostile(addr: std::net::SocketAddr, session: u64, stream: Vec<u8>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let preface = Preface {
        version: wire::VERSION,
        flags: 0,
        nonce: [9; 32],
    };
    s.write_all(&preface.encode()).await.unwrap();
    let hello = Frame::Hello {
        session,
        conn_index: 0,
        conn_count: 1,
        keepalive_ms: 100,
        mac: None,
    };
    s.write_all(&hello.encode()).await.unwrap();
    // The listener may close before it has read everything; that is one of the answers.
    let _ = s.write_all(&stream).await;
    let _ = s.shutdown().await;
    let mut sink = vec![0u8; 1 << 16];
    loop {
        match s.read(&mut sink).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_listener_survives_mutated_corpus_streams() {
    let config = TcpConfig::default()
        .with_keepalive_interval(Duration::from_millis(100))
        .with_keepalive_timeout(Duration::from_millis(500))
        .with_max_frame_len(MAX)
        .with_max_inbound_pending_bytes(256 << 10);
    let t = TcpTransport::bind(config).await.unwrap();
    // Regions 1 and 2, as the seeds address them.
    let (first, _) = t.allocate_registered(64).await.unwrap();
    let (_, _) = t.allocate_registered(4096).await.unwrap();
    let corpus = corpus();
    let mut rng = SplitMix64::new(0x9e37_79b9_7f4a_7c15);
    let mut cases = Vec::new();
    for case in 0..48u64 {
        // Each case: a few seeds back to back, then a few mutations of the whole.
        let mut stream = Vec::new();
        for _ in 0..1 + rng.next_u64() % 4 {
            stream.extend_from_slice(&corpus[rng.next_u64() as usize % corpus.len()]);
        }
        let muts: Vec<_> = (0..1 + rng.next_u64() % 4)
            .map(|_| random_mutation(&mut rng))
            .collect();
        let stream = mutate(&corpus, stream, &muts);
        cases.push(tokio::spawn(hostile(t.local_addr(), 1000 + case, stream)));
    }
    for case in cases {
        tokio::time::timeout(Duration::from_secs(30), case)
            .await
            .expect("the listener kept a hostile connection open")
            .expect("a hostile client failed");
    }
    let (_, peak) = t.inbound_pending_stats();
    assert!(peak <= 256 << 10, "a peer was charged {peak} bytes");
    // A well-behaved peer is still served.
    let good = TcpTransport::new().await.unwrap();
    let (src, src_mem) = good.allocate_registered(8).await.unwrap();
    src_mem.write_at(0, b"survived").unwrap();
    let peer = good.connect(&t.local_descriptor()).await.unwrap();
    let op = TransferOp::new(src, 0, first, 0, 8);
    tokio::time::timeout(
        Duration::from_secs(10),
        good.transfer(peer, TransferBatch::write(vec![op])),
    )
    .await
    .unwrap()
    .unwrap();
}
