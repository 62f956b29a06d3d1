//! Property tests driving random and mutated byte streams at the sans-IO decoder: it never
//! panics, never claims more bytes than it was given, never asks for more than one header plus
//! the frame limit, and whatever it accepts re-encodes to exactly the bytes it consumed.

use bytes::Bytes;
use kvbridge_tcp::wire::{
    self, BeginStatus, CancelStatus, Decoded, Frame, HEADER_LEN, RegionLen, RegionNeed, WireOp,
};
use proptest::prelude::*;

const MAX: u32 = 64 << 10;

fn op() -> impl Strategy<Value = WireOp> {
    // Valid descriptors: offset + len and the frame's total fit in 64 bits.
    (any::<u64>(), 0..1u64 << 56, 0..1u64 << 56).prop_map(|(region, offset, len)| WireOp {
        region,
        offset,
        len,
    })
}

fn mac() -> impl Strategy<Value = Option<[u8; 32]>> {
    proptest::option::of(any::<[u8; 32]>())
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (any::<u64>(), 1u16..8, any::<u32>(), mac()).prop_map(|(session, count, ka, mac)| {
            Frame::Hello {
                session,
                conn_index: count - 1,
                conn_count: count,
                keepalive_ms: ka,
                mac,
            }
        }),
        mac().prop_map(|mac| Frame::Welcome { mac }),
        (any::<u16>(), "[a-z ]{0,40}").prop_map(|(code, message)| Frame::Error { code, message }),
        any::<u64>().prop_map(|nonce| Frame::Ping { nonce }),
        any::<u64>().prop_map(|nonce| Frame::Pong { nonce }),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec((any::<u64>(), any::<u64>()), 0..6),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
            (any::<u64>(), any::<bool>()),
        )
            .prop_map(
                |(batch, remaining_ms, total_bytes, regions, note, (epoch, ack))| Frame::Begin {
                    batch,
                    epoch,
                    remaining_ms,
                    total_bytes,
                    regions: regions
                        .into_iter()
                        .map(|(region, end)| RegionNeed { region, end })
                        .collect(),
                    notification: note.map(Bytes::from),
                    ack,
                }
            ),
        (
            any::<u64>(),
            0u8..3,
            proptest::collection::vec((any::<u64>(), proptest::option::of(0..u64::MAX)), 0..6)
        )
            .prop_map(|(batch, status, regions)| Frame::BeginAck {
                batch,
                status: [
                    BeginStatus::Accepted,
                    BeginStatus::RegionRefused,
                    BeginStatus::Busy
                ][usize::from(status)],
                regions: regions
                    .into_iter()
                    .map(|(region, len)| RegionLen { region, len })
                    .collect(),
            }),
        (any::<u64>(), proptest::collection::vec(op(), 1..8))
            .prop_map(|(batch, ops)| Frame::Data { batch, ops }),
        any::<u64>().prop_map(|batch| Frame::Done { batch }),
        any::<u64>().prop_map(|batch| Frame::Cancel { batch }),
        (any::<u64>(), any::<bool>()).prop_map(|(batch, done)| Frame::CancelAck {
            batch,
            status: if done {
                CancelStatus::NotPending
            } else {
                CancelStatus::Dropped
            },
        }),
    ]
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, u8),
    SetLen(u32),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(i, x)| Mutation::Flip(i, x)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<u32>().prop_map(Mutation::SetLen),
    ]
}

fn mutate(mut bytes: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        match *m {
            Mutation::Flip(i, x) if !bytes.is_empty() => {
                let i = i % bytes.len();
                bytes[i] ^= x;
            }
            Mutation::Truncate(i) => bytes.truncate(i % (bytes.len() + 1)),
            Mutation::Insert(i, b) => {
                let i = i % (bytes.len() + 1);
                bytes.insert(i, b);
            }
            Mutation::SetLen(len) if bytes.len() >= HEADER_LEN => {
                bytes[4..8].copy_from_slice(&len.to_be_bytes());
            }
            _ => {}
        }
    }
    bytes
}

/// The invariants every decode result must satisfy.
fn check(buf: &[u8]) -> Result<(), TestCaseError> {
    match wire::decode_frame(buf, MAX) {
        Err(e) => {
            // Every refusal explains itself.
            prop_assert!(!e.to_string().is_empty());
        }
        Ok(Decoded::NeedMore(n)) => {
            prop_assert!(n > buf.len(), "NeedMore({n}) with {} bytes", buf.len());
            prop_assert!(n <= HEADER_LEN + MAX as usize, "asked for {n} bytes");
        }
        Ok(Decoded::Frame(f, used)) => {
            prop_assert!(used <= buf.len());
            prop_assert!(used >= HEADER_LEN);
            if let Frame::Data { ops, .. } = &f {
                // Descriptors never outnumber what the body can hold.
                prop_assert!(ops.len() * wire::OP_LEN < used);
                // Accepted lengths never overflow.
                let mut total = 0u64;
                for op in ops {
                    prop_assert!(op.offset.checked_add(op.len).is_some());
                    total = total.checked_add(op.len).expect("payload length overflows");
                }
                prop_assert_eq!(total, f.payload_len());
            }
            let canonical =
                !matches!(&f, Frame::Error { message, .. } if message.len() > wire::MAX_ERROR_TEXT);
            if canonical {
                prop_assert_eq!(&f.encode()[..], &buf[..used]);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..256)) {
        check(&buf)?;
    }

    #[test]
    fn random_bytes_after_a_valid_header_never_panic(
        ty in 0u8..16,
        len in 0u32..512,
        body in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut buf = vec![ty, 0, 0, 0];
        buf.extend_from_slice(&len.to_be_bytes());
        buf.extend_from_slice(&body);
        check(&buf)?;
    }

    #[test]
    fn valid_frames_round_trip(f in frame()) {
        let bytes = f.encode();
        prop_assert_eq!(wire::decode_frame(&bytes, MAX).unwrap(), Decoded::Frame(f, bytes.len()));
    }

    #[test]
    fn mutated_frames_never_panic(f in frame(), muts in proptest::collection::vec(mutation(), 1..4)) {
        let bytes = mutate(f.encode(), &muts);
        check(&bytes)?;
    }

    #[test]
    fn concatenated_frames_decode_one_by_one(fs in proptest::collection::vec(frame(), 1..5)) {
        let mut stream = Vec::new();
        for f in &fs {
            stream.extend_from_slice(&f.encode());
        }
        let mut at = 0;
        for f in fs {
            match wire::decode_frame(&stream[at..], MAX).unwrap() {
                Decoded::Frame(got, used) => {
                    prop_assert_eq!(got, f);
                    at += used;
                }
                other => prop_assert!(false, "expected a frame, got {other:?}"),
            }
        }
        prop_assert_eq!(at, stream.len());
    }
}
