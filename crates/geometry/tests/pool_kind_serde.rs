//! `PoolKind` wire names are fixed: the handshake exchanges them.
#![cfg(feature = "serde")]

use kvbridge_geometry::PoolKind;

#[test]
fn pool_kind_serde_names_are_lower_case() {
    for (kind, name) in [
        (PoolKind::Mha, "\"mha\""),
        (PoolKind::Mla, "\"mla\""),
        (PoolKind::HybridMla, "\"hybrid_mla\""),
    ] {
        assert_eq!(serde_json::to_string(&kind).unwrap(), name);
        assert_eq!(serde_json::from_str::<PoolKind>(name).unwrap(), kind);
    }
    assert!(serde_json::from_str::<PoolKind>("\"Mha\"").is_err());
}
