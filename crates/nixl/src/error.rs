//! The one error type of `kvbridge-nixl`.
//!
//! Trait methods return [`TransportError`]; failures specific to NIXL are carried inside
//! [`TransportError::Custom`] as a [`NixlError`], so callers can downcast and match on them.

use std::path::PathBuf;

use kvbridge_transport::TransportError;

use crate::NAME;

/// Failures specific to the NIXL transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NixlError {
    /// No NIXL runtime was found where the transport looks for it.
    #[error(
        "the NIXL runtime was not found (looked for libnixl_capi.so in {looked}); run \
         `cargo xtask nixl-setup` in the kvbridge source tree, or set KVBRIDGE_NIXL_LIB_DIR to a \
         folder holding libnixl_capi.so (or to a set-up folder made by that command)"
    )]
    RuntimeMissing {
        /// The folders searched, as text.
        looked: String,
    },
    /// The NIXL runtime was found but could not be loaded.
    #[error(
        "could not load the NIXL runtime {path}: {reason}; run `cargo xtask nixl-setup` again \
         (it re-checks the unpacked runtime), or point KVBRIDGE_NIXL_LIB_DIR at a working install"
    )]
    RuntimeLoad {
        /// The library tried.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
    /// This build of `kvbridge-nixl` does not contain the NIXL engine.
    #[error(
        "kvbridge-nixl was built without its `nixl` feature; build with `--features nixl` (the CLI: \
         `--features nixl`), after `cargo xtask nixl-setup` installed libclang for nixl-sys"
    )]
    NotBuilt,
    /// A NIXL call failed.
    #[error("NIXL {call} failed with status {status}; {remedy}")]
    Call {
        /// The NIXL function.
        call: &'static str,
        /// NIXL's status, as nixl-sys names it.
        status: String,
        /// What to do about it.
        remedy: &'static str,
    },
}

impl From<NixlError> for TransportError {
    fn from(e: NixlError) -> Self {
        TransportError::Custom {
            transport: NAME,
            source: Box::new(e),
        }
    }
}
