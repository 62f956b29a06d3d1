//! The errors of the bootstrap registry, its clients and its directories.

/// What went wrong talking to, or setting up, a bootstrap registry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// A [`PrefillDirectory`](crate::PrefillDirectory) could not resolve a bootstrap address to
    /// every rank of its deployment.
    #[error(
        "could not fetch prefill parallel info from bootstrap_addr: {addr}: {reason}; check \
         the prefill is running and has registered all its ranks"
    )]
    Directory {
        /// The bootstrap address.
        addr: String,
        /// What happened.
        reason: String,
    },

    /// A request to a bootstrap server failed (unreachable, timed out, refused, or answered
    /// something that is not the bootstrap protocol).
    #[error(
        "bootstrap service at {addr}: {reason}; check the prefill process is running, serves its \
         bootstrap port at {addr}, and runs the same kvbridge version"
    )]
    Request {
        /// The bootstrap address.
        addr: String,
        /// What happened, with the route and the HTTP status when there was one.
        reason: String,
    },

    /// The bootstrap server refused the request's proof of the shared secret (HTTP 401).
    #[error(
        "bootstrap service at {addr} refused {route}: {reason}; configure the same shared secret \
         on the server (BootstrapConfig::with_secret) and on its clients \
         (ClientConfig::with_secret)"
    )]
    Unauthorized {
        /// The bootstrap address.
        addr: String,
        /// The method and path refused.
        route: String,
        /// The server's reason.
        reason: String,
    },

    /// A server or client configuration is invalid, or the server cannot listen.
    #[error("invalid bootstrap setup: {message}")]
    InvalidSetup {
        /// What was wrong, the values seen and the fix.
        message: String,
    },
}

/// The result of a bootstrap operation.
pub type Result<T, E = BootstrapError> = std::result::Result<T, E>;
