//! kvbridge-geometry (work in progress).
