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
from typing import Any, Optional

import kvbridge

from kvbridge_vllm.scheduler import Receive, Send, Work
from kvbridge_vllm.settings import Settings

logger = logging.getLogger("vllm.kvbridge")

# vLLM's CPU attention keeps a layer as [num_blocks, num_kv_heads, block_size, 2 * head_size]
# (a block holds, head by head, each token's K and V): one page of one KV entry per block.
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


def descriptor(role: str, geometry: Geometry, item_lens: list) -> "kvbridge.PeerDescriptor":
    """The rank's ``PeerDescriptor``: an MHA pool of one entry per layer whose page (one vLLM
    block) holds, for each of this rank's heads, each token's K and V (``head_dim`` counts
    both, so kvbridge's checks see the page's true size)."""
    return kvbridge.PeerDescriptor(
        role=role,
        page_size=geometry.block_size,
        kv_cache_dtype=geometry.dtype,
        kv_pool="mha",
        kv_layout=CPU_LAYOUT,
        attn_tp_size=geometry.tp_size,
        attn_tp_rank=geometry.tp_rank,
        total_kv_heads=geometry.total_kv_heads,
        head_dim=2 * geometry.head_size,
        kv_item_lens=item_lens,
    )


def _torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass
class _Room:
    job: Any
    posted: bool = False


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
        self._load_errors: set = set()

    # --- set-up ---------------------------------------------------------------------------

    def register(self, kv_caches: dict) -> None:
        """Registers every layer's cache tensor and starts the agent."""
        g, s = self.geometry, self.settings
        if not kv_caches:
            raise ValueError("vLLM registered no KV cache tensors with KvbridgeConnector")
        bind = f"{s.host}:0"
        self.engine = kvbridge.Engine(s.transport, bind=bind if s.transport == "tcp" else None)
        entries, item_lens = [], []
        for name, tensor in kv_caches.items():
            if not tensor.is_contiguous() or tensor.shape[0] != g.num_blocks:
                raise ValueError(
                    f"KV cache tensor {name!r} has shape {tuple(tensor.shape)} (contiguous: "
                    f"{tensor.is_contiguous()}); KvbridgeConnector moves contiguous tensors of "
                    f"{g.num_blocks} blocks first ([num_blocks, kv_heads, block_size, 2 * "
                    "head_size], vLLM's CPU layout)"
                )
            nbytes = tensor.numel() * tensor.element_size()
            device = tensor.device
            kind = "cuda" if device.type == "cuda" else "host"
            region = self.engine.register(
                tensor.data_ptr(), nbytes, kind=kind, device=device.index or 0, owner=tensor
            )
            entries.append(region)
            item_lens.append(nbytes // g.num_blocks)
        role = "prefill" if self.producer else "decode"
        desc = descriptor(role, g, item_lens)
        if self.producer:
            if g.tp_rank == 0:
                host, port = s.bootstrap_addr.rsplit(":", 1)
                self.server = kvbridge.BootstrapServer(host, int(port))
            self.agent = kvbridge.PrefillAgent(
                self.engine,
                desc,
                entries,
                bootstrap_addr=s.bootstrap_addr,
                waiting_timeout=s.waiting_timeout,
                batch_timeout=s.transfer_timeout,
                bootstrap_timeout=s.bootstrap_timeout,
                bind=bind,
            )
        else:
            self.agent = kvbridge.DecodeAgent(
                self.engine,
                desc,
                entries,
                bootstrap_timeout=s.bootstrap_timeout,
                waiting_timeout=s.transfer_timeout,
                bind=bind,
            )
        logger.info(
            "kvbridge: %s worker TP %d/%d ready: %d layers of %d blocks (%d bytes each) over %s",
            role, g.tp_rank, g.tp_size, len(entries), g.num_blocks, item_lens[0], s.transport,
        )

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
            room = self._rooms.get(req_id)
            if room is not None:
                logger.info("kvbridge: request %s ended while its KV was on its way; room %d aborted", req_id, room.job.kv.room)
                self.agent.abort(room.job.kv.room)

    def _start_send(self, send: Send) -> None:
        try:
            self.agent.create_room(send.room)
        except kvbridge.KvbridgeError as e:
            logger.warning("kvbridge: request %s (room %d) will not be sent: %s", send.req_id, send.room, e)
            self._rooms[send.req_id] = _Room(send, posted=True)
            return
        self._rooms[send.req_id] = _Room(send)

    def _start_receive(self, receive: Receive) -> None:
        try:
            self.agent.receive(
                receive.kv.room,
                receive.kv.bootstrap_addr,
                list(receive.block_ids),
                cached_prefix_len=receive.cached_tokens,
            )
        except kvbridge.KvbridgeError as e:
            logger.error("kvbridge: request %s: no KV loaded: %s", receive.req_id, e)
            self._load_errors.update(self._unloaded_blocks(receive))
            self._rooms[receive.req_id] = _Room(receive, posted=True)
            return
        self._rooms[receive.req_id] = _Room(receive)

    def _unloaded_blocks(self, receive: Receive) -> list:
        first = receive.cached_tokens // self.geometry.block_size
        return list(receive.block_ids[first:])

    def results(self) -> tuple:
        """``(finished sending, finished receiving, failed receiving)`` request ids since the
        last call. A room that failed is reported once kvbridge says no byte of it will land
        any more (fenced), with its cause in the log; its blocks go to
        :meth:`take_load_errors`."""
        sent, received, failed = set(), set(), set()
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
        if state == kvbridge.KVPoll.WaitingForInput and not room.posted:
            room.posted = True
            try:
                held = self.agent.wait_ready(send.room, timeout=1.0)
                first = held // self.geometry.block_size
                self.agent.send_chunk(send.room, list(send.block_ids[first:]), send.num_tokens - held, last=True)
            except kvbridge.KvbridgeError as e:
                logger.warning("kvbridge: request %s (room %d) not sent: %s", req_id, send.room, e)
                self.agent.abort(send.room)
            return False
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
            self.agent.clear(receive.kv.room)
            return True
        if state == kvbridge.KVPoll.Failed:
            if not self.agent.is_fenced(receive.kv.room):
                return False  # a prefill may still write: the blocks wait
            logger.error(
                "kvbridge: request %s (room %d): KV not loaded, vLLM recomputes it: %s",
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
