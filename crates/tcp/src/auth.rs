//! Connection authentication: HMAC-SHA256 challenge-response over both prefaces.
//!
//! Each side sends a fresh 32-byte nonce in its preface. The client proves the secret with
//! `HMAC(secret, "kvbridge-tcp/1 client" | client preface | server preface | hello fields)`, the
//! listener answers with `HMAC(secret, "kvbridge-tcp/1 server" | client preface | server preface)`.
//! Both tags bind both nonces, so neither can be replayed on another connection. Tags are
//! compared in constant time (`Mac::verify_slice`).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::wire::{MAC_LEN, NONCE_LEN, PREFACE_LEN};

type HmacSha256 = Hmac<Sha256>;

const CLIENT_LABEL: &[u8] = b"kvbridge-tcp/1 client";
const SERVER_LABEL: &[u8] = b"kvbridge-tcp/1 server";

/// A connection secret; its bytes never appear in `Debug` output.
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

    /// Whether the secret is empty (refused by [`TcpConfig::validate`](crate::TcpConfig::validate)).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC accepts keys of any length.
        HmacSha256::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!("HMAC takes any key"))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes redacted>)", self.0.len())
    }
}

/// The fields of a `Hello` that the client's tag covers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HelloFields {
    pub(crate) session: u64,
    pub(crate) conn_index: u16,
    pub(crate) conn_count: u16,
    pub(crate) keepalive_ms: u32,
}

fn client_tag(
    secret: &Secret,
    client: &[u8; PREFACE_LEN],
    server: &[u8; PREFACE_LEN],
    hello: HelloFields,
) -> HmacSha256 {
    let mut m = secret.mac();
    m.update(CLIENT_LABEL);
    m.update(client);
    m.update(server);
    m.update(&hello.session.to_be_bytes());
    m.update(&hello.conn_index.to_be_bytes());
    m.update(&hello.conn_count.to_be_bytes());
    m.update(&hello.keepalive_ms.to_be_bytes());
    m
}

fn server_tag(
    secret: &Secret,
    client: &[u8; PREFACE_LEN],
    server: &[u8; PREFACE_LEN],
) -> HmacSha256 {
    let mut m = secret.mac();
    m.update(SERVER_LABEL);
    m.update(client);
    m.update(server);
    m
}

/// The client's proof of the secret.
pub(crate) fn client_proof(
    secret: &Secret,
    client: &[u8; PREFACE_LEN],
    server: &[u8; PREFACE_LEN],
    hello: HelloFields,
) -> [u8; MAC_LEN] {
    client_tag(secret, client, server, hello)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks the client's proof in constant time.
pub(crate) fn verify_client(
    secret: &Secret,
    client: &[u8; PREFACE_LEN],
    server: &[u8; PREFACE_LEN],
    hello: HelloFields,
    tag: &[u8; MAC_LEN],
) -> bool {
    client_tag(secret, client, server, hello)
        .verify_slice(tag)
        .is_ok()
}

/// The listener's proof of the secret.
pub(crate) fn server_proof(
    secret: &Secret,
    client: &[u8; PREFACE_LEN],
    server: &[u8; PREFACE_LEN],
) -> [u8; MAC_LEN] {
    server_tag(secret, client, server)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks the listener's proof in constant time.
pub(crate) fn verify_server(
    secret: &Secret,
    client: &[u8; PREFACE_LEN],
    server: &[u8; PREFACE_LEN],
    tag: &[u8; MAC_LEN],
) -> bool {
    server_tag(secret, client, server).verify_slice(tag).is_ok()
}

/// A fresh, unpredictable nonce: SHA-256 over keys std draws from the OS random source
/// (`RandomState`), the time, the process id and a counter.
pub(crate) fn nonce() -> [u8; NONCE_LEN] {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = Sha256::new();
    for i in 0..4u64 {
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u64(i);
        h.update(hasher.finish().to_be_bytes());
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.update(now.to_be_bytes());
    h.update(std::process::id().to_be_bytes());
    h.update(COUNTER.fetch_add(1, Ordering::Relaxed).to_be_bytes());
    h.finalize().into()
}

/// A random 64-bit id (session ids).
pub(crate) fn random_u64() -> u64 {
    let n = nonce();
    let mut b = [0u8; 8];
    b.copy_from_slice(&n[..8]);
    u64::from_be_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_same_secret_and_prefaces() {
        let s = Secret::new(b"k".to_vec());
        let c = [1u8; PREFACE_LEN];
        let v = [2u8; PREFACE_LEN];
        let hello = HelloFields {
            session: 1,
            conn_index: 0,
            conn_count: 1,
            keepalive_ms: 10,
        };
        let tag = client_proof(&s, &c, &v, hello);
        assert!(verify_client(&s, &c, &v, hello, &tag));
        assert!(!verify_client(
            &Secret::new(b"j".to_vec()),
            &c,
            &v,
            hello,
            &tag
        ));
        assert!(!verify_client(&s, &v, &c, hello, &tag));
        let other = HelloFields {
            session: 2,
            ..hello
        };
        assert!(!verify_client(&s, &c, &v, other, &tag));
        let st = server_proof(&s, &c, &v);
        assert!(verify_server(&s, &c, &v, &st));
        assert_ne!(st, tag, "client and server tags are domain-separated");
        assert!(!verify_server(&s, &c, &v, &tag));
    }

    #[test]
    fn nonces_differ_and_secret_debug_is_redacted() {
        assert_ne!(nonce(), nonce());
        assert_eq!(
            format!("{:?}", Secret::new(b"hunter2".to_vec())),
            "Secret(<7 bytes redacted>)"
        );
    }
}
