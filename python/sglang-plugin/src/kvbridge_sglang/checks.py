"""kvbridge's own checks on SGLang's server arguments, run before SGLang's PD checks."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import kvbridge

# Env variable choosing the engine's transport (docs/sglang.md, "Settings").
TRANSPORT_ENV = "KVBRIDGE_SGLANG_TRANSPORT"
TRANSPORTS = ("tcp", "loopback", "nixl")
# Mooncake's allocator option: it moves SGLang's pools (and aux buffers) into Mooncake's own
# memory pools, which only Mooncake's engine knows how to register.
MOONCAKE_MEM_POOL_ENV = "SGLANG_MOONCAKE_CUSTOM_MEM_POOL"
# The fix named by every refusal of device pools on a host-only transport.
NIXL_FIX = (
    f"set {TRANSPORT_ENV}=nixl on both servers, with a kvbridge built with NIXL (`cargo xtask "
    "nixl-setup`, then `pip install ./crates/python --config-settings=build-args=--features=nixl`; "
    "docs/sglang.md, \"Pools on GPUs\")"
)


def transport() -> str:
    """The kvbridge transport of this process's managers: ``tcp`` unless the env says."""
    name = os.environ.get(TRANSPORT_ENV, "tcp").strip() or "tcp"
    if name not in TRANSPORTS:
        raise ValueError(
            f"{TRANSPORT_ENV}={name!r} is not a transport the SGLang backend kvbridge uses; "
            f"set it to one of {', '.join(TRANSPORTS)} (tcp reaches any host with host pools, "
            "nixl any host with host or GPU pools, loopback only managers of one process), or "
            "unset it for tcp"
        )
    return name


@dataclasses.dataclass(frozen=True)
class PoolMemory:
    """Where a rank's KV (and state) pools live, as kvbridge registers them: ``kind`` is
    ``"host"`` or ``"cuda"`` (``kvbridge.Engine.register``'s kinds), ``device`` the CUDA
    device ordinal (0 for host memory)."""

    kind: str
    device: int = 0

    @property
    def on_host(self) -> bool:
        return self.kind == "host"


def server_device(server_args: Any = None) -> str:
    """The device SGLang's model runner allocates the KV pools on (``--device`` as resolved for
    this process): the published runtime context's, else ``server_args``' resolved value, else
    SGLang's own default for this machine."""
    name = None
    try:
        from sglang.srt.runtime_context import get_device

        name = get_device().device
    except Exception:  # no published context: a manager built outside a scheduler
        pass
    if not name and server_args is not None:
        from sglang.srt.arg_groups.overrides import resolution_result

        name = resolution_result(server_args, "device")
    if not name:
        from sglang.srt.utils.common import get_device as default_device

        name = default_device()
    return str(name)


def pool_memory(kv_args: Any, device: Optional[str] = None) -> PoolMemory:
    """Where the pools of ``kv_args`` (SGLang's ``KVArgs``) live: host memory for
    ``--device cpu``, CUDA device ``kv_args.gpu_id`` for ``--device cuda``. ``device`` is the
    server's device name (default: :func:`server_device`). Raises ``ValueError`` for devices
    kvbridge has no memory kind for.

    The sender consults this too (via ``KvbridgeKVManager.pool_memory``): host pools must not
    take SGLang's CUDA-only paths."""
    name = (device or server_device()).split(":")[0].lower()
    if name == "cpu":
        return PoolMemory("host", 0)
    if name == "cuda":
        gpu = getattr(kv_args, "gpu_id", None)
        if not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0:
            raise ValueError(
                f"the KV pools are on CUDA, but KVArgs.gpu_id is {gpu!r}, not a device "
                "ordinal; SGLang's scheduler sets it from its GPU (--base-gpu-id, "
                "CUDA_VISIBLE_DEVICES): build the manager as the scheduler does"
            )
        return PoolMemory("cuda", gpu)
    raise ValueError(
        f"the KV pools are on device {name!r} (--device {name}); the transfer backend kvbridge "
        "registers host pools (--device cpu) and CUDA pools (--device cuda) only; use one of "
        "those, or another --disaggregation-transfer-backend for this device"
    )


# Transports whose engines move device memory (``Engine.capabilities["device_memory"]``).
DEVICE_TRANSPORTS = ("nixl",)


def refuse_device_pools_on(
    transport_name: str, memory: PoolMemory, capabilities: Optional[dict] = None
) -> None:
    """Raises ``ValueError`` when ``memory`` is device memory and the transport cannot move
    device memory (its CPU would read the device pointers). Without ``capabilities`` (before
    the engine exists) the transport's name decides."""
    if memory.on_host:
        return
    if capabilities is None:
        if transport_name in DEVICE_TRANSPORTS:
            return
    elif capabilities.get("device_memory"):
        return
    raise ValueError(
        f"the KV pools of this server are on CUDA device {memory.device}, but "
        f"{TRANSPORT_ENV}={transport_name} moves host memory only (its CPU would read the "
        f"pools); {NIXL_FIX}, or run both servers with --device cpu"
    )


def check_server_args(server_args: Any) -> None:
    """Refuses what kvbridge's SGLang backend cannot move, each with its fix."""
    transport()
    if os.environ.get(MOONCAKE_MEM_POOL_ENV):
        raise ValueError(
            f"{MOONCAKE_MEM_POOL_ENV}={os.environ[MOONCAKE_MEM_POOL_ENV]!r} is set, but that "
            "allocator is Mooncake's (its pools only Mooncake's engine registers); the transfer "
            f"backend kvbridge registers SGLang's own pools: unset {MOONCAKE_MEM_POOL_ENV}, or "
            "use --disaggregation-transfer-backend mooncake"
        )
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
