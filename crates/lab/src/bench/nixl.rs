//! The NIXL transport for `kvbridge-lab bench --transport nixl` (feature `nixl`), and its baseline:
//! the same descriptors posted through nixl-sys directly, on a raw NIXL agent in the sending
//! process writing into the receiver's pool (`kvbridge_nixl::baseline::DirectWriter`).

use kvbridge_transport::{MemoryRegion, RegionId};

use super::TransportFuture;

/// How the baseline is described in the report.
pub(super) const BASELINE: &str = "the same descriptors posted through nixl-sys directly (a raw NIXL agent without a progress thread, UCX backend, polled in a tight loop)";

/// `--nixl-per-row`: strided ops as one NIXL descriptor per row instead of stride runs.
pub(super) static PER_ROW: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Creates a `NixlTransport` with the default options (stride descriptors off with
/// `--nixl-per-row`).
pub(super) fn factory() -> TransportFuture {
    Box::pin(async {
        #[cfg(feature = "nixl")]
        {
            let per_row = PER_ROW.load(std::sync::atomic::Ordering::Relaxed);
            let options = kvbridge_nixl::NixlOptions::default().with_stride_descriptors(!per_row);
            kvbridge_nixl::NixlTransport::with_options(options)
                .map(|t| std::sync::Arc::new(t) as _)
                .map_err(|e| format!("NIXL transport: {e}"))
        }
        #[cfg(not(feature = "nixl"))]
        {
            crate::nixl_transport()
        }
    })
}

/// Awaits `f`, adding what this process's NIXL transports handed to NIXL meanwhile to `into`.
pub(super) async fn counted<T>(
    into: &mut kvbridge_nixl::NixlStats,
    f: impl std::future::Future<Output = T>,
) -> T {
    let before = kvbridge_nixl::stats();
    let out = f.await;
    *into = into.plus(&kvbridge_nixl::stats().since(&before));
    out
}

/// [`lists_line`] of `runs` requests on NIXL; `None` on other transports.
pub(super) fn lists_for(
    kind: super::TransportKind,
    d: &kvbridge_nixl::NixlStats,
    runs: u32,
) -> Option<String> {
    (kind == super::TransportKind::Nixl).then(|| lists_line(d, u64::from(runs)))
}

/// What this process's NIXL transports handed to NIXL per request, from the counts of
/// `requests` requests: the stride form's runs, the per-row form's descriptors (which the
/// stride form's rows would each have been), and fallbacks.
pub(super) fn lists_line(d: &kvbridge_nixl::NixlStats, requests: u64) -> String {
    let n = requests.max(1);
    let mut parts = Vec::new();
    if d.stride_batches > 0 {
        parts.push(format!(
            "stride form: {} batches, {} local + {} remote stride descriptors covering {} rows \
             (per-row form: {} descriptors)",
            d.stride_batches / n,
            d.stride_local_descriptors / n,
            d.stride_remote_descriptors / n,
            d.stride_blocks / n,
            d.stride_blocks / n
        ));
    }
    if d.row_batches > 0 {
        parts.push(format!(
            "per-row form: {} batches, {} descriptors",
            d.row_batches / n,
            d.row_descriptors / n
        ));
    }
    if d.stride_fallbacks > 0 {
        parts.push(format!(
            "{} strided batches fell back to per-row descriptors",
            d.stride_fallbacks / n
        ));
    }
    if parts.is_empty() {
        parts.push("nothing posted".to_owned());
    }
    parts.push(format!(
        "making requests {:.1} ms, inside postXferReq {:.1} ms (summed over ranks)",
        d.make_ns as f64 / 1e6 / n as f64,
        d.post_ns as f64 / 1e6 / n as f64
    ));
    format!("NIXL descriptors per request: {}", parts.join("; "))
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
            let writer = kvbridge_nixl::baseline::DirectWriter::new(
                std::slice::from_ref(src),
                &[descriptor],
            )
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
            let ops: Vec<_> = ops
                .iter()
                .map(
                    |&(src_offset, dst_offset, len)| kvbridge_nixl::baseline::DirectOp {
                        src: 0,
                        src_offset,
                        region: self.remote,
                        dst_offset,
                        len,
                    },
                )
                .collect();
            self.writer
                .write(&[ops], Some(b"baseline"))
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

/// The direct-NIXL baseline of `--e2e`: one raw agent per prefill rank, writing each decode rank
/// its rows (`ops[prefill][decode]`) as one transfer.
pub(super) struct DirectE2e {
    #[cfg(feature = "nixl")]
    writers: Vec<kvbridge_nixl::baseline::DirectWriter>,
    ops: Vec<Vec<Vec<kvbridge_nixl::baseline::DirectOp>>>,
}

impl DirectE2e {
    /// Registers each prefill rank's `srcs` with an agent of its own that loads every decode
    /// rank's metadata (`peers`, their kvbridge-nixl descriptors).
    pub(super) fn start(
        srcs: &[Vec<MemoryRegion>],
        peers: &[Vec<u8>],
        ops: Vec<Vec<Vec<kvbridge_nixl::baseline::DirectOp>>>,
    ) -> Result<Self, String> {
        #[cfg(feature = "nixl")]
        {
            let peers: Vec<&[u8]> = peers.iter().map(Vec::as_slice).collect();
            let writers = srcs
                .iter()
                .map(|s| kvbridge_nixl::baseline::DirectWriter::new(s, &peers))
                .collect::<Result<_, _>>()
                .map_err(|e| format!("direct NIXL baseline: {e}"))?;
            Ok(Self { writers, ops })
        }
        #[cfg(not(feature = "nixl"))]
        {
            let _ = (srcs, peers, ops);
            Err(kvbridge_nixl::NixlError::NotBuilt.to_string())
        }
    }

    /// NIXL descriptors per request.
    pub(super) fn descriptors(&self) -> u64 {
        self.ops.iter().flatten().map(|o| o.len() as u64).sum()
    }

    /// One timed run: each prefill rank's transfers posted and polled to completion on a
    /// thread of its own (as ranks in their own processes would), until all are done.
    pub(super) fn run(&self) -> Result<std::time::Duration, String> {
        #[cfg(feature = "nixl")]
        {
            let start = std::time::Instant::now();
            std::thread::scope(|s| {
                let ranks: Vec<_> = self
                    .writers
                    .iter()
                    .zip(&self.ops)
                    .map(|(w, ops)| s.spawn(move || w.write(ops, None)))
                    .collect();
                for rank in ranks {
                    match rank.join() {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return Err(format!("direct NIXL baseline: {e}")),
                        Err(_) => return Err("direct NIXL baseline: a writer panicked".to_owned()),
                    }
                }
                Ok(())
            })?;
            Ok(start.elapsed())
        }
        #[cfg(not(feature = "nixl"))]
        {
            Err(kvbridge_nixl::NixlError::NotBuilt.to_string())
        }
    }
}
