//! Test and demo helpers (work in progress).
