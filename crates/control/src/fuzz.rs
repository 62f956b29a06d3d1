//! Mutation fuzzing for the decoders a peer reaches (test-only): seeds from the corpus kept in
//! `tests/corpus/<name>/`, mutated by bit flips, byte overwrites, truncations, splices of two
//! seeds, inserted random bytes, or replaced by random bytes; the harnesses in `tcp` (here)
//! and in kvbridge-bootstrap's `server` (which compiles this same file) feed the results to
//! the real decoders. docs/TESTING.md describes them.

use std::path::Path;

use proptest::prelude::*;

/// Cases per harness: `PROPTEST_CASES` if set, else 1024 (about a second in a debug build).
pub(crate) fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Every seed file of corpus `name`, sorted by file name.
pub(crate) fn corpus(name: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
        .join(name);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {} is missing: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let seeds: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    assert!(!seeds.is_empty(), "corpus {} is empty", dir.display());
    seeds
}

#[derive(Debug, Clone)]
enum Edit {
    FlipBit(usize, u8),
    SetByte(usize, u8),
    Truncate(usize),
    /// This input up to the first offset, then the other seed from the second.
    Splice(usize, usize, usize),
    Insert(usize, Vec<u8>),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(p, b)| Edit::FlipBit(p, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(p, v)| Edit::SetByte(p, v)),
        any::<usize>().prop_map(Edit::Truncate),
        (any::<usize>(), any::<usize>(), any::<usize>())
            .prop_map(|(s, a, b)| Edit::Splice(s, a, b)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(p, v)| Edit::Insert(p, v)),
    ]
}

/// Inputs derived from `seeds`: a seed under 1..=6 edits, or (one case in eight) random bytes.
pub(crate) fn mutated(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds.len();
    let edited = (0..n, prop::collection::vec(edit(), 1..=6)).prop_map(move |(i, edits)| {
        let mut v = seeds[i].clone();
        for e in edits {
            let at = |p: usize, len: usize| if len == 0 { 0 } else { p % len };
            match e {
                Edit::FlipBit(p, b) if !v.is_empty() => {
                    let p = at(p, v.len());
                    v[p] ^= 1 << b;
                }
                Edit::SetByte(p, x) if !v.is_empty() => {
                    let p = at(p, v.len());
                    v[p] = x;
                }
                Edit::Truncate(p) => v.truncate(at(p, v.len() + 1)),
                Edit::Splice(s, a, b) => {
                    let other = &seeds[s % n];
                    v.truncate(at(a, v.len() + 1));
                    v.extend_from_slice(&other[at(b, other.len() + 1)..]);
                }
                Edit::Insert(p, bytes) => {
                    let p = at(p, v.len() + 1);
                    v.splice(p..p, bytes);
                }
                _ => {}
            }
        }
        v
    });
    prop_oneof![
        7 => edited,
        1 => prop::collection::vec(any::<u8>(), 0..512),
    ]
}

/// A current-thread runtime for a harness (one per test, not per case).
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// An in-memory connection whose peer sent `input` and then closed its sending side: `(peer,
/// ours)`. Keep `peer` alive while using `ours` (it holds what `ours` writes, without
/// blocking).
pub(crate) async fn peer_sent(input: &[u8]) -> (tokio::io::DuplexStream, tokio::io::DuplexStream) {
    use tokio::io::AsyncWriteExt;
    let (mut peer, ours) = tokio::io::duplex(input.len() + 64 * 1024);
    peer.write_all(input).await.unwrap();
    peer.shutdown().await.unwrap();
    (peer, ours)
}
