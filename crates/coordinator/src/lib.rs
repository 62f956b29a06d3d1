//! kvbridge-coordinator (work in progress).
