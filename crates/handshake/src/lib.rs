//! kvbridge-handshake: what prefill and decode ranks advertise, every compatibility check
//! between them, and the rank mapping. Sans-IO: no sockets, no files, no clocks.
//!
//! * [`PeerDescriptor`] — one rank's advertised parameters (JSON, versioned: unknown fields are
//!   refused, but those of a newer minor version, which are ignored and listed by
//!   [`PeerDescriptor::unknown_fields`]; a newer major version is refused), built with
//!   [`PeerDescriptor::mla`], [`PeerDescriptor::mha`] or [`PeerDescriptor::builder`].
//! * [`check`] / [`check_with`] — every problem at once, each with a stable code
//!   ([`ProblemCode`], e.g. `KVB-E007`), the message (SGLang's text where it has one), the
//!   values seen and a remedy; plus the [`RankMapping`] when compatible.
//! * [`Compat`] — `Kvbridge` (default: what kvbridge's planner supports, a superset of SGLang)
//!   or `Sglang` (exactly SGLang 0.5.23's envelope).
//! * [`sglang_rank_mapping`] — SGLang's rank mapping, rule for rule
//!   (docs/planning.md, "Rank mapping").
//! * [`fingerprint`] / [`fingerprint_diff`] — a stable hash for a cheap equality fast path, and
//!   the field-by-field explanation of a mismatch.
//! * [`MAX_PAGE_SIZE`], [`MAX_GROUP_SIZE`], [`MAX_DEPLOYMENT_RANKS`] and the other maxima —
//!   what a descriptor may claim; `check` reports larger values as `KVB-E033` before it works
//!   with them.
//! * [`catalog`] / [`explain`] — the long explanations behind `kvbridge explain` and
//!   `docs/errors.md`.
//!
//! ```
//! use kvbridge_handshake::{check, PeerDescriptor, ProblemCode, Role};
//! // GQA, 8 KV heads of dim 128 in bf16, one layer, page size 64, attention TP 4.
//! let prefill = PeerDescriptor::mha(Role::Prefill, 64, 1, 8, 128).element_bytes(2).attn_tp(4, 0).build()?;
//! let decode = PeerDescriptor::mha(Role::Decode, 64, 1, 8, 128)
//!     .element_bytes(2)
//!     .attn_tp(4, 0)
//!     .dcp(2)
//!     .build()?;
//! let report = check(&prefill, &decode);
//! assert!(!report.is_compatible());
//! assert_eq!(report.problems[0].code, ProblemCode::DcpNeedsMlaPool);
//! assert_eq!(report.problems[0].message, "PD decode DCP requires an MLA or hybrid-MLA KV pool.");
//! # Ok::<(), kvbridge_handshake::HandshakeError>(())
//! ```

#![forbid(unsafe_code)]

mod builder;
mod catalog;
mod check;
mod descriptor;
mod error;
mod fingerprint;
mod limits;
mod mapping;
mod problem;
mod version;

pub use builder::PeerDescriptorBuilder;
pub use catalog::{catalog, catalog_markdown, explain};
pub use check::{
    CheckOptions, Compat, RankReport, Report, check, check_all_ranks, check_with, rank_mapping,
};
pub use descriptor::{HEAD_MAJOR_KV_LAYOUT, PeerDescriptor, Role, dtype_bytes};
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
pub use problem::{DetectedBy, Problem, ProblemCode, ProblemInfo, Severity};
pub use version::ProtocolVersion;
