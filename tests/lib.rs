//! Shared helpers for kvbridge's cross-crate tests (the tests themselves are `[[test]]` targets).
