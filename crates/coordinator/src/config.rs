//! Agent configuration: every deadline and bound, with SGLang's defaults where it has one.

use std::time::Duration;

use kvbridge_handshake::CheckOptions;

/// Configuration of a [`PrefillAgent`](crate::PrefillAgent). Build with struct-update syntax
/// from [`Default`]: `PrefillConfig { bootstrap_timeout: ..., ..Default::default() }`.
#[derive(Debug, Clone)]
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
        }
    }
}

/// Configuration of a [`DecodeAgent`](crate::DecodeAgent). Build with struct-update syntax
/// from [`Default`].
#[derive(Debug, Clone)]
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
    /// How long [`release_when_fenced`](crate::DecodeAgent::release_when_fenced) waits for every
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
