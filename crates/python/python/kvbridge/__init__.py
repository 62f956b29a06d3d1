"""kvbridge: move an LLM's KV cache from prefill to decode servers.

``kvbridge.sglang`` holds the SGLang planner drop-ins; ``check`` and ``explain`` the handshake
checks; ``python -m kvbridge.bench`` the benchmarks. See docs/python.md.
"""

from kvbridge._native import (
    __version__,
    align_prefix_down,
    align_prefix_up,
    virtual_page_size,
)
from kvbridge.checks import (
    Explanation,
    PeerDescriptor,
    Problem,
    Report,
    check,
    explain,
    problem_codes,
)

__all__ = [
    "__version__",
    "align_prefix_down",
    "align_prefix_up",
    "virtual_page_size",
    "Explanation",
    "PeerDescriptor",
    "Problem",
    "Report",
    "check",
    "explain",
    "problem_codes",
]

# The transfer engine, the agents and the typed errors (docs/python.md).
from kvbridge._native import (  # noqa: E402
    BadDescriptorError,
    BatchFailedError,
    BootstrapServer,
    CancelledError,
    ClosedError,
    DecodeAgent,
    Engine,
    InvalidArgumentError,
    IoError,
    KvbridgeError,
    KVPoll,
    KVTransferError,
    Memory,
    MemoryAccessError,
    OutOfBoundsError,
    Peer,
    PeerLostError,
    PrefillAgent,
    ProtocolError,
    RoomError,
    TimedOutError,
    Transfer,
    UnknownBatchError,
    UnknownPeerError,
    UnknownRegionError,
    UnsupportedError,
)

__all__ += [
    "BadDescriptorError",
    "BatchFailedError",
    "BootstrapServer",
    "CancelledError",
    "ClosedError",
    "DecodeAgent",
    "Engine",
    "InvalidArgumentError",
    "IoError",
    "KvbridgeError",
    "KVPoll",
    "KVTransferError",
    "Memory",
    "MemoryAccessError",
    "OutOfBoundsError",
    "Peer",
    "PeerLostError",
    "PrefillAgent",
    "ProtocolError",
    "RoomError",
    "TimedOutError",
    "Transfer",
    "UnknownBatchError",
    "UnknownPeerError",
    "UnknownRegionError",
    "UnsupportedError",
]

# OTLP export of the agents' spans, on when OTEL_EXPORTER_OTLP_ENDPOINT is set (docs/tracing.md).
from kvbridge._native import flush_traces, shutdown_traces, traces_exporter  # noqa: E402

__all__ += ["flush_traces", "shutdown_traces", "traces_exporter"]
