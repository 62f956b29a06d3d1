//! kvbridge-mock (work in progress).
