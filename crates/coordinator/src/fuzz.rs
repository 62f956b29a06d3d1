//! Mutation fuzzing for the decoders a peer reaches (test-only): kvbridge-control's kit over
//! this crate's corpus (`tests/corpus/<name>/`); the harness in `bootstrap::server` feeds the
//! results to the real decoding code. docs/TESTING.md describes them.

use std::path::Path;

pub(crate) use kvbridge_control::fuzz::{config, mutated, peer_sent, runtime};

/// Every seed file of this crate's corpus `name`, sorted by file name.
pub(crate) fn corpus(name: &str) -> Vec<Vec<u8>> {
    kvbridge_control::fuzz::corpus_in(Path::new(env!("CARGO_MANIFEST_DIR")), name)
}
