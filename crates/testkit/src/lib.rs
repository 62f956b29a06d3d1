//! kvbridge's test kit: what kvbridge's own tests, the demo and the benchmarks use to show that
//! every byte lands where it must. It stands below the coordinator (it depends only on the
//! geometry, handshake and transport crates), so the coordinator's tests and examples use it
//! as a plain dev-dependency, and so do the cross-crate tests and the lab above. Never
//! published; no product crate depends on it (tidy checks).
//!
//! * [`fill`] — fill prefill memory with bytes derived from (request, entry, position) and
//!   verify every byte a decode rank holds against the owner rule.

pub mod fill;
