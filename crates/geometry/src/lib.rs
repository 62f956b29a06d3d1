//! kvbridge-geometry: sans-IO KV pool geometry and transfer planning.

#![forbid(unsafe_code)]

/// The attention family of a KV pool.
///
/// Head counts and head dims live in the pool geometry, not here: this enum is the small,
/// stable tag that peers exchange during the handshake. With the `serde` feature it serialises
/// as `"mha"`, `"mla"` or `"hybrid_mla"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum PoolKind {
    /// Multi-head (or grouped-query) attention: one K and one V entry per layer, split by heads.
    Mha,
    /// Multi-head latent attention: one compressed latent entry per layer, replicated across TP.
    Mla,
    /// MLA plus extra per-layer state entries (e.g. an indexer cache) sharing the same pages.
    HybridMla,
}
