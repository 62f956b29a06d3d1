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
