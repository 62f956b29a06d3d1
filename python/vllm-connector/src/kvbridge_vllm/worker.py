"""The worker side of :class:`~kvbridge_vllm.connector.KvbridgeConnector`: vLLM's KV cache
registered with a ``kvbridge.Engine`` and one kvbridge agent per worker.

A prefill worker holds a ``kvbridge.PrefillAgent`` (and, on TP rank 0, the deployment's
``kvbridge.BootstrapServer``); a decode worker a ``kvbridge.DecodeAgent``. A vLLM block is a
kvbridge page; each layer's cache tensor is one KV entry. Every step vLLM hands the worker the
scheduler's work (:class:`~kvbridge_vllm.scheduler.Work`) and asks what finished; nothing here
waits for the network: rooms are polled, and kvbridge's deadlines end every one of them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

import kvbridge

from kvbridge_vllm.scheduler import Receive, Send, Stream, Work
from kvbridge_vllm.settings import Settings

logger = logging.getLogger("vllm.kvbridge")

# vLLM's CPU attention keeps a layer as [num_blocks, num_kv_heads, block_size, 2 * head_size],
# which its kernel reads as [num_blocks, num_kv_heads, 2, block_size, head_size] (a block holds,
# head by head, the block's K rows, then its V rows): one page of one KV entry per block,
# kvbridge's head-major pages (docs/planning.md, "Head-major pages").
CPU_LAYOUT = "LBHNC"


@dataclasses.dataclass(frozen=True)
class Geometry:
    """This worker's KV cache as vLLM describes it."""

    block_size: int
    num_blocks: int
    total_kv_heads: int
    head_size: int
    tp_size: int
    tp_rank: int
    dtype: str
    #: An MLA model: each layer is ``[num_blocks, 1, block_size, latent]``, every TP rank holding
    #: the whole latent cache (kvbridge's MLA pool, SGLang's layout).
    mla: bool = False
    #: Decode context parallelism (MLA): the DCP group of ``dcp_size`` consecutive TP ranks
    #: shares one block table, and a token at position ``p`` lives on DCP rank ``p % dcp_size``
    #: at offset ``p // dcp_size`` of its block (vLLM's slot mapping with
    #: ``cp_kv_cache_interleave_size`` 1, kvbridge's and SGLang's DCP layout).
    dcp_size: int = 1
    dcp_rank: int = 0

    @property
    def virtual_block_size(self) -> int:
        """Tokens one block id holds across the DCP group: what vLLM's scheduler counts."""
        return self.block_size * self.dcp_size


def check_context_parallel(dcp_size: int, pcp_size: int, interleave: int, mla: bool) -> None:
    """Refuses, before anything starts, the context parallelism kvbridge cannot move: DCP of a
    model that is not MLA (its heads are split by TP already; kvbridge's handshake refuses
    it too), prefill context parallelism, and DCP interleaved in runs of more than one token."""
    if dcp_size > 1 and not mla:
        raise ValueError(
            f"--decode-context-parallel-size {dcp_size} on a model without MLA: KvbridgeConnector "
            "moves DCP KV only for MLA models (one latent per token, split by position); a GQA "
            "model's KV is split by heads across TP ranks. Use --decode-context-parallel-size 1"
        )
    if pcp_size > 1:
        raise ValueError(
            f"--prefill-context-parallel-size {pcp_size}: KvbridgeConnector does not move KV "
            "split by prefill context parallelism yet; use 1 (DCP on an MLA model is supported)"
        )
    if dcp_size > 1 and interleave != 1:
        raise ValueError(
            f"--cp-kv-cache-interleave-size {interleave} with DCP {dcp_size}: KvbridgeConnector "
            "moves DCP KV placed one token per rank in turn (interleave size 1, vLLM's default); "
            "use --cp-kv-cache-interleave-size 1"
        )


# How a layer's cache tensor is laid out, and the KV entries kvbridge moves of it.
HEAD_MAJOR = "head-major"  # vLLM's CPU attention: one entry per layer
TOKEN_MAJOR = "token-major"  # vLLM's GPU FlashAttention: a K entry and a V entry per layer
MLA = "mla"  # [num_blocks, (1,) block_size, latent]: one entry per layer


def cache_planes(name: str, tensor: Any, geometry: Geometry) -> tuple:
    """``(layout, entries)`` of one layer's cache tensor: the views kvbridge registers, each
    a contiguous run of ``num_blocks`` pages. Raises ``ValueError`` naming the shapes it takes
    for any other tensor."""
    nb = geometry.num_blocks
    shape = tuple(tensor.shape)
    if tensor.is_contiguous():
        # vLLM's CPU MLA cache is [num_blocks, 1, block_size, latent]: any rows of a block.
        if geometry.mla and len(shape) >= 2 and shape[0] == nb:
            return MLA, [tensor]
        if not geometry.mla and len(shape) == 4 and shape[0] == nb:
            return HEAD_MAJOR, [tensor]
        if not geometry.mla and len(shape) == 5 and shape[:2] == (2, nb):
            return TOKEN_MAJOR, [tensor[0], tensor[1]]
    raise ValueError(
        f"KV cache tensor {name!r} has shape {shape} (contiguous: {tensor.is_contiguous()}); "
        f"KvbridgeConnector moves contiguous tensors of {nb} blocks laid out as vLLM's CPU "
        "attention keeps them ([num_blocks, kv_heads, block_size, 2 * head_size]), as its GPU "
        "FlashAttention keeps them ([2, num_blocks, block_size, kv_heads, head_size]: K, then V; "
        "not VLLM_KV_CACHE_LAYOUT=HND), or for MLA [num_blocks, (1,) block_size, latent]"
    )


# Transports that read and write device (GPU) memory; tcp moves host memory only.
DEVICE_TRANSPORTS = ("nixl",)


def head_major_blocks(vllm_config: Any) -> bool:
    """Whether this server's cache keeps head-major blocks (vLLM's CPU attention for a model
    without MLA), which kvbridge's planner moves between equal block sizes only. MLA token
    rows and vLLM's GPU layout (token-major K and V) move between any block sizes."""
    if getattr(vllm_config.model_config, "use_mla", False):
        return False
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    return str(device) == "cpu"


def memory_kind(name: str, tensor: Any, transport: str) -> str:
    """``"host"`` or ``"cuda"``: how a cache tensor is registered with kvbridge. A GPU cache
    with a transport that cannot read it, or a device kvbridge does not know, is refused
    before anything is registered."""
    device = tensor.device
    if device.type == "cpu":
        return "host"
    if device.type == "cuda":
        if transport not in DEVICE_TRANSPORTS:
            raise ValueError(
                f"vLLM's KV cache tensor {name!r} is on {device}, and kvbridge's {transport} "
                "transport moves host memory only: set \"transport\": \"nixl\" in "
                "kv_connector_extra_config (a kvbridge wheel built with NIXL: docs/vllm.md, \"Install\")"
            )
        return "cuda"
    raise ValueError(
        f"vLLM's KV cache tensor {name!r} is on {device}: KvbridgeConnector moves caches in host "
        "memory (cpu) or, over nixl, on NVIDIA GPUs (cuda)"
    )


def descriptor(role: str, geometry: Geometry, item_lens: list, layout: str = HEAD_MAJOR) -> "kvbridge.PeerDescriptor":
    """The rank's ``PeerDescriptor``. Head-major MHA: one entry per layer whose page (one vLLM
    block) holds, for each of this rank's heads, each token's K and V (``head_dim`` counts
    both, so kvbridge's checks see the page's true size). Token-major MHA: a K and a V entry
    per layer whose page holds each token's row of the rank's heads (SGLang's MHA pool). MLA:
    one entry per layer of token rows."""
    common = dict(
        role=role,
        page_size=geometry.block_size,
        kv_cache_dtype=geometry.dtype,
        attn_tp_size=geometry.tp_size,
        attn_tp_rank=geometry.tp_rank,
        kv_item_lens=item_lens,
    )
    if geometry.mla:
        return kvbridge.PeerDescriptor(
            kv_pool="mla", dcp_size=geometry.dcp_size, dcp_rank=geometry.dcp_rank, **common
        )
    heads = dict(kv_pool="mha", total_kv_heads=geometry.total_kv_heads)
    if layout == TOKEN_MAJOR:
        return kvbridge.PeerDescriptor(head_dim=geometry.head_size, **heads, **common)
    return kvbridge.PeerDescriptor(kv_layout=CPU_LAYOUT, head_dim=2 * geometry.head_size, **heads, **common)


def _torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass
class _Room:
    job: Any
    posted: bool = False


@dataclasses.dataclass
class _Streamed:
    """A prefill request of the concurrent flow on this worker."""

    room: int
    num_tokens: int
    layerwise: bool
    blocks: tuple = ()
    computed: int = 0
    #: Calls that handed kvbridge rows of it (a part's layers, or a whole part).
    handovers: int = 0
    #: Tokens handed to kvbridge, from the decode's prefix on (``None``: the decode's
    #: metadata has not come yet).
    sent: Optional[int] = None
    last_sent: bool = False
    #: The request finished and vLLM holds its blocks until this worker reports the room.
    released: bool = False
    ended: bool = False


@dataclasses.dataclass
class _Part:
    """What one stream sends in this forward pass: ``pages`` and ``tokens`` of its send
    range, layer by layer from ``next``."""

    req_id: str
    stream: _Streamed
    pages: list
    tokens: int
    last: bool
    next: int = 0


class Worker:
    """One vLLM worker's transfers."""

    def __init__(self, settings: Settings, producer: bool, geometry: Geometry):
        self.settings = settings
        self.producer = producer
        self.geometry = geometry
        self.engine: Optional[kvbridge.Engine] = None
        self.agent: Any = None
        self.server: Optional[kvbridge.BootstrapServer] = None
        self._rooms: dict = {}  # req_id -> _Room
        self._streams: dict = {}  # req_id -> _Streamed
        self._parts: list = []  # this forward pass's _Part of each ready stream
        self._layers: dict = {}  # layer name -> layer index
        self._entries_per_layer = 1  # KV entries registered of each layer's tensor
        self._cuda = False
        self._load_errors: set = set()

    # --- set-up ---------------------------------------------------------------------------

    def register(self, kv_caches: dict) -> None:
        """Registers every layer's cache tensor and starts the agent."""
        g, s = self.geometry, self.settings
        if not kv_caches:
            raise ValueError("vLLM registered no KV cache tensors with KvbridgeConnector")
        # Every tensor is checked before anything is started or registered.
        kinds = {name: memory_kind(name, tensor, s.transport) for name, tensor in kv_caches.items()}
        planned = {name: cache_planes(name, tensor, g) for name, tensor in kv_caches.items()}
        layouts = {layout for layout, _ in planned.values()}
        if len(layouts) != 1:
            raise ValueError(f"vLLM's KV cache tensors have different layouts {sorted(layouts)}; KvbridgeConnector takes one")
        layout = layouts.pop()
        bind = f"{s.host}:0"
        tcp = {"bind": bind, "keepalive_timeout": s.peer_timeout} if s.transport == "tcp" else {}
        self.engine = kvbridge.Engine(s.transport, **tcp)
        entries, item_lens = [], []
        self._layers = {name: i for i, name in enumerate(kv_caches)}
        for name, (_, planes) in planned.items():
            # A layer's entries are consecutive, so layers [a, b) are entries [a*k, b*k).
            self._entries_per_layer = len(planes)
            self._cuda = kinds[name] == "cuda"
            for plane in planes:
                nbytes = plane.numel() * plane.element_size()
                region = self.engine.register(
                    plane.data_ptr(), nbytes, kind=kinds[name], device=plane.device.index or 0, owner=kv_caches[name]
                )
                entries.append(region)
                item_lens.append(nbytes // g.num_blocks)
        role = "prefill" if self.producer else "decode"
        desc = descriptor(role, g, item_lens, layout)
        if self.producer:
            if g.tp_rank == 0:
                host, port = s.bootstrap_addr.rsplit(":", 1)
                self.server = kvbridge.BootstrapServer(host, int(port))
            self.agent = self._registered(lambda: kvbridge.PrefillAgent(
                self.engine,
                desc,
                entries,
                bootstrap_addr=s.bootstrap_addr,
                # A room waits this long for its decode to ask (kvbridge's Bootstrapping), then
                # this long again to be sent: the blocks are vLLM's, held until it ends.
                bootstrap_timeout=s.waiting_timeout,
                waiting_timeout=s.waiting_timeout,
                batch_timeout=s.transfer_timeout,
                bind=bind,
            ))
        else:
            self.agent = kvbridge.DecodeAgent(
                self.engine,
                desc,
                entries,
                bootstrap_timeout=s.bootstrap_timeout,
                # Once it asked, the decode waits for the KV as long as the prefill holds it
                # (in the concurrent flow that includes the prefill's queue and compute).
                waiting_timeout=s.waiting_timeout,
                control_send_timeout=s.control_timeout,
                # Two unanswered heartbeats declare a prefill lost: peer_timeout in all.
                heartbeat_interval=s.peer_timeout / 2,
                bind=bind,
            )
        logger.info(
            "kvbridge: %s worker TP %d/%d ready: %d layers of %d blocks (%d bytes each) over %s",
            role, g.tp_rank, g.tp_size, len(entries), g.num_blocks, item_lens[0], s.transport,
        )

    def _registered(self, start: Any) -> Any:
        """A prefill agent, registered with the bootstrap server. TP rank 0's worker starts
        that server, and vLLM starts its workers side by side: another rank may come first,
        so it tries again, every 0.2 s, until ``bootstrap_timeout``."""
        end = time.monotonic() + self.settings.bootstrap_timeout
        while True:
            try:
                return start()
            except kvbridge.PeerLostError:
                if self.geometry.tp_rank == 0 or time.monotonic() > end:
                    raise
                time.sleep(0.2)

    # --- every step -----------------------------------------------------------------------

    def start(self, work: Work) -> None:
        """Starts this step's work: rooms for finished prefill requests, receives for decode
        requests, aborts of decode requests that ended. A room kvbridge refuses at once ends
        with the reason (next :meth:`results`)."""
        for send in work.sends:
            self._start_send(send)
        for receive in work.receives:
            self._start_receive(receive)
        for req_id in work.aborts:
            self._abort(req_id)
        for req_id in work.released:
            if req_id in self._streams:
                self._streams[req_id].released = True
        for stream in work.streams:
            self._stream_step(stream)

    def _abort(self, req_id: str) -> None:
        room = self._rooms.get(req_id)
        streamed = self._streams.get(req_id)
        if room is not None:
            number = room.job.kv.room
        elif streamed is not None:
            number = streamed.room
            streamed.last_sent = True  # nothing more is posted
        else:
            return
        logger.info("kvbridge: request %s ended while its KV was on its way; room %d aborted", req_id, number)
        self.agent.abort(number)

    # --- the concurrent flow's prefill: layer by layer ---------------------------------------

    def _stream_step(self, step: Stream) -> None:
        """A streamed request in this step: its room opens on first sight; once its decode's
        metadata came, the pages this forward pass completes are this step's part."""
        streamed = self._streams.get(step.req_id)
        if streamed is None:
            streamed = self._streams[step.req_id] = _Streamed(step.room, step.num_tokens, step.layerwise)
            try:
                self.agent.create_room(step.room, traceparent=step.traceparent)
            except kvbridge.KvbridgeError as e:
                logger.warning("kvbridge: request %s (room %d) will not be sent: %s", step.req_id, step.room, e)
                streamed.ended = True
        streamed.blocks, streamed.computed = step.block_ids, step.computed
        part = self._next_part(step.req_id, streamed)
        if part is not None:
            self._parts.append(part)

    def _next_part(self, req_id: str, s: _Streamed) -> Optional[_Part]:
        """The stream's pages not sent yet that its KV cache holds in full once this forward
        pass ends (all of them, the last page too, once the prompt is computed); ``None``
        while its decode's metadata has not come, or when nothing is due."""
        if s.ended or s.last_sent:
            return None
        if s.sent is None:
            try:
                if self.agent.poll(s.room) != kvbridge.KVPoll.WaitingForInput:
                    return None
                s.sent = self.agent.wait_ready(s.room, timeout=1.0)
            except kvbridge.KvbridgeError:
                return None  # failed: results() reports it
        bs = self.geometry.virtual_block_size
        first = s.sent // bs
        last = s.computed >= s.num_tokens
        end = -(-s.num_tokens // bs) if last else s.computed // bs
        tokens = (s.num_tokens if last else end * bs) - s.sent
        if tokens <= 0:
            return None
        part = _Part(req_id, s, list(s.blocks[first:end]), tokens, last)
        s.sent += tokens
        s.last_sent = last
        return part

    def layer_computed(self, layer_name: str) -> None:
        """vLLM's ``save_kv_layer``: this layer's rows of the step's parts go out now."""
        index = self._layers.get(layer_name)
        if not self._parts or index is None:
            return
        if index == len(self._layers) - 1:
            self._log_computed()
        layerwise = [part for part in self._parts if part.stream.layerwise]
        if not layerwise:
            return
        if self._cuda:
            import torch

            torch.cuda.current_stream().synchronize()  # the layer's KV is written
        for part in layerwise:
            self._post(part, index + 1)

    def forward_ended(self) -> None:
        """vLLM's ``wait_for_save``: every part's layers not posted yet go now, so no part
        stays open past its forward pass."""
        if self._parts and self._cuda:
            import torch

            torch.cuda.current_stream().synchronize()
        for part in self._parts:
            self._post(part, len(self._layers))
        self._parts = []

    def _log_computed(self) -> None:
        now = time.time()
        for part in self._parts:
            if part.last:
                logger.info("kvbridge: room %d: prompt KV computed t=%.6f", part.stream.room, now)

    def _post(self, part: _Part, end: int) -> None:
        """Posts the part's layers ``[part.next, end)``."""
        if part.next >= end or part.stream.ended:
            return
        try:
            k = self._entries_per_layer
            self.agent.send_chunk(
                part.stream.room, part.pages, part.tokens, last=part.last, layers=(part.next * k, end * k)
            )
            part.next = end
            part.stream.handovers += 1
        except kvbridge.KvbridgeError as e:
            logger.warning("kvbridge: request %s (room %d) not sent: %s", part.req_id, part.stream.room, e)
            part.next = end
            part.stream.last_sent = True
            self.agent.abort(part.stream.room)

    def _poll_stream(self, req_id: str, s: _Streamed) -> bool:
        """Whether a streamed request's room ended and vLLM may free its blocks."""
        if not s.ended:
            try:
                state = self.agent.poll(s.room)
            except kvbridge.KvbridgeError:
                state = kvbridge.KVPoll.Failed
            if state == kvbridge.KVPoll.WaitingForInput and s.released and not s.last_sent:
                # Its decode came after the prompt was computed: the rest goes at once.
                part = self._next_part(req_id, s)
                if part is not None:
                    self._post(part, len(self._layers))
            elif state == kvbridge.KVPoll.Failed:
                logger.warning("kvbridge: request %s (room %d): its KV was not sent: %s", req_id, s.room, self.agent.failure(s.room))
                s.ended = True
            elif state == kvbridge.KVPoll.Success:
                logger.info(
                    "kvbridge: request %s (room %d): %d prompt tokens sent in %d hand-overs",
                    req_id, s.room, s.num_tokens, s.handovers,
                )
                s.ended = True
        if not (s.ended and s.released):
            return False
        try:
            self.agent.clear(s.room)
        except kvbridge.KvbridgeError:
            pass
        return True

    def _start_send(self, send: Send) -> None:
        try:
            self.agent.create_room(send.room, traceparent=send.traceparent)
        except kvbridge.KvbridgeError as e:
            logger.warning("kvbridge: request %s (room %d) will not be sent: %s", send.req_id, send.room, e)
            self._rooms[send.req_id] = _Room(send, posted=True)
            return
        room = self._rooms[send.req_id] = _Room(send)
        self._send_when_ready(room)

    def _send_when_ready(self, room: _Room) -> None:
        """Hands kvbridge the request's KV, sent the moment its decode's metadata comes (not at
        this worker's next step): vLLM holds the blocks until the room ends."""
        send: Send = room.job
        room.posted = True
        try:
            self.agent.send_when_ready(send.room, list(send.block_ids), send.num_tokens, self.geometry.virtual_block_size)
        except kvbridge.KvbridgeError as e:
            logger.warning("kvbridge: request %s (room %d) not sent: %s", send.req_id, send.room, e)
            self.agent.abort(send.room)

    def _start_receive(self, receive: Receive) -> None:
        logger.info(
            "kvbridge: request %s: loading tokens %d.. of room %d from %s t=%.6f",
            receive.req_id, receive.cached_tokens, receive.kv.room, receive.kv.bootstrap_addr, time.time(),
        )
        try:
            self.agent.receive(
                receive.kv.room,
                receive.kv.bootstrap_addr,
                list(receive.block_ids),
                cached_prefix_len=receive.cached_tokens,
                traceparent=receive.traceparent,
            )
        except kvbridge.KvbridgeError as e:
            logger.error("kvbridge: request %s: no KV loaded: %s", receive.req_id, e)
            self._load_errors.update(self._unloaded_blocks(receive))
            self._rooms[receive.req_id] = _Room(receive, posted=True)
            return
        self._rooms[receive.req_id] = _Room(receive)

    def _unloaded_blocks(self, receive: Receive) -> list:
        first = receive.cached_tokens // self.geometry.virtual_block_size
        return list(receive.block_ids[first:])

    def results(self) -> tuple:
        """``(finished sending, finished receiving, failed receiving)`` request ids since the
        last call. A room that failed is reported once kvbridge says no byte of it will land
        any more (fenced), with its cause in the log; its blocks go to
        :meth:`take_load_errors`."""
        sent, received, failed = set(), set(), set()
        for req_id, streamed in list(self._streams.items()):
            if self._poll_stream(req_id, streamed):
                del self._streams[req_id]
                sent.add(req_id)
        for req_id, room in list(self._rooms.items()):
            done = self._poll_send(req_id, room) if self.producer else self._poll_receive(req_id, room, failed)
            if done:
                del self._rooms[req_id]
                (sent if self.producer else received).add(req_id)
        return sent, received, failed

    def _poll_send(self, req_id: str, room: _Room) -> bool:
        send: Send = room.job
        try:
            state = self.agent.poll(send.room)
        except kvbridge.KvbridgeError:
            return True  # never created: nothing holds the blocks
        if state == kvbridge.KVPoll.Success:
            self.agent.clear(send.room)
            return True
        if state == kvbridge.KVPoll.Failed:
            logger.warning(
                "kvbridge: request %s (room %d): its KV was not sent: %s",
                req_id, send.room, self.agent.failure(send.room),
            )
            self.agent.clear(send.room)
            return True
        return False

    def _poll_receive(self, req_id: str, room: _Room, failed: set) -> bool:
        receive: Receive = room.job
        try:
            state = self.agent.poll(receive.kv.room)
        except kvbridge.KvbridgeError:
            failed.add(req_id)  # refused at receive (logged there)
            return True
        if state == kvbridge.KVPoll.Success:
            took = self.agent.transfer_time(receive.kv.room)
            logger.info(
                "kvbridge: room %d: KV complete t=%.6f (%d blocks, %.3f ms from its metadata to the prefill's Success)",
                receive.kv.room, time.time(), len(self._unloaded_blocks(receive)), 1e3 * (took or 0.0),
            )
            self.agent.clear(receive.kv.room)
            return True
        if state == kvbridge.KVPoll.Failed:
            if not self.agent.is_fenced(receive.kv.room):
                return False  # a prefill may still write: the blocks wait
            logger.error(
                "kvbridge: request %s (room %d): KV not loaded (vLLM's kv_load_failure_policy "
                "decides: recompute, or fail the request): %s",
                req_id, receive.kv.room, self.agent.failure(receive.kv.room),
            )
            self._load_errors.update(self._unloaded_blocks(receive))
            failed.add(req_id)
            self.agent.clear(receive.kv.room)
            return True
        return False

    def take_load_errors(self) -> set:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        for thing in (self.agent, self.server, self.engine):
            if thing is not None:
                try:
                    thing.close()
                except kvbridge.KvbridgeError as e:
                    logger.warning("kvbridge: closing %s: %s", type(thing).__name__, e)
