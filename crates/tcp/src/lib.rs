//! kvbridge-tcp (work in progress).
