//! Conformance suite for [`KvTransport`](crate::KvTransport) implementations (not API-stable).
