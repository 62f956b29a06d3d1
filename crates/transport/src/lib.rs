//! kvbridge-transport (work in progress).
