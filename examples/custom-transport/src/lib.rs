//! Example custom transport (work in progress).
