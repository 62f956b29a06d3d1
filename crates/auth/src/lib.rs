//! `kvbridge-auth`: the one authentication scheme and the one source of randomness of kvbridge.
//!
//! - **Randomness**: [`random_bytes`] and [`random_u64`] read the operating system's random
//!   source (`getrandom`); nonces, session ids and secret-directory names all come from here.
//! - **Shared secret**: [`Secret`] holds the bytes both sides were configured with; its `Debug`
//!   output never shows them.
//! - **Challenge-response**: a side proves it knows the secret with
//!   [`prove`]`(secret, label, transcript)` = `HMAC-SHA256(secret, label | transcript)`, and the
//!   other side checks it in constant time with [`verify`]. The transcript holds a fresh
//!   [`Nonce`] chosen by the verifier, so a tag answers one challenge only. The [`Label`] names
//!   the protocol and the direction (`kvbridge-tcp/1 client`, `kvbridge-control/1 server`, ...):
//!   no label is a prefix of another, so a tag made for one protocol or direction never verifies
//!   for another, whatever the transcripts.
//! - **Single use**: where the verifier hands out challenges itself (a request/response
//!   protocol such as the bootstrap registry), [`Challenges`] remembers the nonces it issued and
//!   accepts each exactly once, so a recorded request cannot be replayed.
//!
//! The secret authenticates peers; it does not encrypt or sign later traffic (run kvbridge on a
//! trusted network). docs/ARCHITECTURE.md describes the threat model.
//!
//! ```
//! use kvbridge_auth::{Label, Nonce, Secret, prove, verify};
//!
//! let secret = Secret::new(b"shared secret".to_vec());
//! // The verifier sends a fresh nonce; the prover answers with a tag over it.
//! let challenge = Nonce::random();
//! let tag = prove(&secret, Label::BOOTSTRAP_CLIENT, &[challenge.as_bytes(), b"GET /route"]);
//! verify(&secret, Label::BOOTSTRAP_CLIENT, &[challenge.as_bytes(), b"GET /route"], tag.as_bytes())
//!     .unwrap();
//! // The same tag is no proof for another label or another transcript.
//! assert!(verify(&secret, Label::CONTROL_CLIENT, &[challenge.as_bytes(), b"GET /route"], tag.as_bytes()).is_err());
//! assert!(verify(&secret, Label::BOOTSTRAP_CLIENT, &[challenge.as_bytes(), b"GET /other"], tag.as_bytes()).is_err());
//! ```

use std::collections::{HashSet, VecDeque};
use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a [`Nonce`].
pub const NONCE_LEN: usize = 32;

/// Bytes of a [`Tag`] (an HMAC-SHA256 output).
pub const TAG_LEN: usize = 32;

/// Fills `buf` with bytes from the operating system's random source.
///
/// # Panics
/// If the operating system has no working random source (`getrandom` fails), which leaves no
/// safe way to make nonces or session ids.
pub fn random_bytes(buf: &mut [u8]) {
    if let Err(e) = getrandom::fill(buf) {
        panic!(
            "the operating system's random source failed ({e}); kvbridge cannot make nonces \
             or session ids without it"
        );
    }
}

/// A random 64-bit value from [`random_bytes`] (session ids, heartbeat nonces).
///
/// # Panics
/// As [`random_bytes`].
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    random_bytes(&mut b);
    u64::from_le_bytes(b)
}

/// A shared secret; its bytes never appear in `Debug` output.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// Wraps the shared secret bytes (any length; 32 random bytes are a good choice).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// The secret's length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the secret is empty (every configuration that takes a secret refuses an empty
    /// one).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC accepts keys of any length.
        HmacSha256::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!("HMAC takes any key"))
    }
}

impl From<Vec<u8>> for Secret {
    fn from(bytes: Vec<u8>) -> Self {
        Self(bytes)
    }
}

impl From<&[u8]> for Secret {
    fn from(bytes: &[u8]) -> Self {
        Self(bytes.to_vec())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(<{} bytes redacted>)", self.0.len())
    }
}

/// A fresh challenge: [`NONCE_LEN`] random bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Nonce([u8; NONCE_LEN]);

impl Nonce {
    /// A nonce from [`random_bytes`].
    ///
    /// # Panics
    /// As [`random_bytes`].
    pub fn random() -> Self {
        let mut b = [0u8; NONCE_LEN];
        random_bytes(&mut b);
        Self(b)
    }

    /// A nonce received from a peer.
    pub const fn from_bytes(bytes: [u8; NONCE_LEN]) -> Self {
        Self(bytes)
    }

    /// The nonce's bytes.
    pub const fn as_bytes(&self) -> &[u8; NONCE_LEN] {
        &self.0
    }
}

impl fmt::Debug for Nonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Nonce({})", hex(&self.0))
    }
}

/// An HMAC-SHA256 proof of the secret over a label and a transcript.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Tag([u8; TAG_LEN]);

impl Tag {
    /// The tag's bytes, as they go on the wire.
    pub const fn as_bytes(&self) -> &[u8; TAG_LEN] {
        &self.0
    }
}

impl From<Tag> for [u8; TAG_LEN] {
    fn from(t: Tag) -> Self {
        t.0
    }
}

impl fmt::Debug for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tag({})", hex(&self.0))
    }
}

/// Which protocol and direction a tag proves: the first bytes the HMAC covers.
///
/// The set is closed and prefix-free (no label is a prefix of another, checked by a test), so
/// the bytes a tag covers always tell which label made it: a tag for the TCP transport never
/// verifies on the control channel or the bootstrap registry, nor a client's tag as a
/// server's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Label(&'static str);

impl Label {
    /// The TCP transport's connecting side (`kvbridge-tcp`, docs/tcp-protocol.md).
    pub const TCP_CLIENT: Label = Label("kvbridge-tcp/1 client");
    /// The TCP transport's listening side.
    pub const TCP_SERVER: Label = Label("kvbridge-tcp/1 server");
    /// The control channel's connecting side (`kvbridge-control`, docs/control-protocol.md).
    pub const CONTROL_CLIENT: Label = Label("kvbridge-control/1 client");
    /// The control channel's listening side.
    pub const CONTROL_SERVER: Label = Label("kvbridge-control/1 server");
    /// A request to the bootstrap registry (`kvbridge-bootstrap`, docs/bootstrap.md).
    pub const BOOTSTRAP_CLIENT: Label = Label("kvbridge-bootstrap/1 client");
    /// The bootstrap registry's answer.
    pub const BOOTSTRAP_SERVER: Label = Label("kvbridge-bootstrap/1 server");

    /// Every label.
    pub const ALL: [Label; 6] = [
        Label::TCP_CLIENT,
        Label::TCP_SERVER,
        Label::CONTROL_CLIENT,
        Label::CONTROL_SERVER,
        Label::BOOTSTRAP_CLIENT,
        Label::BOOTSTRAP_SERVER,
    ];

    /// The label's text (as the HMAC covers it).
    pub const fn as_str(self) -> &'static str {
        self.0
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

/// Why a proof was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The tag does not match: the peer holds another secret, or the transcript differs.
    #[error(
        "the peer's {label} proof does not match (it holds another shared secret, or answered \
         another challenge); configure the same secret on both sides"
    )]
    Mismatch {
        /// The label the proof was checked against.
        label: Label,
    },

    /// The tag has the wrong length.
    #[error(
        "the peer's {label} proof is {got} bytes, expected {TAG_LEN}; the peer does not speak \
         this protocol version"
    )]
    TagLength {
        /// The label the proof was checked against.
        label: Label,
        /// The length received.
        got: usize,
    },

    /// The challenge is not one this side issued, or it was already used.
    #[error(
        "the challenge {nonce:?} was not issued here or was already used (a replayed or stale \
         request); ask for a fresh challenge and prove it once"
    )]
    UnknownChallenge {
        /// The nonce presented.
        nonce: Nonce,
    },
}

fn mac(secret: &Secret, label: Label, transcript: &[&[u8]]) -> HmacSha256 {
    let mut m = secret.mac();
    m.update(label.0.as_bytes());
    for part in transcript {
        m.update(part);
    }
    m
}

/// The proof of `secret` for `label` over `transcript`:
/// `HMAC-SHA256(secret, label | transcript[0] | transcript[1] | ...)`.
///
/// The parts are concatenated, so the caller makes their concatenation unambiguous (fixed-size
/// fields, or a length before each variable one) and includes a nonce the verifier chose fresh.
pub fn prove(secret: &Secret, label: Label, transcript: &[&[u8]]) -> Tag {
    Tag(mac(secret, label, transcript)
        .finalize()
        .into_bytes()
        .into())
}

/// Checks `tag` against [`prove`]`(secret, label, transcript)` in constant time.
///
/// # Errors
/// [`AuthError::TagLength`] for a tag of the wrong length, [`AuthError::Mismatch`] for a wrong
/// one.
pub fn verify(
    secret: &Secret,
    label: Label,
    transcript: &[&[u8]],
    tag: &[u8],
) -> Result<(), AuthError> {
    if tag.len() != TAG_LEN {
        return Err(AuthError::TagLength {
            label,
            got: tag.len(),
        });
    }
    mac(secret, label, transcript)
        .verify_slice(tag)
        .map_err(|_| AuthError::Mismatch { label })
}

/// The challenges a verifier issued and not yet redeemed: each is accepted once.
///
/// Holds at most `capacity` nonces; issuing one more forgets the oldest, whose proof is then
/// refused (the peer asks again). Not synchronised: share it behind a lock.
#[derive(Debug)]
pub struct Challenges {
    capacity: usize,
    order: VecDeque<Nonce>,
    open: HashSet<Nonce>,
}

impl Challenges {
    /// A ledger of at most `capacity` open challenges (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            order: VecDeque::new(),
            open: HashSet::new(),
        }
    }

    /// A fresh challenge, remembered until it is redeemed or evicted.
    ///
    /// # Panics
    /// As [`random_bytes`].
    pub fn issue(&mut self) -> Nonce {
        while self.open.len() >= self.capacity {
            match self.order.pop_front() {
                Some(old) => {
                    self.open.remove(&old);
                }
                None => break,
            }
        }
        let n = Nonce::random();
        self.order.push_back(n);
        self.open.insert(n);
        n
    }

    /// Consumes `nonce` if this ledger issued it and it is still open.
    ///
    /// # Errors
    /// [`AuthError::UnknownChallenge`] for a nonce never issued, already redeemed or evicted.
    pub fn redeem(&mut self, nonce: &Nonce) -> Result<(), AuthError> {
        if !self.open.remove(nonce) {
            return Err(AuthError::UnknownChallenge { nonce: *nonce });
        }
        self.order.retain(|n| n != nonce);
        Ok(())
    }

    /// Challenges issued and still open.
    pub fn open(&self) -> usize {
        self.open.len()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn labels_are_prefix_free() {
        for a in Label::ALL {
            for b in Label::ALL {
                if a != b {
                    assert!(
                        !b.as_str().starts_with(a.as_str()),
                        "{a} is a prefix of {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn tag_matches_the_documented_construction() {
        // HMAC-SHA256(key "k", "kvbridge-tcp/1 client" | "ab") computed independently of
        // `prove`, through the hmac crate directly.
        let mut m = HmacSha256::new_from_slice(b"k").unwrap();
        m.update(b"kvbridge-tcp/1 clientab");
        let want: [u8; TAG_LEN] = m.finalize().into_bytes().into();
        let got = prove(
            &Secret::new(b"k".to_vec()),
            Label::TCP_CLIENT,
            &[b"a", b"b"],
        );
        assert_eq!(*got.as_bytes(), want);
    }

    #[test]
    fn wrong_length_tags_are_refused() {
        let s = Secret::new(b"k".to_vec());
        let t = prove(&s, Label::CONTROL_SERVER, &[b"x"]);
        assert_eq!(
            verify(&s, Label::CONTROL_SERVER, &[b"x"], &t.as_bytes()[..31]),
            Err(AuthError::TagLength {
                label: Label::CONTROL_SERVER,
                got: 31
            })
        );
        assert!(verify(&s, Label::CONTROL_SERVER, &[b"x"], &[]).is_err());
    }

    #[test]
    fn challenges_are_single_use() {
        let mut c = Challenges::new(4);
        let n = c.issue();
        assert_eq!(c.open(), 1);
        c.redeem(&n).unwrap();
        assert_eq!(
            c.redeem(&n),
            Err(AuthError::UnknownChallenge { nonce: n }),
            "a replayed challenge is refused"
        );
        assert!(c.redeem(&Nonce::random()).is_err(), "never issued");
    }

    #[test]
    fn challenges_are_bounded_and_forget_the_oldest() {
        let mut c = Challenges::new(2);
        let (a, b, d) = (c.issue(), c.issue(), c.issue());
        assert_eq!(c.open(), 2);
        assert!(c.redeem(&a).is_err(), "evicted");
        c.redeem(&b).unwrap();
        c.redeem(&d).unwrap();
        assert_eq!(c.open(), 0);
    }

    #[test]
    fn randomness_differs_and_debug_redacts() {
        assert_ne!(Nonce::random(), Nonce::random());
        assert_ne!(random_u64(), random_u64());
        let mut a = [0u8; 16];
        random_bytes(&mut a);
        assert_ne!(a, [0u8; 16]);
        assert_eq!(
            format!("{:?}", Secret::new(b"hunter2".to_vec())),
            "Secret(<7 bytes redacted>)"
        );
        assert!(
            AuthError::Mismatch {
                label: Label::TCP_SERVER
            }
            .to_string()
            .contains("kvbridge-tcp/1 server")
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// A tag verifies for exactly the secret, label and transcript it was made with.
        #[test]
        fn tags_bind_secret_label_and_transcript(
            secret in proptest::collection::vec(any::<u8>(), 1..40),
            other in proptest::collection::vec(any::<u8>(), 1..40),
            nonce in any::<[u8; NONCE_LEN]>(),
            body in proptest::collection::vec(any::<u8>(), 0..64),
            flip in any::<usize>(),
            li in 0..Label::ALL.len(),
            lj in 0..Label::ALL.len(),
        ) {
            let s = Secret::new(secret.clone());
            let label = Label::ALL[li];
            let t = prove(&s, label, &[&nonce, &body]);
            prop_assert!(verify(&s, label, &[&nonce, &body], t.as_bytes()).is_ok());
            // Splitting the same bytes differently is the same transcript.
            let joined = [&nonce[..], &body[..]].concat();
            prop_assert!(verify(&s, label, &[&joined], t.as_bytes()).is_ok());
            if other != secret {
                prop_assert_eq!(
                    verify(&Secret::new(other), label, &[&nonce, &body], t.as_bytes()),
                    Err(AuthError::Mismatch { label })
                );
            }
            if li != lj {
                let l2 = Label::ALL[lj];
                prop_assert!(verify(&s, l2, &[&nonce, &body], t.as_bytes()).is_err());
            }
            let mut tampered = joined.clone();
            let i = flip % tampered.len();
            tampered[i] ^= 1;
            prop_assert!(verify(&s, label, &[&tampered], t.as_bytes()).is_err());
            let mut bad = *t.as_bytes();
            bad[flip % TAG_LEN] ^= 0x80;
            prop_assert!(verify(&s, label, &[&joined], &bad).is_err());
        }
    }
}
