//! kvbridge-shm (work in progress).
