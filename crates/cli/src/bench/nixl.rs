//! The NIXL transport for `kvbridge bench --transport nixl` (feature `nixl`), and its baseline:
//! the same descriptors posted through nixl-sys directly, on a raw NIXL agent in the sending
//! process writing into the receiver's pool (`kvbridge_nixl::baseline::DirectWriter`).

use kvbridge_transport::{MemoryRegion, RegionId};

use super::TransportFuture;

/// How the baseline is described in the report.
pub(super) const BASELINE: &str = "the same descriptors posted through nixl-sys directly (a raw NIXL agent without a progress thread, UCX backend, polled in a tight loop)";

/// Creates a `NixlTransport` with the default options.
pub(super) fn factory() -> TransportFuture {
    Box::pin(async { crate::nixl_transport() })
}

/// The direct-NIXL baseline: the same `(source, destination, len)` descriptors, one transfer.
pub(super) struct DirectBaseline {
    #[cfg(feature = "nixl")]
    writer: kvbridge_nixl::baseline::DirectWriter,
    remote: u64,
}

impl DirectBaseline {
    /// Registers `src` with a raw agent and loads the receiver's metadata from its descriptor.
    pub(super) fn start(
        src: &MemoryRegion,
        descriptor: &[u8],
        remote: RegionId,
    ) -> Result<Self, String> {
        #[cfg(feature = "nixl")]
        {
            let writer = kvbridge_nixl::baseline::DirectWriter::new(src, descriptor)
                .map_err(|e| e.to_string())?;
            Ok(Self {
                writer,
                remote: remote.0,
            })
        }
        #[cfg(not(feature = "nixl"))]
        {
            let _ = (src, descriptor, remote);
            Err(kvbridge_nixl::NixlError::NotBuilt.to_string())
        }
    }

    /// One timed run of the descriptors (with a notification, as the transport's batch has).
    pub(super) fn run(&self, ops: &[(u64, u64, u64)]) -> Result<f64, String> {
        #[cfg(feature = "nixl")]
        {
            let ops: Vec<(u64, u64, u64, u64)> = ops
                .iter()
                .map(|&(s, d, len)| (s, self.remote, d, len))
                .collect();
            self.writer
                .write(&ops, Some(b"baseline"))
                .map(|t| t.as_secs_f64())
                .map_err(|e| e.to_string())
        }
        #[cfg(not(feature = "nixl"))]
        {
            let _ = (ops, self.remote);
            Err(kvbridge_nixl::NixlError::NotBuilt.to_string())
        }
    }
}
