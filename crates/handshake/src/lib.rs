//! kvbridge-handshake: what prefill and decode ranks advertise, every compatibility check
//! between them, and the rank mapping. Sans-IO: no sockets, no files, no clocks.
//!
//! * [`PeerDescriptor`] — one rank's advertised parameters (JSON, versioned, strict).
//! * [`check`] / [`check_with`] — every problem at once, each with a stable code
//!   ([`ProblemCode`], e.g. `KVB-E007`), the message (SGLang's text where it has one), the
//!   values seen and a remedy; plus the [`RankMapping`] when compatible.
//! * [`Compat`] — `Kvbridge` (default: what kvbridge's planner supports, a superset of SGLang)
//!   or `Sglang` (exactly SGLang 0.5.23's envelope).
//! * [`sglang_rank_mapping`] — SGLang's rank mapping, rule for rule (spec 02 §6).
//! * [`fingerprint`] / [`fingerprint_diff`] — a stable hash for a cheap equality fast path, and
//!   the field-by-field explanation of a mismatch.
//! * [`MAX_PAGE_SIZE`], [`MAX_GROUP_SIZE`], [`MAX_DEPLOYMENT_RANKS`] and the other maxima —
//!   what a descriptor may claim; `check` reports larger values as `KVB-E033` before it works
//!   with them.
//! * [`catalog`] / [`explain`] — the long explanations behind `kvbridge explain` and
//!   `docs/errors.md`.
//!
//! ```
//! use kvbridge_handshake::{check, PeerDescriptor, ProblemCode};
//! let prefill: PeerDescriptor = r#"{"role": "prefill", "page_size": 64, "kv_cache_dtype": "auto",
//!     "kv_pool": "mha", "attn_tp_size": 4, "total_kv_heads": 8, "head_dim": 128,
//!     "kv_item_lens": [65536, 65536]}"#.parse()?;
//! let decode: PeerDescriptor = r#"{"role": "decode", "page_size": 64, "kv_cache_dtype": "auto",
//!     "kv_pool": "mha", "attn_tp_size": 4, "dcp_size": 2, "total_kv_heads": 8, "head_dim": 128,
//!     "kv_item_lens": [65536, 65536]}"#.parse()?;
//! let report = check(&prefill, &decode);
//! assert!(!report.is_compatible());
//! assert_eq!(report.problems[0].code, ProblemCode::DcpNeedsMlaPool);
//! assert_eq!(report.problems[0].message, "PD decode DCP requires an MLA or hybrid-MLA KV pool.");
//! # Ok::<(), kvbridge_handshake::HandshakeError>(())
//! ```

#![forbid(unsafe_code)]

mod catalog;
mod check;
mod descriptor;
mod error;
mod fingerprint;
mod limits;
mod mapping;
mod problem;

pub use check::{
    CheckOptions, Compat, RankReport, Report, check, check_all_ranks, check_with, dtype_bytes,
    rank_mapping,
};
pub use descriptor::{PeerDescriptor, ProtocolVersion, Role};
pub use error::{HandshakeError, Result};
pub use fingerprint::{
    FieldDiff, Fingerprint, canonical_encoding, compat_fields, fingerprint, fingerprint_diff,
    fnv1a64,
};
pub use kvbridge_geometry::PoolKind;
pub use limits::{
    MAX_AUX_BUFFERS, MAX_DEPLOYMENT_RANKS, MAX_ENTRIES, MAX_GROUP_SIZE, MAX_HEAD_DIM, MAX_ITEM_LEN,
    MAX_KV_HEADS, MAX_PAGE_SIZE,
};
pub use mapping::{
    HeadRange, MappingInput, PeerTarget, RankMapping, TargetRanks, TransferPath, bootstrap_order,
    prefill_unique_rank, sglang_is_dummy, sglang_rank_mapping,
};
pub use problem::{
    DetectedBy, Problem, ProblemCode, ProblemInfo, Severity, catalog, catalog_markdown, explain,
};
