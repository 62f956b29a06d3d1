//! The one error type of `kvbridge-coordinator`.

use std::time::Duration;

use std::fmt;

use crate::channel::Endpoint;
use crate::ids::RoomId;
use crate::state::{KvTransferError, RoomState};

/// Which agent reports an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Side {
    /// A [`PrefillAgent`](crate::PrefillAgent).
    Prefill,
    /// A [`DecodeAgent`](crate::DecodeAgent).
    Decode,
}

impl Side {
    /// `"prefill"` or `"decode"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything a coordinator operation (agents, control channels, directories) can fail with.
///
/// A failed *transfer* is reported as [`CoordinatorError::Transfer`], whose text is SGLang's
/// `KVTransferError(bootstrap_room={room}): {reason}`. Control-channel implementations (the
/// in-process hub here, the network one elsewhere) report through the `Channel*` variants.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoordinatorError {
    /// The room failed; the reason is the first one recorded for it.
    #[error(transparent)]
    Transfer(#[from] KvTransferError),

    /// The room is not known to this agent (never created, or already cleared).
    #[error(
        "room {room} is not known to this {side} agent (never created, or cleared after it \
         ended); create it first and do not use a room after clear()"
    )]
    UnknownRoom {
        /// The room asked for.
        room: RoomId,
        /// The agent.
        side: Side,
    },

    /// The room already exists on this agent and was not cleared.
    #[error(
        "room {room} already exists on this {side} agent (state {state}); room ids may be \
         reused only after both sides cleared them"
    )]
    DuplicateRoom {
        /// The room asked for.
        room: RoomId,
        /// The agent.
        side: Side,
        /// Its current state.
        state: RoomState,
    },

    /// The operation needs a room state the room is not in yet.
    #[error(
        "room {room} is in state {state}, but {operation} needs {needed}; wait for it \
         (e.g. PrefillAgent::wait_ready) before calling {operation}"
    )]
    RoomNotReady {
        /// The room.
        room: RoomId,
        /// Its current state.
        state: RoomState,
        /// What was attempted.
        operation: &'static str,
        /// The state it needs.
        needed: RoomState,
    },

    /// The caller passed something that cannot work (wrong chunk sizes, too many pages, ...).
    #[error("invalid {what}: {message}")]
    InvalidRequest {
        /// Which argument.
        what: &'static str,
        /// What was wrong, the values seen and the fix.
        message: String,
    },

    /// The agent's own configuration or memory does not match its descriptor.
    #[error("invalid agent setup: {message}")]
    InvalidSetup {
        /// What was wrong, the values seen and the fix.
        message: String,
    },

    /// A room's pages could not be proven safe to reuse in time: some sender neither
    /// acknowledged the abort nor was cut off by the transport. The pages must stay quarantined.
    #[error(
        "room {room}: no proof after {waited:?} that every sender stopped writing (still \
         unacknowledged: {pending}); keep the room's pages out of reuse, check the prefill \
         peers' health, or raise fence_timeout"
    )]
    FenceTimeout {
        /// The room.
        room: RoomId,
        /// How long we waited.
        waited: Duration,
        /// The peers that did not acknowledge, comma separated.
        pending: String,
    },

    /// The room ended in Success: there is nothing to fence, the pages hold the KV.
    #[error(
        "room {room} ended in Success, so its pages hold the transferred KV and are not \
         released by release_when_fenced; free them through your allocator when the request ends"
    )]
    NotFailed {
        /// The room.
        room: RoomId,
    },

    /// The agent was shut down.
    #[error("the {side} agent is shut down; create a new agent")]
    Shutdown {
        /// The agent.
        side: Side,
    },

    /// A control message could not be sent or received.
    #[error("control channel {channel}: sending to {endpoint} failed: {reason}")]
    ChannelSend {
        /// The channel implementation's name, e.g. `"in-process"`.
        channel: &'static str,
        /// The destination.
        endpoint: Endpoint,
        /// What happened and what to check.
        reason: String,
    },

    /// No endpoint of that name is reachable on this channel.
    #[error(
        "control channel {channel}: no endpoint {endpoint} is reachable; check the peer is \
         running and the endpoint string it advertised"
    )]
    UnknownEndpoint {
        /// The channel implementation's name.
        channel: &'static str,
        /// The endpoint asked for.
        endpoint: Endpoint,
    },

    /// A send did not complete within its deadline (the peer is not draining its queue).
    #[error(
        "control channel {channel}: sending {message} to {endpoint} did not complete within \
         {timeout:?}; the peer is not reading its control messages (overloaded or hung)"
    )]
    SendTimeout {
        /// The channel implementation's name.
        channel: &'static str,
        /// The destination.
        endpoint: Endpoint,
        /// The message kind.
        message: &'static str,
        /// The deadline.
        timeout: Duration,
    },

    /// The channel is closed (shut down locally, or the endpoint name is taken).
    #[error("control channel {channel} is closed: {reason}")]
    ChannelClosed {
        /// The channel implementation's name.
        channel: &'static str,
        /// Why.
        reason: String,
    },

    /// A peer sent something that breaks the control protocol.
    #[error("control channel {channel}: peer {endpoint} broke the protocol: {message}")]
    Protocol {
        /// The channel implementation's name.
        channel: &'static str,
        /// The peer.
        endpoint: Endpoint,
        /// What was wrong.
        message: String,
    },

    /// A failure specific to a third-party control channel or directory.
    #[error("{component}: {source}")]
    Custom {
        /// The component's name.
        component: &'static str,
        /// Its own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },

    /// The prefill directory could not resolve a bootstrap address.
    #[error(
        "could not fetch prefill parallel info from bootstrap_addr: {addr}: {reason}; check \
         the prefill is running and has registered all its ranks"
    )]
    Directory {
        /// The bootstrap address.
        addr: String,
        /// What happened.
        reason: String,
    },

    /// A request to a bootstrap service failed (unreachable, timed out, refused, or answered
    /// something that is not the bootstrap protocol).
    #[error(
        "bootstrap service at {addr}: {reason}; check the prefill process is running, serves its \
         bootstrap port at {addr}, and runs the same kvbridge version"
    )]
    Bootstrap {
        /// The bootstrap address.
        addr: String,
        /// What happened, with the route and the HTTP status when there was one.
        reason: String,
    },

    /// The transport failed outside any room (connect, register, ...).
    #[error("transport {transport}: {context}: {source}")]
    Transport {
        /// The transport's name.
        transport: &'static str,
        /// What was being done.
        context: String,
        /// The transport's error.
        #[source]
        source: kvbridge_transport::TransportError,
    },
}

/// `Result` with [`CoordinatorError`] as the default error.
pub type Result<T, E = CoordinatorError> = std::result::Result<T, E>;
