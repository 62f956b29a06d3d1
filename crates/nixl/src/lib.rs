//! `kvbridge-nixl`: a [`KvTransport`](kvbridge_transport::KvTransport) over NIXL, the transfer
//! engine serving stacks use for RDMA, NVLink and TCP, with its UCX backend.
//!
//! The NIXL engine itself is behind the feature `nixl` (it pulls in `nixl-sys`, whose build
//! needs libclang). Without it this crate builds with Rust alone and holds the parts that need
//! no engine: the descriptor format, the control messages, and [`Runtime`], which finds the
//! NIXL libraries. Run `cargo xtask nixl-setup` once (libclang, and the NIXL runtime in
//! `target/nixl/`); the transport then finds the runtime there, or where
//! `KVBRIDGE_NIXL_LIB_DIR` points, with nothing to export. See `docs/transports.md` ("NIXL").
//!
//! ```ignore
//! let transport = kvbridge_nixl::NixlTransport::new()?; // feature `nixl`
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

use std::time::Duration;

pub mod baseline;
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
mod control;
pub mod descriptor;
mod error;
#[cfg(feature = "nixl")]
mod ffi;
pub mod runtime;
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
mod stats;
#[cfg(feature = "nixl")]
mod stride;
#[cfg(feature = "nixl")]
mod transport;

pub use error::NixlError;
#[cfg(feature = "nixl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nixl")))]
pub use ffi::{allocate_shared, map_shared, shared_fd};
pub use runtime::{LIB_DIR_ENV, Runtime};
pub use stats::{NixlStats, stats};
#[cfg(feature = "nixl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nixl")))]
pub use transport::NixlTransport;

/// The transport's name in logs and errors.
pub const NAME: &str = "nixl";

/// Settings of a [`NixlTransport`](crate) (feature `nixl`).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct NixlOptions {
    /// The runtime to load; `None` finds it with [`Runtime::locate`].
    pub runtime: Option<Runtime>,
    /// Run NIXL's own progress thread (default false). Off, the transport's polling thread
    /// drives UCX's progress (see `docs/transports.md`, "NIXL"): on a host with few cores
    /// NIXL's progress thread contends with the posting thread for UCX's worker lock and
    /// halves the rate of writes of many descriptors.
    pub progress_thread: bool,
    /// How long NIXL's progress thread, when on, waits between rounds (default 200 µs).
    pub progress_interval: Duration,
    /// How long a control exchange (connect, region updates, probes) waits for the peer
    /// (default 5 s).
    pub control_timeout: Duration,
    /// How long past its deadline a batch NIXL still carries may take before the transport
    /// fences it by closing the peer's connection (default 1 s).
    pub commit_grace: Duration,
    /// Accept device memory when the UCX backend supports it (default true).
    pub device_memory: bool,
    /// While a transfer is in flight, poll it without sleeping, yielding the CPU between polls
    /// (default false): each poll drives UCX's progress on the sending side, which the bytes'
    /// rate depends on, at the cost of a core while bytes move (what NIXL's own progress thread
    /// does at its default delay of zero). Off, the polling thread sleeps 10 to 20 µs between
    /// polls. Idle transports always back off to 1 ms (after 20 ms without activity).
    pub poll_in_flight: bool,
    /// Post strided ops as NIXL stride descriptors (NIXL 1.5; default true): one descriptor per
    /// run of rows instead of one per row. Where the runtime lacks them or NIXL refuses a
    /// batch's stride form, the batch goes as per-row descriptors, said once in a warning and
    /// counted in [`NixlStats::stride_fallbacks`].
    pub stride_descriptors: bool,
}

impl Default for NixlOptions {
    fn default() -> Self {
        Self {
            runtime: None,
            progress_thread: false,
            progress_interval: Duration::from_micros(200),
            control_timeout: Duration::from_secs(5),
            commit_grace: Duration::from_secs(1),
            device_memory: true,
            poll_in_flight: false,
            stride_descriptors: true,
        }
    }
}

impl NixlOptions {
    /// Sets [`runtime`](Self::runtime).
    pub fn with_runtime(mut self, runtime: Runtime) -> Self {
        self.runtime = Some(runtime);
        self
    }

    /// Sets [`progress_thread`](Self::progress_thread).
    pub fn with_progress_thread(mut self, on: bool) -> Self {
        self.progress_thread = on;
        self
    }

    /// Sets [`progress_interval`](Self::progress_interval).
    pub fn with_progress_interval(mut self, interval: Duration) -> Self {
        self.progress_interval = interval;
        self
    }

    /// Sets [`control_timeout`](Self::control_timeout).
    pub fn with_control_timeout(mut self, timeout: Duration) -> Self {
        self.control_timeout = timeout;
        self
    }

    /// Sets [`commit_grace`](Self::commit_grace).
    pub fn with_commit_grace(mut self, grace: Duration) -> Self {
        self.commit_grace = grace;
        self
    }

    /// Sets [`poll_in_flight`](Self::poll_in_flight).
    pub fn with_poll_in_flight(mut self, poll: bool) -> Self {
        self.poll_in_flight = poll;
        self
    }

    /// Sets [`stride_descriptors`](Self::stride_descriptors).
    pub fn with_stride_descriptors(mut self, on: bool) -> Self {
        self.stride_descriptors = on;
        self
    }

    /// Sets [`device_memory`](Self::device_memory).
    pub fn with_device_memory(mut self, accept: bool) -> Self {
        self.device_memory = accept;
        self
    }
}
