//! The whole conformance suite against two in-process shared-memory transports (directly and
//! through `Arc<dyn KvTransport>`). The cross-process runs live in `tests/peer_process.rs`.

use std::sync::Arc;

use kvbridge_conformance::TransportPair;
use kvbridge_shm::ShmTransport;

async fn shm_pair() -> TransportPair {
    TransportPair::new(
        Arc::new(ShmTransport::new().expect("sender transport")),
        Arc::new(ShmTransport::new().expect("receiver transport")),
    )
}

mod conformance {
    kvbridge_conformance::conformance_tests!(super::shm_pair);
}
