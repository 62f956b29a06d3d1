"""The four classes SGLang asks ``get_kv_class`` for when the backend is ``kvbridge``.

They are SGLang 0.5.23's Mooncake classes (themselves on ``CommonKVManager`` /
``CommonKVSender`` / ``CommonKVReceiver`` / ``CommonKVBootstrapServer``: the bootstrap
server, the ZMQ messages, the transfer worker, the page and DCP relayout, ``KVPoll``), with
the transfer engine swapped for :class:`kvbridge_sglang.engine.KvbridgeTransferEngine`, so
every byte is moved (and bounds-checked) by kvbridge, and the planner calls of the page and DCP
paths answered by kvbridge's planner. A failed write makes the room
``KVPoll.Failed``; its ``KVTransferError`` carries kvbridge's cause.
"""

from __future__ import annotations

import logging
import types

import kvbridge.sglang
from sglang.srt.disaggregation.mooncake import conn as mooncake_conn
from sglang.srt.disaggregation.mooncake.conn import (
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)

from kvbridge_sglang import checks
from kvbridge_sglang.engine import KvbridgeTransferEngine

logger = logging.getLogger(__name__)

# The planner: kvbridge's drop-ins for SGLang's two planner functions (same results and
# exceptions, docs/python.md), in the two transfer methods that call them.
PLANNER = {
    "build_dcp_token_transfer_plan": kvbridge.sglang.build_dcp_token_transfer_plan,
    "group_concurrent_contiguous": kvbridge.sglang.group_concurrent_contiguous,
}


class _Globals(dict):
    """A function's globals: the given names, then whatever the module holds at call time
    (so later rebinding in SGLang's module, e.g. by its HookRegistry, is still seen)."""

    def __init__(self, module: types.ModuleType, names: dict):
        super().__init__(names, __builtins__=module.__dict__["__builtins__"])
        self._module = module.__dict__

    def __missing__(self, name: str):
        return self._module[name]


_PLANNER_GLOBALS = _Globals(mooncake_conn, PLANNER)


def _with_planner(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` (a method of SGLang's Mooncake manager) calling kvbridge's planner."""
    rebound = types.FunctionType(
        fn.__code__, _PLANNER_GLOBALS, fn.__name__, fn.__defaults__, fn.__closure__
    )
    rebound.__kwdefaults__ = fn.__kwdefaults__
    rebound.__qualname__ = fn.__qualname__
    rebound.__doc__ = fn.__doc__
    return rebound


class KvbridgeKVManager(MooncakeKVManager):
    sender_trace_module = "kvbridge"
    # The prefill's status message carries its failure reason (kvbridge's cause included), so
    # the decode's KVTransferError says why, not only that the prefill failed. Tagged, so a
    # peer of another backend cannot mistake it for its own layout.
    kv_status_msg_tag = b"KVBRIDGE_STATUS"
    kv_status_msg_carries_reason = True

    # The page path and the DCP path plan with kvbridge's planner.
    _send_kvcache_generic = _with_planner(MooncakeKVManager._send_kvcache_generic)
    send_kvcache_dcp = _with_planner(MooncakeKVManager.send_kvcache_dcp)

    def init_engine(self) -> None:
        # Called by the Mooncake manager's __init__ before the buffers are registered.
        self.engine = KvbridgeTransferEngine(checks.transport(), host=self.local_ip)

    def _with_cause(self, failure_reason: str) -> str:
        # The worker's reason names the room and the peer; kvbridge's error says why.
        cause = self.engine.take_error() if hasattr(self, "engine") else None
        return f"{failure_reason}; kvbridge: {cause}" if cause else failure_reason

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None:
        super().record_failure(bootstrap_room, self._with_cause(failure_reason))

    def conclude_failure(self, *, bootstrap_room: int, failure_reason: str, targets=None):
        return super().conclude_failure(
            bootstrap_room=bootstrap_room,
            failure_reason=self._with_cause(failure_reason),
            targets=targets,
        )

    def teardown(self) -> None:
        super().teardown()
        self.engine.close()


class KvbridgeKVSender(MooncakeKVSender):
    pass


class KvbridgeKVReceiver(MooncakeKVReceiver):
    pass


class KvbridgeKVBootstrapServer(MooncakeKVBootstrapServer):
    pass
