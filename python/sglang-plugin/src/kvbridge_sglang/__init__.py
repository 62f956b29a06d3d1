"""kvbridge as an SGLang transfer backend: ``--disaggregation-transfer-backend kvbridge``.

SGLang loads :func:`kvbridge_sglang.plugin.register` through its ``sglang.srt.plugins``
entry point; see docs/sglang.md.
"""

BACKEND = "kvbridge"
SGLANG_VERSION = "0.5.23"

__all__ = ["BACKEND", "SGLANG_VERSION"]
