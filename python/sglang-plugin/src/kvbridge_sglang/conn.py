"""The four classes SGLang asks ``get_kv_class`` for when the backend is ``kvbridge``.

They are SGLang 0.5.23's Mooncake classes (themselves on ``CommonKVManager`` /
``CommonKVSender`` / ``CommonKVReceiver`` / ``CommonKVBootstrapServer``: the bootstrap
server, the ZMQ messages, the transfer worker, the page and DCP relayout, ``KVPoll``), with
the transfer engine swapped for :class:`kvbridge_sglang.engine.KvbridgeTransferEngine`, so
every byte is moved (and bounds-checked) by kvbridge. A failed write makes the room
``KVPoll.Failed``; its ``KVTransferError`` carries kvbridge's cause.
"""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.mooncake.conn import (
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)

from kvbridge_sglang import checks
from kvbridge_sglang.engine import KvbridgeTransferEngine

logger = logging.getLogger(__name__)


class KvbridgeKVManager(MooncakeKVManager):
    sender_trace_module = "kvbridge"

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
