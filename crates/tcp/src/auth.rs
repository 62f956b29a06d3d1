//! Connection authentication: the kvbridge-auth challenge-response over both prefaces.
//!
//! Each side sends a fresh 32-byte nonce in its preface. The client proves the secret with
//! `HMAC(secret, "kvbridge-tcp/1 client" | client preface | server preface | hello fields)`, the
//! listener answers with `HMAC(secret, "kvbridge-tcp/1 server" | client preface | server preface)`
//! ([`kvbridge_auth::prove`] with [`Label::TCP_CLIENT`] / [`Label::TCP_SERVER`]). Both tags bind
//! both nonces, so neither can be replayed on another connection, and the labels keep them
//! from being accepted by the other direction or another protocol. Tags are compared in
//! constant time.

use kvbridge_auth::Label;
pub use kvbridge_auth::Secret;

use crate::wire::{MAC_LEN, NONCE_LEN, PREFACE_LEN};

/// The fields of a `Hello` that the client's tag covers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HelloFields {
    pub(crate) session: u64,
    pub(crate) conn_index: u16,
    pub(crate) conn_count: u16,
    pub(crate) keepalive_ms: u32,
}

impl HelloFields {
    fn bytes(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.session.to_be_bytes());
        b[8..10].copy_from_slice(&self.conn_index.to_be_bytes());
        b[10..12].copy_from_slice(&self.conn_count.to_be_bytes());
        b[12..].copy_from_slice(&self.keepalive_ms.to_be_bytes());
        b
    }
}

/// The client's proof of the secret.
pub(crate) fn client_proof(
    secret: &Secret,
    client: &[u8; PREFACE_LEN],
    server: &[u8; PREFACE_LEN],
    hello: HelloFields,
) -> [u8; MAC_LEN] {
    kvbridge_auth::prove(secret, Label::TCP_CLIENT, &[client, server, &hello.bytes()]).into()
}

/// Checks the client's proof in constant time.
pub(crate) fn verify_client(
    secret: &Secret,
    client: &[u8; PREFACE_LEN],
    server: &[u8; PREFACE_LEN],
    hello: HelloFields,
    tag: &[u8; MAC_LEN],
) -> bool {
    kvbridge_auth::verify(
        secret,
        Label::TCP_CLIENT,
        &[client, server, &hello.bytes()],
        tag,
    )
    .is_ok()
}

/// The listener's proof of the secret.
pub(crate) fn server_proof(
    secret: &Secret,
    client: &[u8; PREFACE_LEN],
    server: &[u8; PREFACE_LEN],
) -> [u8; MAC_LEN] {
    kvbridge_auth::prove(secret, Label::TCP_SERVER, &[client, server]).into()
}

/// Checks the listener's proof in constant time.
pub(crate) fn verify_server(
    secret: &Secret,
    client: &[u8; PREFACE_LEN],
    server: &[u8; PREFACE_LEN],
    tag: &[u8; MAC_LEN],
) -> bool {
    kvbridge_auth::verify(secret, Label::TCP_SERVER, &[client, server], tag).is_ok()
}

/// A fresh nonce for a preface.
pub(crate) fn nonce() -> [u8; NONCE_LEN] {
    const { assert!(NONCE_LEN == kvbridge_auth::NONCE_LEN) };
    *kvbridge_auth::Nonce::random().as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hmac::{Hmac, Mac};
    use sha2::Sha256;

    fn hello() -> HelloFields {
        HelloFields {
            session: 1,
            conn_index: 0,
            conn_count: 1,
            keepalive_ms: 10,
        }
    }

    #[test]
    fn proofs_verify_only_with_the_same_secret_and_prefaces() {
        let s = Secret::new(b"k".to_vec());
        let c = [1u8; PREFACE_LEN];
        let v = [2u8; PREFACE_LEN];
        let hello = hello();
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

    /// The wire format of docs/tcp-protocol.md is unchanged: the client tag is the HMAC of the
    /// label, both prefaces and the hello fields in big-endian order.
    #[test]
    fn client_tag_is_the_documented_hmac() {
        let (c, v) = ([1u8; PREFACE_LEN], [2u8; PREFACE_LEN]);
        let h = hello();
        let mut m = Hmac::<Sha256>::new_from_slice(b"k").unwrap();
        m.update(b"kvbridge-tcp/1 client");
        m.update(&c);
        m.update(&v);
        m.update(&h.session.to_be_bytes());
        m.update(&h.conn_index.to_be_bytes());
        m.update(&h.conn_count.to_be_bytes());
        m.update(&h.keepalive_ms.to_be_bytes());
        let want: [u8; MAC_LEN] = m.finalize().into_bytes().into();
        assert_eq!(client_proof(&Secret::new(b"k".to_vec()), &c, &v, h), want);
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(nonce(), nonce());
    }
}
