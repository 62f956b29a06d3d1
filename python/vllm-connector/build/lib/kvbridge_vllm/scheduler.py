"""The scheduler side of :class:`~kvbridge_vllm.connector.KvbridgeConnector`, without vLLM.

vLLM's scheduler asks the connector, per request, how many prompt tokens a remote prefill holds
(``get_num_new_matched_tokens``), tells it which blocks it allocated for them
(``update_state_after_alloc``) and when a request finished (``request_finished``); once a step
the connector hands its workers what to do (``build_connector_meta``) and hears back what they
finished (``update_connector_output``). This module keeps that state with plain values, so its
rules are tested without vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import Any, Iterable, Mapping, Optional

from kvbridge_vllm.params import RemoteKv, remote_kv, wants_remote_decode
from kvbridge_vllm.settings import Settings

logger = logging.getLogger("vllm.kvbridge")


@dataclasses.dataclass(frozen=True)
class Send:
    """A finished prefill request whose blocks wait for its decode: room ``room``."""

    req_id: str
    room: int
    block_ids: tuple
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class Receive:
    """A decode request whose prompt KV comes from its prefill into ``block_ids`` (the
    request's block table from token 0; the first ``cached_tokens`` are held already)."""

    req_id: str
    kv: RemoteKv
    block_ids: tuple
    cached_tokens: int


@dataclasses.dataclass
class Work:
    """One step's work for the workers."""

    sends: list = dataclasses.field(default_factory=list)
    receives: list = dataclasses.field(default_factory=list)
    #: Decode requests that ended while their KV was on its way: their rooms are aborted.
    aborts: list = dataclasses.field(default_factory=list)


def new_room() -> int:
    """A random room id of 63 bits (SGLang's range, which kvbridge's rooms take)."""
    return secrets.randbits(63)


class SchedulerState:
    """What the scheduler side knows. ``block_size`` and ``tp_size`` are this server's."""

    def __init__(self, settings: Settings, block_size: int, tp_size: int, producer: bool):
        self.settings = settings
        self.block_size = block_size
        self.tp_size = tp_size
        self.producer = producer
        self._work = Work()
        #: Prefill requests whose blocks are held until their transfer ends.
        self._sending: set = set()
        #: Decode requests whose KV is on its way.
        self._loading: set = set()
        #: Decode requests already told why their KV is not loaded (logged once).
        self._refused: set = set()

    # --- decode ---------------------------------------------------------------------------

    def matched_tokens(self, req_id: str, params: Optional[Mapping[str, Any]], num_computed: int) -> tuple:
        """``(tokens to load, asynchronously)`` for a request: every prompt token the prefill
        computed beyond what this server holds. Side-effect free but for one log line per
        request that cannot be served."""
        kv = self._remote(req_id, params)
        if kv is None:
            return 0, False
        count = kv.num_tokens - num_computed
        return (count, True) if count > 0 else (0, False)

    def _remote(self, req_id: str, params: Optional[Mapping[str, Any]]) -> Optional[RemoteKv]:
        try:
            kv = remote_kv(params)
        except ValueError as e:
            self._refuse(req_id, str(e))
            return None
        if kv is None:
            return None
        if kv.block_size != self.block_size or kv.tp_size != self.tp_size:
            self._refuse(
                req_id,
                f"prefill block size {kv.block_size} and TP {kv.tp_size} -> decode block size "
                f"{self.block_size} and TP {self.tp_size}: this connector moves KV between "
                "servers of the same --block-size and --tensor-parallel-size; start both with "
                "the same values",
            )
            return None
        return kv

    def _refuse(self, req_id: str, why: str) -> None:
        if req_id not in self._refused:
            self._refused.add(req_id)
            logger.error("kvbridge: request %s computes its prompt here, no KV is loaded: %s", req_id, why)

    def after_alloc(self, req_id: str, params: Optional[dict], block_ids: Iterable[int], num_external_tokens: int) -> None:
        """The blocks vLLM allocated for a request (its whole table from token 0)."""
        kv = self._remote(req_id, params)
        if kv is None or params is None:
            return
        # One transfer per request: vLLM may call this again once the KV landed.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return
        self._loading.add(req_id)
        self._work.receives.append(
            Receive(req_id, kv, tuple(int(b) for b in block_ids), kv.num_tokens - num_external_tokens)
        )

    # --- prefill --------------------------------------------------------------------------

    def finished(
        self,
        req_id: str,
        params: Optional[Mapping[str, Any]],
        completed: bool,
        block_ids: Iterable[int],
        num_computed_tokens: int,
    ) -> tuple:
        """``(hold the blocks, kv_transfer_params of the response)`` for a finished request.
        ``completed``: it stopped or reached its length (not aborted)."""
        if req_id in self._loading:
            # A decode request that ended while its KV was coming (an abort): its room is
            # aborted, and vLLM keeps the blocks until the worker reports it received (fenced).
            self._work.aborts.append(req_id)
            return False, None
        if not (self.producer and wants_remote_decode(params)):
            return False, None
        blocks = tuple(int(b) for b in block_ids)
        if not completed or not blocks or num_computed_tokens < 1:
            return False, None
        room = new_room()
        self._sending.add(req_id)
        self._work.sends.append(Send(req_id, room, blocks, num_computed_tokens))
        kv = RemoteKv(
            bootstrap_addr=self.settings.bootstrap_addr,
            room=room,
            num_tokens=num_computed_tokens,
            block_size=self.block_size,
            tp_size=self.tp_size,
        )
        return True, kv.to_params()

    # --- both -----------------------------------------------------------------------------

    def take_work(self) -> Work:
        work, self._work = self._work, Work()
        return work

    def transfers_ended(self, finished_sending: Iterable[str], finished_recving: Iterable[str]) -> None:
        self._sending.difference_update(finished_sending or ())
        self._loading.difference_update(finished_recving or ())

    def sends_pending(self) -> bool:
        """Whether a prefill transfer is still on: vLLM keeps stepping (the workers poll)."""
        return bool(self._sending)
