//! Fuzzing descriptor JSON: seeds from `tests/corpus/*.json` (one descriptor each), mutated by
//! setting fields to extremes, bit flips and truncations, then parsed and checked against each
//! other. Never a panic, an abort or a hang: a parse error or a report, and a report names
//! every problem with a code and a remedy. Each case is bounded by construction (descriptors of
//! a few KiB; every size above its maximum is refused before work), and the case count keeps
//! the run to seconds.

use std::path::PathBuf;

use kvbridge_handshake::{
    CheckOptions, Compat, HandshakeError, MAX_DEPLOYMENT_RANKS, PeerDescriptor, check_all_ranks,
    check_with, fingerprint_diff,
};
use proptest::prelude::*;
use serde_json::{Value, json};

/// The case count: `default`, or `PROPTEST_CASES` for a longer run.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn corpus() -> Vec<String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/corpus exists")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    let seeds: Vec<String> = files
        .iter()
        .map(|p| std::fs::read_to_string(p).expect("seed"))
        .collect();
    assert!(
        seeds.len() >= 10 && seeds.len() % 2 == 0,
        "the corpus holds the example descriptor pairs"
    );
    seeds
}

/// Every descriptor field (as serialised from a seed with every optional field set), integer
/// fields first, then one that does not exist; and how many are integer fields.
fn fields(seeds: &[String]) -> (Vec<String>, usize) {
    let full = seeds
        .iter()
        .filter_map(|s| PeerDescriptor::from_json(s).ok())
        .find(|d| d.total_kv_heads.is_some() && d.head_dim.is_some())
        .expect("an MHA seed");
    let Value::Object(o) = serde_json::to_value(full).expect("serialise") else {
        unreachable!("a descriptor serialises to an object")
    };
    let (mut ints, rest): (Vec<_>, Vec<_>) =
        o.into_iter().partition(|(_, v)| v.is_u64() || v.is_array());
    let n = ints.len();
    ints.extend(rest);
    let mut names: Vec<String> = ints.into_iter().map(|(k, _)| k).collect();
    names.push("no_such_field".to_owned());
    (names, n)
}

/// Extreme values: integer edges, wrong types, and arrays longer than any maximum.
fn extreme(i: usize) -> Value {
    match i % 16 {
        0 => json!(0),
        1 => json!(1),
        2 => json!(1u64 << 31),
        3 => json!(1u64 << 32),
        4 => json!(u32::MAX),
        5 => json!(1u64 << 62),
        6 => json!(u64::MAX),
        7 => json!(-1),
        8 => json!(1.5),
        9 => json!("x"),
        10 => Value::Null,
        11 => json!(true),
        12 => json!([]),
        13 => json!(vec![64u64; 5000]),
        14 => json!(vec![u64::MAX; 70]),
        _ => json!({"a": 1}),
    }
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Set field `f` (an index into `fields`, modulo) to `extreme(v)`; integer fields only
    /// unless `any`.
    Field(bool, usize, usize),
    /// Set element `i` of `kv_item_lens` (or `aux_item_lens`) to `extreme(v)`.
    Item(bool, usize, usize),
    /// Flip bit `bit` of byte `pos` (modulo the length).
    Flip(usize, u8),
    /// Keep the first `pos` bytes (modulo the length).
    Truncate(usize),
}

/// Mostly integer extremes on the integer fields (which still parse, so `check` sees them),
/// sometimes anything anywhere, bit flips and truncations (which mostly exercise the parser).
fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        6 => (any::<usize>(), 0..7usize).prop_map(|(f, v)| Mutation::Field(false, f, v)),
        1 => (any::<usize>(), 0..16usize).prop_map(|(f, v)| Mutation::Field(true, f, v)),
        3 => (any::<bool>(), 0..80usize, 0..7usize).prop_map(|(a, i, v)| Mutation::Item(a, i, v)),
        1 => (0..16usize).prop_map(|v| Mutation::Item(false, 0, v)),
        2 => (any::<usize>(), 0..8u8).prop_map(|(p, b)| Mutation::Flip(p, b)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn apply(text: &str, m: &Mutation, (fields, ints): &(Vec<String>, usize)) -> String {
    match *m {
        Mutation::Field(any, f, v) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(mut o)) => {
                let name = &fields[f % if any { fields.len() } else { *ints }];
                o.insert(name.clone(), extreme(v));
                Value::Object(o).to_string()
            }
            _ => text.to_owned(),
        },
        Mutation::Item(aux, i, v) => match serde_json::from_str::<Value>(text) {
            Ok(mut d) => {
                let key = if aux { "aux_item_lens" } else { "kv_item_lens" };
                if let Some(list) = d.get_mut(key).and_then(Value::as_array_mut) {
                    if !list.is_empty() {
                        let n = list.len();
                        list[i % n] = extreme(v);
                    }
                }
                d.to_string()
            }
            Err(_) => text.to_owned(),
        },
        Mutation::Flip(pos, bit) => {
            let mut bytes = text.as_bytes().to_vec();
            if !bytes.is_empty() {
                let n = bytes.len();
                bytes[pos % n] ^= 1 << bit;
            }
            String::from_utf8_lossy(&bytes).into_owned()
        }
        Mutation::Truncate(pos) => {
            let bytes = text.as_bytes();
            let cut = pos % (bytes.len() + 1);
            String::from_utf8_lossy(&bytes[..cut]).into_owned()
        }
    }
}

fn mutated(seeds: &[String], seed: usize, ms: &[Mutation]) -> String {
    let fields = fields(seeds);
    ms.iter().fold(seeds[seed % seeds.len()].clone(), |t, m| {
        apply(&t, m, &fields)
    })
}

/// A parse result is a descriptor or an error that says where and what.
fn parse(text: &str) -> Option<PeerDescriptor> {
    match PeerDescriptor::from_json(text) {
        Ok(d) => Some(d),
        Err(e @ HandshakeError::Json { .. }) => {
            let msg = e.to_string();
            assert!(msg.starts_with("invalid peer descriptor at line "), "{msg}");
            assert!(msg.contains("docs/errors.md"), "{msg}");
            None
        }
        Err(e @ HandshakeError::UnsupportedProtocolVersion { .. }) => {
            assert!(e.to_string().contains("upgrade kvbridge"), "{e}");
            None
        }
        Err(e) => panic!("unexpected parse error kind: {e}"),
    }
}

fn check_pair(p: &PeerDescriptor, d: &PeerDescriptor) {
    let _ = fingerprint_diff(p, d);
    for compat in [Compat::Kvbridge, Compat::Sglang] {
        let opts = CheckOptions::new(compat);
        let r = check_with(p, d, &opts);
        for pr in r.problems.iter().chain(&r.warnings) {
            assert!(pr.code.as_str().starts_with("KVB-"));
            assert!(!pr.message.is_empty() && !pr.remedy.is_empty(), "{pr}");
        }
        // Compatible means a mapping, and the mapping is bounded by the deployment maximum.
        assert_eq!(r.is_compatible(), r.mapping.is_some(), "{:?}", r.problems);
        if let Some(m) = &r.mapping {
            assert!(m.peers.len() as u64 <= MAX_DEPLOYMENT_RANKS);
        }
        if !r.is_compatible() {
            assert!(r.into_result().unwrap_err().to_string().contains("KVB-E"));
        }
        // `--all-ranks` work is one check per decode rank: bounded here to keep cases short.
        if u64::from(d.attn_tp_size) * u64::from(d.pp_size) <= 64 {
            let _ = check_all_ranks(p, d, &opts);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(384)))]

    #[test]
    fn mutated_descriptors_parse_or_fail_cleanly_and_check_without_panics(
        pair in any::<usize>(),
        other in prop::option::of(any::<usize>()),
        ma in prop::collection::vec(mutation(), 0..3),
        mb in prop::collection::vec(mutation(), 0..3),
    ) {
        let seeds = corpus();
        // Seeds come in pairs (`NAME.decode.json`, `NAME.prefill.json`): mostly a prefill with
        // its own decode, so that mutations hit pairs that were compatible; sometimes any two.
        let k = pair % (seeds.len() / 2);
        let decode = other.unwrap_or(2 * k);
        let (pa, pb) = (mutated(&seeds, 2 * k + 1, &ma), mutated(&seeds, decode, &mb));
        if let (Some(p), Some(d)) = (parse(&pa), parse(&pb)) {
            check_pair(&p, &d);
            check_pair(&d, &p);
        }
    }
}

/// Every seed parses, and each example pair checks as it does in the examples.
#[test]
fn the_corpus_parses() {
    for s in corpus() {
        assert!(parse(&s).is_some(), "{s}");
    }
}
