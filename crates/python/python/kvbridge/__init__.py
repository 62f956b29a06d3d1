"""kvbridge: move an LLM's KV cache from prefill to decode servers.

``kvbridge.sglang`` holds the SGLang planner drop-ins; ``check`` and ``explain`` the handshake
checks. See docs/python.md.
"""

from kvbridge._native import __version__

__all__ = ["__version__"]
