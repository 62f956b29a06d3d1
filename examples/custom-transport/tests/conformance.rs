//! The example transport runs the whole conformance suite, directly and as
//! `Arc<dyn KvTransport>` — the two lines every custom transport needs.

use std::sync::Arc;

use kvbridge_conformance::TransportPair;
use kvbridge_example_custom_transport::NicTransport;

/// Two fresh, unconnected transports.
async fn make_pair() -> TransportPair {
    TransportPair::new(Arc::new(NicTransport::new()), Arc::new(NicTransport::new()))
}

mod conformance {
    kvbridge_conformance::conformance_tests!(super::make_pair);
}
