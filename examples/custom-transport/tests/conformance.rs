//! The example transport runs the whole conformance suite, directly and as
//! `Arc<dyn KvTransport>` — the two lines every custom transport needs.

use std::sync::Arc;

use kvbridge_example_custom_transport::NicTransport;
use kvbridge_transport::testing::TransportPair;

/// Two fresh, unconnected transports.
async fn make_pair() -> TransportPair {
    TransportPair::new(Arc::new(NicTransport::new()), Arc::new(NicTransport::new()))
}

mod conformance {
    kvbridge_transport::conformance_tests!(super::make_pair);
}
