//! Authentication of bootstrap requests with the shared secret (docs/bootstrap.md,
//! "Authentication").
//!
//! With a secret configured, a client first asks `GET /challenge` for a single-use nonce,
//! then sends its request with
//! `Authorization: KVB-HMAC nonce=<64 hex digits>, tag=<64 hex digits>`, where the tag is
//! [`kvbridge_auth::prove`] with [`Label::BOOTSTRAP_CLIENT`] over
//! `nonce | method | " " | target | "\n" | body` (`target` is the path and query exactly as
//! sent; neither it nor the method can hold a space or a line break, so the parts cannot be
//! shifted into one another). The server redeems the nonce before checking the tag, so a nonce
//! is spent by its first use, right or wrong.

use std::sync::Mutex;

use kvbridge_auth::{Challenges, Label, NONCE_LEN, Nonce, Secret, TAG_LEN, prove, verify};
use kvbridge_sync::lock;

use crate::http::{RequestHead, Response};

/// The scheme name of the `Authorization` header.
pub(crate) const SCHEME: &str = "KVB-HMAC";

/// Routes answered without a proof: liveness, the challenge itself, and the metrics scrape.
pub(crate) const OPEN_ROUTES: [&str; 3] = ["/health", "/challenge", "/metrics"];

/// Whether a request for `path` needs a proof when a secret is set.
pub(crate) fn needs_proof(path: &str) -> bool {
    !OPEN_ROUTES.contains(&path)
}

/// `GET /challenge`'s answer.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Challenge {
    /// The nonce, as 64 lowercase hex digits.
    pub(crate) nonce: String,
}

/// The transcript a tag covers.
fn transcript<'a>(
    nonce: &'a Nonce,
    method: &'a str,
    target: &'a str,
    body: &'a [u8],
) -> [&'a [u8]; 6] {
    [
        nonce.as_bytes(),
        method.as_bytes(),
        b" ",
        target.as_bytes(),
        b"\n",
        body,
    ]
}

/// The `Authorization` header value proving `secret` for one request.
pub(crate) fn authorization(
    secret: &Secret,
    nonce: &Nonce,
    method: &str,
    target: &str,
    body: &[u8],
) -> String {
    let tag = prove(
        secret,
        Label::BOOTSTRAP_CLIENT,
        &transcript(nonce, method, target, body),
    );
    format!(
        "{SCHEME} nonce={}, tag={}",
        hex(nonce.as_bytes()),
        hex(tag.as_bytes())
    )
}

/// The server side: the secret and the open challenges.
#[derive(Debug)]
pub(crate) struct Verifier {
    secret: Secret,
    /// Bounded: issuing beyond the capacity forgets the oldest open challenge.
    challenges: Mutex<Challenges>,
}

impl Verifier {
    pub(crate) fn new(secret: Secret, max_challenges: usize) -> Self {
        Self {
            secret,
            challenges: Mutex::new(Challenges::new(max_challenges)),
        }
    }

    /// Runs `f` on the open challenges under their lock (the only place that takes it).
    fn with_challenges<R>(&self, f: impl FnOnce(&mut Challenges) -> R) -> R {
        f(&mut lock(&self.challenges))
    }

    /// Answers `GET /challenge`.
    pub(crate) fn challenge(&self) -> Response {
        let nonce = self.with_challenges(Challenges::issue);
        Response::json(
            200,
            &Challenge {
                nonce: hex(nonce.as_bytes()),
            },
        )
    }

    /// Challenges issued and not yet redeemed.
    #[cfg(test)]
    pub(crate) fn open(&self) -> usize {
        self.with_challenges(|c| c.open())
    }

    /// Checks the request's proof; `Err` is the 401 to answer.
    pub(crate) fn check(&self, head: &RequestHead, body: &[u8]) -> Result<(), Response> {
        let refuse = |why: String| {
            Response::text(
                401,
                format!(
                    "{} {}: {why}. This bootstrap server requires the shared secret: GET \
                     /challenge, then send `Authorization: {SCHEME} nonce=<hex>, tag=<hex>` \
                     (docs/bootstrap.md, \"Authentication\")",
                    head.method, head.path
                ),
            )
        };
        let Some(value) = head.authorization.as_deref() else {
            return Err(refuse("no Authorization header".to_owned()));
        };
        let (nonce, tag) = parse_authorization(value).map_err(&refuse)?;
        self.with_challenges(|c| c.redeem(&nonce))
            .map_err(|e| refuse(e.to_string()))?;
        verify(
            &self.secret,
            Label::BOOTSTRAP_CLIENT,
            &transcript(&nonce, &head.method, &head.target, body),
            &tag,
        )
        .map_err(|e| refuse(e.to_string()))
    }
}

/// `KVB-HMAC nonce=<hex>, tag=<hex>` → the nonce and the tag bytes.
fn parse_authorization(value: &str) -> Result<(Nonce, [u8; TAG_LEN]), String> {
    let shape = || {
        format!(
            "the Authorization header {:?} is not `{SCHEME} nonce=<64 hex>, tag=<64 hex>`",
            value.chars().take(80).collect::<String>()
        )
    };
    let rest = value.strip_prefix(SCHEME).ok_or_else(shape)?;
    let (mut nonce, mut tag) = (None, None);
    for part in rest.split(',') {
        match part.trim().split_once('=') {
            Some(("nonce", v)) => nonce = unhex::<NONCE_LEN>(v),
            Some(("tag", v)) => tag = unhex::<TAG_LEN>(v),
            _ => return Err(shape()),
        }
    }
    match (nonce, tag) {
        (Some(n), Some(t)) => Ok((Nonce::from_bytes(n), t)),
        _ => Err(shape()),
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Exactly `N` bytes from `2N` hex digits.
pub(crate) fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let b = s.as_bytes();
    if b.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in b.chunks_exact(2).enumerate() {
        let pair = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(out)
}
