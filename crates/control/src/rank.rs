//! [`PrefillRankInfo`]: what a prefill rank publishes so decode ranks can reach it.

use kvbridge_handshake::PeerDescriptor;
use serde::{Deserialize, Serialize};

use crate::endpoint::Endpoint;

/// One prefill rank as published to a bootstrap registry: its descriptor and control endpoint.
/// Its JSON form is an entry of the registry's `GET /ranks` answer (docs/bootstrap.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillRankInfo {
    /// The rank's control endpoint.
    pub endpoint: Endpoint,
    /// The rank's descriptor (its TP/CP/PP/DCP coordinates identify it).
    pub descriptor: PeerDescriptor,
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge_handshake::Role;

    #[test]
    fn json_has_the_endpoint_and_descriptor_fields() {
        let info = PrefillRankInfo {
            endpoint: Endpoint::new("10.0.0.5:17000"),
            descriptor: PeerDescriptor::mla(Role::Prefill, 16, 2, 64)
                .build()
                .unwrap(),
        };
        let j = serde_json::to_value(&info).unwrap();
        assert_eq!(j["endpoint"], "10.0.0.5:17000");
        assert!(j["descriptor"].is_object(), "{j}");
        assert_eq!(serde_json::from_value::<PrefillRankInfo>(j).unwrap(), info);
    }
}
