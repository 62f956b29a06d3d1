//! The transport conformance suite, run against kvbridge-tcp in several configurations:
//! the defaults; a shared secret with two connections per peer and small pieces (so batches are
//! spread over connections and cancels land between pieces); and (in `cross_process.rs`) with
//! the receiver in another OS process.

use std::sync::Arc;

use kvbridge_tcp::{TcpConfig, TcpTransport};
use kvbridge_transport::testing::TransportPair;

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

async fn striped_pair() -> TransportPair {
    pair_with(
        TcpConfig::default()
            .with_secret(b"conformance secret".to_vec())
            .with_connections_per_peer(2)
            .with_piece_bytes(64 << 10),
    )
    .await
}

mod default_config {
    kvbridge_transport::conformance_tests!(super::default_pair);
}

mod secret_two_connections {
    kvbridge_transport::conformance_tests!(super::striped_pair);
}
