//! Agent configuration: every deadline and bound, with SGLang's defaults where it has one.

use std::time::Duration;

use kvbridge_handshake::CheckOptions;

/// Configuration of a `PrefillAgent`. Start from [`Default`] and change
/// fields with the `with_*` builders:
/// `PrefillConfig::default().with_bootstrap_timeout(Duration::from_secs(30))`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PrefillConfig {
    /// A room still Bootstrapping (not every decode rank sent its metadata) after this long
    /// fails with `Request {room} timed out after {secs}s in KVPoll.Bootstrapping`
    /// (SGLang `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, 300 s).
    pub bootstrap_timeout: Duration,
    /// A room that is ready (WaitingForInput) or Transferring fails if it does not end within
    /// this (`Request {room} timed out after {secs}s in KVPoll.{state}`; default 300 s, as the
    /// decode's waiting timeout), so a prefill room never waits forever on a vanished decode or
    /// a scheduler that never sends the last chunk.
    pub waiting_timeout: Duration,
    /// Deadline of every transport batch, counted from posting (default 30 s).
    pub batch_timeout: Duration,
    /// Extra time past a batch's deadline before the transport is considered broken and the
    /// room poisoned (no abort-ack is then sent, default 5 s).
    pub fence_grace: Duration,
    /// Deadline of every control-message send (SGLang prefill: 30 s).
    pub control_send_timeout: Duration,
    /// Messages queued per peer before sends to it fail (default 1024).
    pub control_queue: usize,
    /// Rooms (created or announced by a decode) held at once; more are refused (default 65536).
    pub max_rooms: usize,
    /// Batches in flight per room before `send_chunk` waits (default 64).
    pub max_inflight_batches: usize,
    /// Compatibility envelope for the handshake checks.
    pub check: CheckOptions,
    /// Gather strided source rows into registered pack buffers and post contiguous ranges
    /// (default `None`: post the planner's strided ops as they are). Set with
    /// [`with_pack_buffers`](Self::with_pack_buffers); the agent then needs its KV regions'
    /// handles (`PrefillAgentBuilder::kv_regions`).
    pub pack_buffers: Option<PackBuffers>,
}

impl PrefillConfig {
    /// Sets [`bootstrap_timeout`](Self::bootstrap_timeout).
    #[must_use]
    pub fn with_bootstrap_timeout(mut self, bootstrap_timeout: Duration) -> Self {
        self.bootstrap_timeout = bootstrap_timeout;
        self
    }

    /// Sets [`waiting_timeout`](Self::waiting_timeout).
    #[must_use]
    pub fn with_waiting_timeout(mut self, waiting_timeout: Duration) -> Self {
        self.waiting_timeout = waiting_timeout;
        self
    }

    /// Sets [`batch_timeout`](Self::batch_timeout).
    #[must_use]
    pub fn with_batch_timeout(mut self, batch_timeout: Duration) -> Self {
        self.batch_timeout = batch_timeout;
        self
    }

    /// Sets [`fence_grace`](Self::fence_grace).
    #[must_use]
    pub fn with_fence_grace(mut self, fence_grace: Duration) -> Self {
        self.fence_grace = fence_grace;
        self
    }

    /// Sets [`control_send_timeout`](Self::control_send_timeout).
    #[must_use]
    pub fn with_control_send_timeout(mut self, control_send_timeout: Duration) -> Self {
        self.control_send_timeout = control_send_timeout;
        self
    }

    /// Sets [`control_queue`](Self::control_queue).
    #[must_use]
    pub fn with_control_queue(mut self, control_queue: usize) -> Self {
        self.control_queue = control_queue;
        self
    }

    /// Sets [`max_rooms`](Self::max_rooms).
    #[must_use]
    pub fn with_max_rooms(mut self, max_rooms: usize) -> Self {
        self.max_rooms = max_rooms;
        self
    }

    /// Sets [`max_inflight_batches`](Self::max_inflight_batches).
    #[must_use]
    pub fn with_max_inflight_batches(mut self, max_inflight_batches: usize) -> Self {
        self.max_inflight_batches = max_inflight_batches;
        self
    }

    /// Sets [`check`](Self::check).
    #[must_use]
    pub fn with_check(mut self, check: CheckOptions) -> Self {
        self.check = check;
        self
    }

    /// Sets [`pack_buffers`](Self::pack_buffers): this configuration with pack buffers on.
    #[must_use]
    pub fn with_pack_buffers(mut self, pack: PackBuffers) -> Self {
        self.pack_buffers = Some(pack);
        self
    }
}

/// The prefill's pack-buffer pool ([`PrefillConfig::pack_buffers`]): a fixed number of
/// registered buffers, each holding one batch (one chunk's rows for one decode rank).
///
/// A KV op whose source rows are strided (a DCP relayout: every `d`-th row of a prefill page)
/// is gathered into a buffer in destination order, and the batch posts contiguous ranges from
/// it instead: one per layer, chunk and destination rank when the decode's pages of the chunk
/// are adjacent. What a GPU engine does with a gather kernel before an RDMA write. A buffer is
/// written only while no batch reads it: it returns to the pool once its batch is final, and a
/// batch that finds every buffer in use waits for one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PackBuffers {
    /// Buffers in the pool (at least 1); batches in flight with a buffer are bounded by it.
    pub count: usize,
    /// The most tokens of one chunk (`send_chunk` refuses longer chunks).
    pub max_chunk_tokens: u64,
    /// The smallest decode DCP size this prefill sends to: a decode rank of DCP `d` receives at
    /// most `ceil(max_chunk_tokens / d)` tokens of a chunk, which sizes each buffer.
    pub min_decode_dcp: u64,
}

impl PackBuffers {
    /// `count` buffers for chunks of up to `max_chunk_tokens` tokens sent to decode ranks of
    /// DCP size `min_decode_dcp` or more.
    pub fn new(count: usize, max_chunk_tokens: u64, min_decode_dcp: u64) -> Self {
        Self {
            count,
            max_chunk_tokens,
            min_decode_dcp,
        }
    }
}

impl Default for PrefillConfig {
    fn default() -> Self {
        Self {
            bootstrap_timeout: Duration::from_secs(300),
            waiting_timeout: Duration::from_secs(300),
            batch_timeout: kvbridge_transport::DEFAULT_BATCH_TIMEOUT,
            fence_grace: Duration::from_secs(5),
            control_send_timeout: Duration::from_secs(30),
            control_queue: 1024,
            max_rooms: 65_536,
            max_inflight_batches: 64,
            check: CheckOptions::default(),
            pack_buffers: None,
        }
    }
}

/// Configuration of a `DecodeAgent`. Start from [`Default`] and change
/// fields with the `with_*` builders:
/// `DecodeConfig::default().with_fence_timeout(Duration::from_secs(10))`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DecodeConfig {
    /// The handshake of a room (directory lookup, registration with every prefill peer) must
    /// finish within this, else the room fails (default 30 s; SGLang retries 15 × 1 s).
    pub bootstrap_timeout: Duration,
    /// A room whose metadata was sent fails if no Success arrives within this
    /// (`Request {room} timed out after {secs}s in KVPoll.WaitingForInput`;
    /// SGLang `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s).
    pub waiting_timeout: Duration,
    /// Heartbeat period towards every registered prefill peer (SGLang 5 s).
    pub heartbeat_interval: Duration,
    /// Consecutive unanswered heartbeats that declare a prefill peer dead (SGLang 2).
    pub heartbeat_max_failures: u32,
    /// Deadline of every control-message send (SGLang decode: 1 s).
    pub control_send_timeout: Duration,
    /// Messages queued per peer before sends to it fail (default 1024).
    pub control_queue: usize,
    /// How long `release_when_fenced` waits for every
    /// sender's abort-ack before giving up (the pages then stay quarantined; default 30 s).
    pub fence_timeout: Duration,
    /// Aborts not yet acknowledged are re-sent this often while a fence is awaited (default 1 s).
    pub abort_resend_interval: Duration,
    /// Fail rooms whose cached prefix is not a multiple of the virtual page
    /// (`page_size · dcp_size`) with SGLang's text, instead of rounding the prefix down and
    /// receiving the tail again (default false).
    pub strict_prefix_alignment: bool,
    /// Rooms held at once; more are refused (default 65536).
    pub max_rooms: usize,
    /// Compatibility envelope for the handshake checks.
    pub check: CheckOptions,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            bootstrap_timeout: Duration::from_secs(30),
            waiting_timeout: Duration::from_secs(300),
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_max_failures: 2,
            control_send_timeout: Duration::from_secs(1),
            control_queue: 1024,
            fence_timeout: Duration::from_secs(30),
            abort_resend_interval: Duration::from_secs(1),
            strict_prefix_alignment: false,
            max_rooms: 65_536,
            check: CheckOptions::default(),
        }
    }
}

impl DecodeConfig {
    /// Sets [`bootstrap_timeout`](Self::bootstrap_timeout).
    #[must_use]
    pub fn with_bootstrap_timeout(mut self, bootstrap_timeout: Duration) -> Self {
        self.bootstrap_timeout = bootstrap_timeout;
        self
    }

    /// Sets [`waiting_timeout`](Self::waiting_timeout).
    #[must_use]
    pub fn with_waiting_timeout(mut self, waiting_timeout: Duration) -> Self {
        self.waiting_timeout = waiting_timeout;
        self
    }

    /// Sets [`heartbeat_interval`](Self::heartbeat_interval).
    #[must_use]
    pub fn with_heartbeat_interval(mut self, heartbeat_interval: Duration) -> Self {
        self.heartbeat_interval = heartbeat_interval;
        self
    }

    /// Sets [`heartbeat_max_failures`](Self::heartbeat_max_failures).
    #[must_use]
    pub fn with_heartbeat_max_failures(mut self, heartbeat_max_failures: u32) -> Self {
        self.heartbeat_max_failures = heartbeat_max_failures;
        self
    }

    /// Sets [`control_send_timeout`](Self::control_send_timeout).
    #[must_use]
    pub fn with_control_send_timeout(mut self, control_send_timeout: Duration) -> Self {
        self.control_send_timeout = control_send_timeout;
        self
    }

    /// Sets [`control_queue`](Self::control_queue).
    #[must_use]
    pub fn with_control_queue(mut self, control_queue: usize) -> Self {
        self.control_queue = control_queue;
        self
    }

    /// Sets [`fence_timeout`](Self::fence_timeout).
    #[must_use]
    pub fn with_fence_timeout(mut self, fence_timeout: Duration) -> Self {
        self.fence_timeout = fence_timeout;
        self
    }

    /// Sets [`abort_resend_interval`](Self::abort_resend_interval).
    #[must_use]
    pub fn with_abort_resend_interval(mut self, abort_resend_interval: Duration) -> Self {
        self.abort_resend_interval = abort_resend_interval;
        self
    }

    /// Sets [`strict_prefix_alignment`](Self::strict_prefix_alignment).
    #[must_use]
    pub fn with_strict_prefix_alignment(mut self, strict_prefix_alignment: bool) -> Self {
        self.strict_prefix_alignment = strict_prefix_alignment;
        self
    }

    /// Sets [`max_rooms`](Self::max_rooms).
    #[must_use]
    pub fn with_max_rooms(mut self, max_rooms: usize) -> Self {
        self.max_rooms = max_rooms;
        self
    }

    /// Sets [`check`](Self::check).
    #[must_use]
    pub fn with_check(mut self, check: CheckOptions) -> Self {
        self.check = check;
        self
    }
}
