//! kvbridge-handshake (work in progress).
