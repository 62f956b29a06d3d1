//! The conformance suite against `LoopbackTransport`, directly and as `Arc<dyn KvTransport>`,
//! in its default configuration and with reads off and a small batch limit; and against
//! `FaultInjector` in pass-through mode.

use std::sync::Arc;

use kvbridge_conformance::TransportPair;
use kvbridge_mock::{FaultInjector, LoopbackConfig, LoopbackTransport};

async fn loopback_pair() -> TransportPair {
    TransportPair::new(
        Arc::new(LoopbackTransport::new()),
        Arc::new(LoopbackTransport::new()),
    )
}

async fn restricted_pair() -> TransportPair {
    let config = LoopbackConfig::default()
        .with_reads(false)
        .with_max_ops_per_batch(Some(1000));
    TransportPair::new(
        Arc::new(LoopbackTransport::with_config(config.clone())),
        Arc::new(LoopbackTransport::with_config(config)),
    )
}

mod loopback {
    kvbridge_conformance::conformance_tests!(super::loopback_pair);
}

mod loopback_push_only_small_batches {
    kvbridge_conformance::conformance_tests!(super::restricted_pair);
}

async fn fault_injector_pair() -> TransportPair {
    TransportPair::new(
        Arc::new(FaultInjector::pass_through(LoopbackTransport::new())),
        Arc::new(FaultInjector::pass_through(LoopbackTransport::new())),
    )
}

mod fault_injector_pass_through {
    kvbridge_conformance::conformance_tests!(super::fault_injector_pair);
}
