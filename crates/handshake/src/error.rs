//! The error type of this crate's API (not the problems `check` finds: those are data).

use crate::problem::Problem;
use crate::version::ProtocolVersion;

/// A failure of the handshake API: a descriptor that cannot be parsed, a protocol version this
/// build refuses, or a rank mapping asked for where its preconditions do not hold.
///
/// Compatibility problems between two well-formed descriptors are not errors: [`crate::check`]
/// returns them as [`Problem`]s, all at once.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The descriptor text is not valid JSON, or not a valid `PeerDescriptor` (unknown field in
    /// a descriptor of this build's minor version or an older one, missing field, wrong type).
    #[error(
        "invalid peer descriptor at line {line}, column {column}: {message}; \
         fix the JSON (field names and defaults: docs/errors.md, \"Descriptor format\")"
    )]
    Json {
        /// 1-based line of the error (0 when serde_json could not tell).
        line: usize,
        /// 1-based column of the error (0 when serde_json could not tell).
        column: usize,
        /// What serde_json reported.
        message: String,
    },
    /// The descriptor comes from a newer protocol major version; its fields may mean something
    /// this build does not know, so it is refused rather than misread.
    #[error(
        "peer descriptor uses protocol_version {seen}, but this kvbridge speaks protocol {supported}: \
         a newer major version may change what fields mean, so the descriptor is refused; \
         upgrade kvbridge on this side to a release that speaks protocol {major}.x",
        major = seen.major
    )]
    UnsupportedProtocolVersion {
        /// The version found in the descriptor.
        seen: ProtocolVersion,
        /// The version this build speaks.
        supported: ProtocolVersion,
    },
    /// [`crate::PeerDescriptorBuilder::build`] was given incomplete or contradictory input.
    #[error("cannot build the peer descriptor: {message}; {remedy}")]
    DescriptorBuild {
        /// What is missing or wrong, with the values seen.
        message: String,
        /// What to call to fix it.
        remedy: String,
    },
    /// A precondition of the rank mapping does not hold (SGLang asserts these; the text is
    /// SGLang's).
    #[error("rank mapping precondition failed: {message}; {remedy}")]
    MappingPrecondition {
        /// The SGLang assertion text, e.g.
        /// `Decode pp size (2) should be equal to prefill pp size (4) or 1`.
        message: String,
        /// How to fix it.
        remedy: String,
    },
    /// The two descriptors are incompatible; every problem is listed.
    #[error("{}", render_incompatible(.problems))]
    Incompatible {
        /// Every problem [`crate::check`] found (never empty).
        problems: Vec<Problem>,
    },
}

fn render_incompatible(problems: &[Problem]) -> String {
    let mut out = format!(
        "prefill and decode are incompatible ({} problem{}):",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    );
    for p in problems {
        out.push_str(&format!(
            "\n  {}: {} (fix: {})",
            p.code, p.message, p.remedy
        ));
    }
    out
}

/// `Result` with [`HandshakeError`] as the default error.
pub type Result<T, E = HandshakeError> = std::result::Result<T, E>;
