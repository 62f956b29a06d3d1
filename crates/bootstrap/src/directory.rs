//! How a decode agent finds the prefill ranks behind a bootstrap address.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvbridge_control::PrefillRankInfo;
use kvbridge_sync::lock;

use crate::error::{BootstrapError, Result};

/// Resolves a bootstrap address (`host:port` of a prefill deployment) to its prefill ranks.
///
/// In one process use [`StaticDirectory`]; across processes an HTTP client of the prefill's
/// bootstrap service implements it. Implementations return every rank of the deployment, or
/// an error ([`BootstrapError::Directory`]) while the deployment is not fully registered.
#[async_trait::async_trait]
pub trait PrefillDirectory: Send + Sync + 'static {
    /// Every prefill rank behind `bootstrap_addr`.
    async fn prefill_ranks(&self, bootstrap_addr: &str) -> Result<Vec<PrefillRankInfo>>;
}

/// A fixed, in-memory [`PrefillDirectory`].
#[derive(Debug, Clone, Default)]
pub struct StaticDirectory {
    map: Arc<Mutex<HashMap<String, Vec<PrefillRankInfo>>>>,
}

impl StaticDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Publishes (or replaces) the ranks behind `bootstrap_addr`.
    pub fn insert(&self, bootstrap_addr: impl Into<String>, ranks: Vec<PrefillRankInfo>) {
        self.with_map(|m| m.insert(bootstrap_addr.into(), ranks));
    }

    /// Adds one rank behind `bootstrap_addr`.
    pub fn add_rank(&self, bootstrap_addr: impl Into<String>, rank: PrefillRankInfo) {
        self.with_map(|m| m.entry(bootstrap_addr.into()).or_default().push(rank));
    }

    /// Forgets `bootstrap_addr`.
    pub fn remove(&self, bootstrap_addr: &str) {
        self.with_map(|m| m.remove(bootstrap_addr));
    }

    /// Runs `f` on the map under its lock (the only place that takes it).
    fn with_map<R>(&self, f: impl FnOnce(&mut HashMap<String, Vec<PrefillRankInfo>>) -> R) -> R {
        f(&mut lock(&self.map))
    }
}

#[async_trait::async_trait]
impl PrefillDirectory for StaticDirectory {
    async fn prefill_ranks(&self, bootstrap_addr: &str) -> Result<Vec<PrefillRankInfo>> {
        self.with_map(|m| m.get(bootstrap_addr).cloned())
            .ok_or_else(|| BootstrapError::Directory {
                addr: bootstrap_addr.to_owned(),
                reason: "no prefill ranks are registered under this address".to_owned(),
            })
    }
}
