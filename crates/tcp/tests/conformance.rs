//! The transport conformance suite, run against kvbridge-tcp:
//!
//! - `copy_receive_secret_two_connections`: every case (`conformance_tests!`, directly and as
//!   `Arc<dyn KvTransport>`), with a shared secret, two connections per peer, 64 KiB pieces
//!   (so batches are spread over connections and cancels land between pieces) and payloads
//!   received through the bounce buffer (`receive_in_place = false`).
//! - `in_place_defaults`: every case in the default configuration (payloads read straight into
//!   the registered regions).
//!
//! The peer in another OS process is covered by `cross_process.rs`.

use std::sync::Arc;

use kvbridge_conformance::TransportPair;
use kvbridge_tcp::{TcpConfig, TcpTransport};

async fn pair_with(config: TcpConfig) -> TransportPair {
    let sender = TcpTransport::bind(config.clone())
        .await
        .expect("bind sender");
    let receiver = TcpTransport::bind(config).await.expect("bind receiver");
    TransportPair::new(Arc::new(sender), Arc::new(receiver))
}

async fn default_pair() -> TransportPair {
    pair_with(TcpConfig::default()).await
}

async fn striped_copy_pair() -> TransportPair {
    pair_with(
        TcpConfig::default()
            .with_secret(b"conformance secret".to_vec())
            .with_connections_per_peer(2)
            .with_piece_bytes(64 << 10)
            .with_receive_in_place(false),
    )
    .await
}

mod copy_receive_secret_two_connections {
    kvbridge_conformance::conformance_tests!(super::striped_copy_pair);
}

mod in_place_defaults {
    kvbridge_conformance::conformance_tests!(super::default_pair);
}
