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
import re
import secrets
from typing import Any, Iterable, Mapping, Optional

from kvbridge_vllm.params import FIELD, RemoteKv, remote_kv, requested_room, wants_remote_decode
from kvbridge_vllm.settings import Settings

logger = logging.getLogger("vllm.kvbridge")

# W3C trace context: version, trace id, parent span id, flags (lower-case hex).
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


@dataclasses.dataclass(frozen=True)
class Send:
    """A finished prefill request whose blocks wait for its decode: room ``room``."""

    req_id: str
    room: int
    block_ids: tuple
    num_tokens: int
    #: The request's W3C trace context (vLLM's ``Request.trace_headers``), for the room's spans.
    traceparent: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Receive:
    """A decode request whose prompt KV comes from its prefill into ``block_ids`` (the
    request's block table from token 0; the first ``cached_tokens`` are held already)."""

    req_id: str
    kv: RemoteKv
    block_ids: tuple
    cached_tokens: int
    traceparent: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Stream:
    """A prefill request of the concurrent flow in this step: its room (the router's), its
    block table so far, the tokens its KV cache holds once this step's forward pass ends, and
    its prompt length (the KV its decode loads). The workers send its pages as they are
    computed, layer by layer."""

    req_id: str
    room: int
    block_ids: tuple
    computed: int
    num_tokens: int
    #: Each layer as it is computed (else the step's rows once its forward pass ended).
    layerwise: bool = True
    traceparent: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """What vLLM's scheduler output says of one request this step: its new blocks (``None``:
    none), whether they replace its table (a new or resumed request), and its computed tokens
    before the step plus those scheduled in it."""

    req_id: str
    new_blocks: Optional[tuple]
    replace: bool
    computed_after: int


@dataclasses.dataclass
class Work:
    """One step's work for the workers."""

    sends: list = dataclasses.field(default_factory=list)
    receives: list = dataclasses.field(default_factory=list)
    streams: list = dataclasses.field(default_factory=list)
    #: Requests that ended while their KV was on its way (a decode's load, or a prefill's
    #: stream that did not complete): their rooms are aborted.
    aborts: list = dataclasses.field(default_factory=list)
    #: Streamed prefill requests that finished: vLLM holds their blocks from now on, until the
    #: workers report the transfer ended.
    released: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Streaming:
    room: int
    num_tokens: int
    layerwise: bool
    blocks: list = dataclasses.field(default_factory=list)
    scheduled: bool = False
    aborted: bool = False
    traceparent: Optional[str] = None


def traceparent(trace_headers: Optional[Mapping[str, str]]) -> Optional[str]:
    """The W3C ``traceparent`` of a request's headers (vLLM keeps them in
    ``Request.trace_headers`` when it traces, ``--otlp-traces-endpoint``), or ``None``."""
    if not trace_headers:
        return None
    value = trace_headers.get("traceparent")
    # A malformed header is the client's: it is dropped rather than failing the transfer.
    return value if isinstance(value, str) and _TRACEPARENT.fullmatch(value) else None


def new_room() -> int:
    """A random room id of 63 bits (SGLang's range, which kvbridge's rooms take)."""
    return secrets.randbits(63)


class SchedulerState:
    """What the scheduler side knows. ``block_size`` and ``tp_size`` are this server's. The two
    servers' TP sizes may differ: kvbridge slices a GQA model's heads between them, and sends
    an MLA rank's whole latent cache from one prefill rank; which TP pairs a model allows,
    kvbridge's handshake checks when the decode asks for the room. Block sizes may differ too
    where the cache keeps token rows (MLA, vLLM's GPU layout); ``equal_blocks`` says this
    server's cache does not (vLLM's CPU attention: head-major blocks)."""

    def __init__(self, settings: Settings, block_size: int, tp_size: int, producer: bool, equal_blocks: bool = True):
        self.settings = settings
        self.block_size = block_size
        self.equal_blocks = equal_blocks
        self.tp_size = tp_size
        self.producer = producer
        self._work = Work()
        #: Prefill requests whose blocks are held until their transfer ends.
        self._sending: set = set()
        #: Decode requests whose KV is on its way.
        self._loading: set = set()
        #: Decode requests already told why their KV is not loaded (logged once).
        self._refused: set = set()
        #: Prefill requests of the concurrent flow, until they finish.
        self._streaming: dict = {}

    # --- decode ---------------------------------------------------------------------------

    def matched_tokens(
        self, req_id: str, params: Optional[Mapping[str, Any]], num_computed: int, num_prompt_tokens: int
    ) -> tuple:
        """``(tokens to load, asynchronously)`` for a request: every prompt token the prefill
        computed beyond what this server holds. Side-effect free but for one log line per
        request that cannot be served."""
        kv = self._remote(req_id, params)
        if kv is None:
            return 0, False
        count = kv.tokens(num_prompt_tokens) - num_computed
        return (count, True) if count > 0 else (0, False)

    def _remote(self, req_id: str, params: Optional[Mapping[str, Any]]) -> Optional[RemoteKv]:
        try:
            kv = remote_kv(params)
        except ValueError as e:
            self._refuse(req_id, str(e))
            return None
        if kv is None:
            return None
        # The concurrent flow names no sizes: kvbridge's opening exchange checks the layouts.
        if kv.block_size is None and kv.tp_size is None:
            return kv
        if kv.block_size != self.block_size and self.equal_blocks:
            self._refuse(
                req_id,
                f"prefill block size {kv.block_size} -> decode block size {self.block_size}: "
                "vLLM's CPU attention keeps head-major blocks, which kvbridge moves between "
                "servers of the same --block-size only; start both with the same value (an MLA "
                "model's blocks, or a GPU cache's, may differ)",
            )
            return None
        return kv

    def _refuse(self, req_id: str, why: str) -> None:
        if req_id not in self._refused:
            self._refused.add(req_id)
            logger.error("kvbridge: request %s computes its prompt here, no KV is loaded: %s", req_id, why)

    def after_alloc(
        self,
        req_id: str,
        params: Optional[dict],
        block_ids: Iterable[int],
        num_external_tokens: int,
        num_prompt_tokens: int,
        trace: Optional[str] = None,
    ) -> None:
        """The blocks vLLM allocated for a request (its whole table from token 0); ``trace`` its
        ``traceparent``, which the room's spans take as parent."""
        if self.producer:
            self._start_stream(req_id, params, num_prompt_tokens, trace)
            return
        kv = self._remote(req_id, params)
        if kv is None or params is None:
            return
        # One transfer per request: vLLM may call this again once the KV landed.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return
        self._loading.add(req_id)
        self._work.receives.append(
            Receive(req_id, kv, tuple(int(b) for b in block_ids), kv.tokens(num_prompt_tokens) - num_external_tokens, trace)
        )

    # --- prefill, concurrent flow ---------------------------------------------------------

    def _start_stream(self, req_id: str, params: Optional[dict], num_prompt_tokens: int, trace: Optional[str]) -> None:
        if req_id in self._streaming:
            return
        try:
            room = requested_room(params)
        except ValueError as e:
            logger.error("kvbridge: request %s: its KV is not kept for a decode: %s", req_id, e)
            return
        if room is None:
            return
        layerwise = params[FIELD].get("layerwise", self.settings.layerwise)
        if not isinstance(layerwise, bool):
            logger.error("kvbridge: request %s: kv_transfer_params[%r]['layerwise'] = %r is not true or false; "
                         "the connector's setting (%s) applies", req_id, FIELD, layerwise, self.settings.layerwise)
            layerwise = self.settings.layerwise
        self._streaming[req_id] = _Streaming(room, num_prompt_tokens, layerwise, traceparent=trace)

    def scheduled(self, steps: Iterable[Scheduled], preempted: Iterable[str] = ()) -> None:
        """This step's scheduled requests: each streamed one gets its :class:`Stream`. A
        streamed request that vLLM preempts loses its blocks, so its room is aborted (its
        decode computes the prompt itself) rather than read from blocks given to another."""
        for req_id in preempted or ():
            stream = self._streaming.get(req_id)
            if stream is not None and stream.scheduled:
                logger.warning("kvbridge: request %s was preempted mid-prefill: room %d aborted", req_id, stream.room)
                self._work.aborts.append(req_id)
                stream.aborted = True
        for step in steps:
            stream = self._streaming.get(step.req_id)
            if stream is None or stream.aborted:
                continue
            if step.new_blocks is not None:
                if step.replace:
                    stream.blocks = []
                stream.blocks.extend(int(b) for b in step.new_blocks)
            stream.scheduled = True
            computed = min(step.computed_after, stream.num_tokens)
            self._work.streams.append(
                Stream(step.req_id, stream.room, tuple(stream.blocks), computed, stream.num_tokens, stream.layerwise,
                       stream.traceparent)
            )

    # --- prefill --------------------------------------------------------------------------

    def finished(
        self,
        req_id: str,
        params: Optional[Mapping[str, Any]],
        completed: bool,
        block_ids: Iterable[int],
        num_computed_tokens: int,
        trace: Optional[str] = None,
    ) -> tuple:
        """``(hold the blocks, kv_transfer_params of the response)`` for a finished request.
        ``completed``: it stopped or reached its length (not aborted); ``trace`` its
        ``traceparent``."""
        stream = self._streaming.pop(req_id, None)
        if stream is not None:
            return self._stream_finished(req_id, stream, completed)
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
        self._work.sends.append(Send(req_id, room, blocks, num_computed_tokens, trace))
        kv = RemoteKv(
            bootstrap_addr=self.settings.bootstrap_addr,
            room=room,
            num_tokens=num_computed_tokens,
            block_size=self.block_size,
            tp_size=self.tp_size,
        )
        return True, kv.to_params()

    def _stream_finished(self, req_id: str, stream: _Streaming, completed: bool) -> tuple:
        if not stream.scheduled:
            return False, None  # no worker ever saw it: nothing reads its blocks
        # The workers may be reading its blocks: vLLM holds them until the room ended.
        self._sending.add(req_id)
        self._work.released.append(req_id)
        if stream.aborted:
            return True, None  # aborted at preemption
        if not completed:
            self._work.aborts.append(req_id)
            return True, None
        kv = RemoteKv(
            bootstrap_addr=self.settings.bootstrap_addr,
            room=stream.room,
            num_tokens=stream.num_tokens,
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
