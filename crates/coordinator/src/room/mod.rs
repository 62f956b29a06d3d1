//! The sans-IO room machines: plain types driven with explicit time (docs/lifecycle.md).

pub(crate) mod decode;
