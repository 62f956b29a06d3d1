"""kvbridge's own checks on SGLang's server arguments, run before SGLang's PD checks."""

from __future__ import annotations

import os
from typing import Any

import kvbridge

# Env variable choosing the engine's transport (docs/sglang.md, "Settings").
TRANSPORT_ENV = "KVBRIDGE_SGLANG_TRANSPORT"
TRANSPORTS = ("tcp", "loopback")


def transport() -> str:
    """The kvbridge transport of this process's managers: ``tcp`` unless the env says."""
    name = os.environ.get(TRANSPORT_ENV, "tcp").strip() or "tcp"
    if name not in TRANSPORTS:
        raise ValueError(
            f"{TRANSPORT_ENV}={name!r} is not a transport the SGLang backend kvbridge uses; "
            f"set it to one of {', '.join(TRANSPORTS)} (tcp reaches any host, loopback only "
            "managers of one process), or unset it for tcp"
        )
    return name


def check_server_args(server_args: Any) -> None:
    """Refuses what kvbridge's SGLang backend cannot move, each with its fix."""
    transport()
    page_size = getattr(server_args, "page_size", None) or 1
    dcp_size = getattr(server_args, "dcp_size", None) or 1
    # Raises ValueError with the remedy for a page or DCP size of zero.
    kvbridge.virtual_page_size(int(page_size), int(dcp_size))
    if os.environ.get("SGLANG_DISAGG_STAGING_BUFFER", "").lower() in ("1", "true"):
        raise ValueError(
            "SGLANG_DISAGG_STAGING_BUFFER is set, but the transfer backend kvbridge writes "
            "straight into the decode's KV pool and has no staging buffers; unset "
            "SGLANG_DISAGG_STAGING_BUFFER or use --disaggregation-transfer-backend mooncake"
        )
