"""The four classes SGLang asks ``get_kv_class`` for when the backend is ``kvbridge``.

They are SGLang 0.5.23's Mooncake classes (themselves on ``CommonKVManager`` /
``CommonKVSender`` / ``CommonKVReceiver`` / ``CommonKVBootstrapServer``: the bootstrap
server, the ZMQ messages, the transfer worker, the page and DCP relayout, ``KVPoll``), with
the transfer engine swapped for :class:`kvbridge_sglang.engine.KvbridgeTransferEngine`, so
every byte is moved (and bounds-checked) by kvbridge, and the planner calls of the page and DCP
paths answered by kvbridge's planner. A failed write makes the room
``KVPoll.Failed``; its ``KVTransferError`` carries kvbridge's cause.

Prefill DCP a -> decode DCP b (which SGLang's classes refuse for a > 1 and a != b): the prefill
publishes its DCP size in its bootstrap registration (:mod:`kvbridge_sglang.reshard`), the
decode maps its ranks to prefill ranks by the owner rule, and each prefill rank sends the rows
kvbridge's planner assigns to the pair (docs/sglang.md, "DCP a -> b").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import types
from typing import Optional

import kvbridge.sglang
import numpy as np
from aiohttp import web
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.common import conn as common_conn
from sglang.srt.disaggregation.mooncake import conn as mooncake_conn
from sglang.srt.disaggregation.mooncake.conn import (
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)

from kvbridge_sglang import checks, reshard
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


@dataclasses.dataclass
class _PrefillServerInfo(common_conn.PrefillServerInfo):
    """SGLang's parallel info of a prefill server, plus kvbridge's field (its DCP size)."""

    kvbridge: Optional[dict] = None


# SGLang's decode builds its PrefillServerInfo from the bootstrap server's JSON; this one
# also takes kvbridge's field.
_BOOTSTRAP_GLOBALS = _Globals(common_conn, {"PrefillServerInfo": _PrefillServerInfo})


# The page path as runs (docs/sglang.md, "Moving a chunk"). SGLang's page path pairs the
# pool's entries (layers; K and V; PP stages; elided entries) and then turns every group of
# consecutive pages into a Python list and every (entry, group) into a tuple. Here its pairing
# runs as it is, while the grouping is answered by numpy runs kept aside for the thread and a
# single one-page group; SGLang's blocks then come out as one (src_ptr, dst_ptr, item_len) per
# entry, which the manager's ``_transfer_data`` expands with the runs into one engine write.
_PAGE_RUNS = threading.local()
_ONE_GROUP = ([[0]], [[0]])


def page_runs(src_indices, dst_indices) -> Optional[np.ndarray]:
    """``(N, 3)`` int64 runs ``(src_page, dst_page, pages)`` of two equally long 1-D integer
    index arrays, cut where either side is not the previous index plus 1 (SGLang's
    ``group_concurrent_contiguous``, as runs). ``None`` for anything else (other dtypes or
    shapes, unequal lengths), which SGLang's function answers itself."""
    src, dst = np.asarray(src_indices), np.asarray(dst_indices)
    if src.ndim != 1 or dst.ndim != 1 or src.dtype.kind not in "iu" or dst.dtype.kind not in "iu":
        return None
    if src.size == 0 or dst.size == 0:
        return np.empty((0, 3), dtype=np.int64)
    if src.size != dst.size or src.dtype == np.uint64 or dst.dtype == np.uint64:
        return None
    src, dst = src.astype(np.int64, copy=False), dst.astype(np.int64, copy=False)
    cuts = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], cuts))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return np.stack((src[starts], dst[starts], lengths), axis=1)


def run_progressions(runs) -> np.ndarray:
    """Runs ``(src_row, dst_row, rows)`` (``(N, 3)`` int64, in order) as ``(M, 6)`` int64
    progressions ``(src_row, dst_row, rows, count, src_step, dst_step)``: ``count`` runs of
    ``rows`` rows, the ``k``-th at ``src_row + k * src_step`` and ``dst_row + k * dst_step``.
    Consecutive runs of one length whose starts advance by the same steps (non-negative; the
    destinations disjoint) make one progression: a DCP rank's rows of a page, one row every
    ``dcp_size`` rows of the source, are one progression instead of one run per row."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    if len(runs) == 0:
        return np.empty((0, 6), dtype=np.int64)
    src, dst, rows = runs[:, 0], runs[:, 1], runs[:, 2]
    src_step, dst_step = np.diff(src), np.diff(dst)
    # link[j]: run j + 1 may follow run j with the steps (src_step[j], dst_step[j]).
    link = (rows[1:] == rows[:-1]) & (src_step >= 0) & (dst_step >= rows[:-1])
    same = np.zeros(len(link), dtype=bool)  # link[j] continues link[j - 1]'s steps
    same[1:] = link[1:] & link[:-1] & (src_step[1:] == src_step[:-1]) & (dst_step[1:] == dst_step[:-1])
    # Greedy from the left: a link continuing its predecessor's steps is taken; so is a link
    # whose predecessor is not taken (its run starts a progression). In a stretch of links
    # that change steps one after the other, that alternates, from what the link before the
    # stretch did: one progression never gets two steps.
    free = link & ~same
    stretch = free & ~np.concatenate(([False], free[:-1]))
    first = np.flatnonzero(stretch)
    sid = np.maximum(np.cumsum(stretch) - 1, 0)
    taken = link & same
    if len(first):
        before_taken = np.where(first > 0, taken[np.maximum(first - 1, 0)], False)
        k = np.arange(len(link)) - first[sid]
        taken |= free & ((k % 2 == 0) != before_taken[sid])
    starts = np.flatnonzero(np.concatenate(([True], ~taken)))
    count = np.diff(np.concatenate((starts, [len(runs)])))
    first_link = np.minimum(starts, max(len(link) - 1, 0))
    has_steps = count > 1
    out = np.empty((len(starts), 6), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2], out[:, 3] = src[starts], dst[starts], rows[starts], count
    if len(link):
        out[:, 4] = np.where(has_steps, src_step[first_link], rows[starts])
        out[:, 5] = np.where(has_steps, dst_step[first_link], rows[starts])
    else:
        out[:, 4] = out[:, 5] = rows[starts]
    return out


def _group_as_runs(src_indices, dst_indices):
    """``group_concurrent_contiguous`` for SGLang's page path: the runs go aside for this
    thread's next ``_transfer_data``; SGLang sees one group of one page."""
    runs = page_runs(src_indices, dst_indices)
    _PAGE_RUNS.pending = runs
    if runs is None:
        return kvbridge.sglang.group_concurrent_contiguous(src_indices, dst_indices)
    return _ONE_GROUP if len(runs) else ([], [])


_RUNS_GLOBALS = _Globals(mooncake_conn, {**PLANNER, "group_concurrent_contiguous": _group_as_runs})


def _with_planner(fn: types.FunctionType, globals_: dict = _PLANNER_GLOBALS) -> types.FunctionType:
    """``fn`` (a method of SGLang's manager) looking its globals up in ``globals_`` first:
    kvbridge's planner by default."""
    rebound = types.FunctionType(
        fn.__code__, globals_, fn.__name__, fn.__defaults__, fn.__closure__
    )
    rebound.__kwdefaults__ = fn.__kwdefaults__
    rebound.__qualname__ = fn.__qualname__
    rebound.__doc__ = fn.__doc__
    return rebound


# The DCP paths post a chunk's writes to every decode rank before waiting for any (SGLang's
# worker sends to the ranks one after the other, each send returning when its bytes landed):
# the writes stay in flight, under the room of the chunk this worker thread is on, until the
# room concludes or the worker takes its next chunk (docs/sglang.md, "Moving a chunk").
_CHUNK = threading.local()
# The prefill (bootstrap address) a decode's receiver is talking to, for get_session_id.
_GROUP = threading.local()


# Whether _write_context has said once that SGLang's trace context could not be read.
_TRACE_WARNED = False


def sglang_traceparent(trace_ctx) -> Optional[str]:
    """The W3C ``traceparent`` of the innermost span SGLang has open for a chunk on this
    thread: its transfer worker's slice, else the thread's span, else the request's root span
    (``TraceReqContext``, docs/tracing.md, "SGLang"). None where SGLang traces nothing: tracing
    off, or ``kvbridge`` left out of ``--trace-modules``."""
    if trace_ctx is None or getattr(trace_ctx, "tracing_enable", False) is not True:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    thread = getattr(trace_ctx, "thread_context", None)
    if thread is not None and thread.cur_slice_stack:
        context = trace.set_span_in_context(thread.cur_slice_stack[-1].span)
    elif thread is not None and thread.thread_span is not None:
        context = trace.set_span_in_context(thread.thread_span)
    else:
        context = getattr(trace_ctx, "root_span_context", None)
    if context is None:
        return None
    carrier: dict = {}
    TraceContextTextMapPropagator().inject(carrier, context=context)
    return carrier.get("traceparent")


class _SettlingQueue:
    """A transfer worker's queue: before the worker waits for its next chunk, the writes its
    last chunk left in flight are settled; the chunk it takes names the room of its writes."""

    def __init__(self, manager: "KvbridgeKVManager", queue):
        self._manager, self._queue = manager, queue

    def get(self):
        self._manager._settle_chunk()
        chunk = self._queue.get()
        _CHUNK.room = getattr(chunk, "room", None)
        _CHUNK.trace_ctx = getattr(chunk, "trace_ctx", None)
        return chunk

    def __getattr__(self, name):
        return getattr(self._queue, name)


class KvbridgeKVManager(MooncakeKVManager):
    sender_trace_module = "kvbridge"
    # The prefill's status message carries its failure reason (kvbridge's cause included), so
    # the decode's KVTransferError says why, not only that the prefill failed. Tagged, so a
    # peer of another backend cannot mistake it for its own layout.
    kv_status_msg_tag = b"KVBRIDGE_STATUS"
    kv_status_msg_carries_reason = True

    # The page path and the prefill-DCP-1 path plan with kvbridge's planner; the page path
    # moves runs (see _PAGE_RUNS), the lists version stays for what the runs do not cover.
    _send_kvcache_generic_lists = _with_planner(MooncakeKVManager._send_kvcache_generic)
    _send_kvcache_generic_runs = _with_planner(MooncakeKVManager._send_kvcache_generic, _RUNS_GLOBALS)
    _send_kvcache_dcp1 = _with_planner(MooncakeKVManager.send_kvcache_dcp)
    # SGLang's checks of the prefill's parallel info, reading kvbridge's field too.
    try_ensure_parallel_info = _with_planner(
        common_conn.CommonKVManager.try_ensure_parallel_info, _BOOTSTRAP_GLOBALS
    )

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, **kwargs):
        # Where the pools live, and the refusal of device pools on a host-only transport,
        # before SGLang's manager opens any socket (docs/sglang.md, "Pools on GPUs").
        self.transport_name = checks.transport()
        self.pool_memory = checks.pool_memory(args, checks.server_device(server_args))
        checks.refuse_device_pools_on(self.transport_name, self.pool_memory)
        # Room -> the DCP writes in flight, (session id, transfer) each; before SGLang's
        # __init__, which starts the transfer workers.
        self._in_flight: dict = {}
        self._in_flight_lock = threading.Lock()
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend, **kwargs)
        # SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES bounds Mooncake's batches; kvbridge's
        # engine takes a chunk in one write (split only at the transport's own limit).
        self.max_transfer_batch_indices = 0

    @contextlib.contextmanager
    def session_group(self, bootstrap_addr: str):
        """Within it, this thread's `get_session_id` is that of the prefill at
        `bootstrap_addr`: the ids it carries are that prefill's alone."""
        before = getattr(_GROUP, "addr", None)
        _GROUP.addr = bootstrap_addr
        try:
            yield
        finally:
            _GROUP.addr = before

    def get_session_id(self):
        return self.engine.get_session_id(getattr(_GROUP, "addr", None))

    def _handle_node_failure(self, failed_bootstrap_addr: str):
        # SGLang fails the prefill's rooms and forgets it; before that, its region ids go, so
        # a prefill that only stalled (and sends when it resumes) lands no byte in the pages
        # of rooms the decode gave up. Its next registration carries fresh ids.
        self.engine.fence(failed_bootstrap_addr)
        return super()._handle_node_failure(failed_bootstrap_addr)

    def transfer_worker(self, queue, executor, *args, **kwargs):
        # SGLang's worker (started by its __init__), on a queue that settles writes in flight.
        return super().transfer_worker(_SettlingQueue(self, queue), executor, *args, **kwargs)

    def _post_rows(self, session_id: str, src, dst, lens, rows) -> int:
        """A DCP write: left in flight under the worker's current room (settled later), or
        waited for here off a transfer worker."""
        room = getattr(_CHUNK, "room", None)
        if room is None:
            return self.engine.batch_transfer_rows(session_id, src, dst, lens, rows)
        try:
            posted = self.engine.post_rows(session_id, src, dst, lens, rows)
        except kvbridge.KvbridgeError as e:
            return self.engine.fail(f"{type(e).__name__}: {e}")
        with self._in_flight_lock:
            self._in_flight.setdefault(room, []).extend((session_id, t) for t in posted)
        return 0

    def _settle(self, room: int, cancel: bool = False) -> Optional[str]:
        """Waits for (or cancels) the room's writes in flight; the first failure's cause, its
        decode session then marked failed as SGLang marks a session whose send failed."""
        with self._in_flight_lock:
            pending = self._in_flight.pop(room, [])
        cause = None
        for session_id, transfer in pending:
            if cancel:
                transfer.cancel()  # once it returns, no byte of the write lands
                continue
            try:
                transfer.wait()
            except kvbridge.KvbridgeError as e:
                if cause is None:
                    cause = f"{type(e).__name__}: {e}"
                    logger.warning("kvbridge: transfer to a decode failed: %s", cause)
                with self.session_lock:
                    self.session_failures[session_id] += 1
                    self.failed_sessions.add(session_id)
        return cause

    def _settle_chunk(self) -> None:
        room, _CHUNK.room, _CHUNK.trace_ctx = getattr(_CHUNK, "room", None), None, None
        if room is None:
            return
        cause = self._settle(room, cancel=self.request_status.get(room) == KVPoll.Failed)
        if cause is not None:
            self.conclude_failure(
                bootstrap_room=room,
                failure_reason=f"Failed to send kv chunk of {room}; kvbridge: {cause}",
            )

    def conclude_transfer(self, *, bootstrap_room: int, status, targets=None, failure_reason=None):
        # The room's status reaches its decodes only after its writes have landed; a failed
        # room's writes are cancelled first.
        if status == KVPoll.Success:
            cause = self._settle(bootstrap_room)
            if cause is not None:
                status = KVPoll.Failed
                failure_reason = f"Failed to send kv of {bootstrap_room}; kvbridge: {cause}"
        else:
            self._settle(bootstrap_room, cancel=True)
        return super().conclude_transfer(
            bootstrap_room=bootstrap_room, status=status, targets=targets, failure_reason=failure_reason
        )

    def init_engine(self) -> None:
        # Called by the Mooncake manager's __init__ before the buffers are registered.
        self.engine = KvbridgeTransferEngine(
            self.transport_name, host=self.local_ip, device_buffers=self.device_buffers()
        )
        self.engine.write_context = self._write_context
        # The transport's own word, for transports the name table does not know.
        checks.refuse_device_pools_on(
            self.transport_name, self.pool_memory, self.engine.engine.capabilities
        )

    @staticmethod
    def _write_context() -> tuple:
        """The room of the chunk this thread sends and SGLang's span for it, which each write's
        ``kv_write`` span records and takes as parent (docs/tracing.md, "SGLang"). Tracing never
        fails a write: where SGLang's context cannot be read, the span has no parent."""
        try:
            traceparent = sglang_traceparent(getattr(_CHUNK, "trace_ctx", None))
        except Exception as e:  # SGLang's or OpenTelemetry's internals changed
            global _TRACE_WARNED
            if not _TRACE_WARNED:
                _TRACE_WARNED = True
                logger.warning(
                    "kvbridge: SGLang's trace context could not be read (%s); writes are traced without it", e
                )
            traceparent = None
        return getattr(_CHUNK, "room", None), traceparent

    def _send_kvcache_generic(self, *args, **kwargs) -> int:
        # HiSparse's second (device) page space and Mooncake's per-layer thread pool (custom
        # memory pools) group twice or off this thread: SGLang's lists there.
        if kwargs.get("dst_device_data_indices") is not None or getattr(self, "enable_custom_mem_pool", False):
            return self._send_kvcache_generic_lists(*args, **kwargs)
        _PAGE_RUNS.active, _PAGE_RUNS.pending = True, None
        try:
            return self._send_kvcache_generic_runs(*args, **kwargs)
        finally:
            _PAGE_RUNS.active, _PAGE_RUNS.pending = False, None

    def _transfer_data(self, session_id, transfer_blocks) -> int:
        runs = getattr(_PAGE_RUNS, "pending", None) if getattr(_PAGE_RUNS, "active", False) else None
        if runs is None:
            return super()._transfer_data(session_id, transfer_blocks)
        _PAGE_RUNS.pending = None
        if not transfer_blocks or len(runs) == 0:
            return 0
        # One (src_ptr, dst_ptr, item_len) per entry, each expanded by every run.
        entries = np.asarray(transfer_blocks, dtype=np.int64).reshape(-1, 3)
        widths = entries[:, 2:3]
        src = (entries[:, 0:1] + runs[:, 0] * widths).ravel()
        dst = (entries[:, 1:2] + runs[:, 1] * widths).ravel()
        lens = np.broadcast_to(runs[:, 2] * widths, (len(entries), len(runs))).ravel()
        return self.engine.batch_transfer_sync(session_id, src, dst, lens)

    def device_buffers(self) -> dict:
        """Base address -> CUDA device of every registered buffer in GPU memory: the KV and
        state pools when the pools are on a GPU. Aux buffers (SGLang's MetadataBuffers) are
        host memory on CPU and CUDA servers alike."""
        if self.pool_memory.on_host:
            return {}
        args = self.kv_args
        ptrs = list(args.kv_data_ptrs) + [p for group in args.state_data_ptrs or [] for p in group]
        return {int(p): self.pool_memory.device for p in ptrs}

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

    # Prefill DCP a -> decode DCP b (docs/sglang.md, "DCP a -> b").
    def _register_topology_row(self, url: str, payload: dict) -> None:
        # The prefill's DCP size and descriptor, which SGLang's registration leaves out.
        super()._register_topology_row(url, {**payload, reshard.FIELD: reshard.registration(self)})

    def _resolve_rank_mapping(self, info) -> None:
        try:
            field = reshard.parse_field(getattr(info, reshard.FIELD, None))
        except ValueError as e:
            raise RuntimeError(str(e)) from None
        # Prefill DCP 1 (or a prefill without the field): SGLang's mapping is the owner rule's.
        if field is None or field[0] == 1:
            super()._resolve_rank_mapping(info)
            return
        mapping = reshard.owner_rule_mapping(field[1], field[0], self)
        #= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager._resolve_rank_mapping test: test_each_decode_rank_reads_the_prefill_ranks_owning_its_rows
        ## info.target_tp_rank = target_tp_rank
        ## info.target_tp_ranks = target_tp_ranks
        ## info.target_cp_ranks = target_cp_ranks
        ## info.target_pp_ranks = target_pp_ranks
        ## info.required_dst_info_num = required_dst_info_num
        ## info.required_prefill_response_num = required_prefill_response_num
        for name in (
            "target_tp_rank",
            "target_tp_ranks",
            "target_cp_ranks",
            "target_pp_ranks",
            "required_dst_info_num",
            "required_prefill_response_num",
        ):
            setattr(info, name, mapping[name])

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        # With kvbridge a digest covers other bytes on every DCP a -> b relayout, and on a TP
        # slice of an MHA pool.
        #= sglang 0.5.23 sglang/srt/disaggregation/base/conn.py BaseKVManager.should_verify_kv_checksum test: test_the_checksum_is_verified_only_where_the_digest_covers_this_ranks_bytes, test_the_answer_is_per_prefill
        ## """Whether the checksum sent by the prefill at bootstrap_addr is comparable
        ## with one over this rank's local KV. A backend returns False for a peer
        ## whose digest covers a different byte range, e.g. a TP width mismatch where
        ## each decode rank receives only a slice of what the sender digested."""
        info = self.prefill_info_table.get(bootstrap_addr)
        if info is not None and not reshard.digest_covers_this_rank(info, self):
            return False
        return super().should_verify_kv_checksum(bootstrap_addr)

    def requires_dcp_relayout(self, dst_dcp_size: int, dst_dcp_rank: int) -> bool:
        # SGLang's manager relayouts prefill DCP 1 only; kvbridge's planner any a -> b (MLA).
        if self.dcp_size > 1 and dst_dcp_size != self.dcp_size and self.is_mla_backend:
            return True
        #= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.requires_dcp_relayout test: test_mla_prefill_dcp1_to_decode_dcp4_owner_rule, test_mla_prefill_dcp_a_to_decode_dcp_b_owner_rule
        ## self.dcp_size == 1
        ## and dst_dcp_size > 1
        ## and (self.is_mla_backend or self.is_hybrid_mla_backend)
        return super().requires_dcp_relayout(dst_dcp_size, dst_dcp_rank)

    def send_kvcache_dcp(self, *args, **kwargs) -> int:
        if self.dcp_size == 1:
            ret = self._send_kvcache_dcp1_runs(*args, **kwargs)
            if ret is not None:
                return ret
            return self._send_kvcache_dcp1(*args, **kwargs)
        return self._send_kvcache_reshard(*args, **kwargs)

    def _send_kvcache_dcp1_runs(
        self,
        session_id: str,
        prefill_kv_indices,
        dst_kv_ptrs: list,
        dst_kv_indices,
        *,
        dst_dcp_size: int,
        dst_dcp_rank: int,
        src_page_offset: int,
        decode_prefix_len: int,
        num_kv_tokens: Optional[int],
        dst_layer_ids: list,
        dcp_token_item_lens: list,
        pack_buffer=None,
        dst_kv_item_lens=None,
        **_unused,
    ) -> Optional[int]:
        """Prefill DCP 1 -> decode DCP rank: the target rows as kvbridge's runs
        (``build_dcp_transfer_runs``), one write per chunk and decode rank. ``None`` where
        SGLang's path must answer: draft entries, a pack buffer, arguments SGLang refuses
        (its own errors then) or the planner does not take."""
        if (
            num_kv_tokens is None
            or self.kv_args.num_draft_entries
            or pack_buffer is not None
            or (dst_kv_item_lens and len(dst_kv_item_lens) != len(dst_kv_ptrs))
        ):
            return None
        try:
            src_ptrs, dst_ptrs = self._reshard_entries(dst_kv_ptrs, dst_layer_ids)
            runs = kvbridge.sglang.build_dcp_transfer_runs(
                np.asarray(prefill_kv_indices, dtype=np.int64),
                np.asarray(dst_kv_indices, dtype=np.int64),
                physical_page_size=self.kv_args.page_size,
                dcp_size=dst_dcp_size,
                dcp_rank=dst_dcp_rank,
                src_page_offset=src_page_offset,
                decode_prefix_len=decode_prefix_len,
                num_kv_tokens=num_kv_tokens,
            ).target_runs
        except (ValueError, TypeError, OverflowError, IndexError, RuntimeError):
            return None
        return self._write_runs(session_id, runs, src_ptrs, dst_ptrs, dcp_token_item_lens)

    def _write_runs(self, session_id: str, runs, src_ptrs, dst_ptrs, widths) -> int:
        """Every entry's rows of ``runs`` (``(src_row, dst_row, rows)``, rows of
        ``widths[entry]`` bytes) in one engine write, each progression of runs as one strided
        descriptor (DCP's interleaved rows: one per page and entry, not one per row)."""
        if len(runs) == 0:
            return 0
        prog = run_progressions(runs)
        n = len(src_ptrs)
        src_base = np.asarray(src_ptrs, dtype=np.int64)[:, None]
        dst_base = np.asarray(dst_ptrs, dtype=np.int64)[:, None]
        w = np.asarray(widths[:n], dtype=np.int64)[:, None]
        shape = (n, len(prog))
        src = (src_base + prog[:, 0] * w).ravel()
        dst = (dst_base + prog[:, 1] * w).ravel()
        lens = (prog[:, 2] * w).ravel()
        counts = np.broadcast_to(prog[:, 3], shape).ravel()
        src_strides = (prog[:, 4] * w).ravel()
        dst_strides = (prog[:, 5] * w).ravel()
        return self._post_rows(session_id, src, dst, lens, (counts, src_strides, dst_strides))

    def _send_kvcache_reshard(
        self,
        session_id: str,
        prefill_kv_indices,
        dst_kv_ptrs: list,
        dst_kv_indices,
        *,
        dst_dcp_size: int,
        dst_dcp_rank: int,
        src_page_offset: int,
        decode_prefix_len: int,
        num_kv_tokens: Optional[int],
        dst_layer_ids: list,
        dcp_token_item_lens: list,
        **_unused,
    ) -> int:
        """One chunk from this prefill DCP rank to one decode DCP rank: the rows kvbridge's
        planner assigns to the pair (``build_reshard_transfer_runs``), one write per chunk.
        0 on success; -1 with the cause kept for the room's failure otherwise."""
        a, a_r, page = self.dcp_size, self.dcp_rank, self.kv_args.page_size
        try:
            if num_kv_tokens is None:
                raise ValueError("PD DCP transfer requires num_kv_tokens")
            if self.kv_args.num_draft_entries:
                raise ValueError(
                    f"prefill DCP {a} -> decode DCP {dst_dcp_size} moves target KV only, but this "
                    f"pool has {self.kv_args.num_draft_entries} draft entries; run speculative "
                    "decoding with the same --dcp-size on both servers"
                )
            if dst_dcp_rank not in kvbridge.sglang.reshard_targets(a, dst_dcp_size, a_r):
                raise ValueError(
                    f"decode DCP rank {dst_dcp_rank} of {dst_dcp_size} holds no row of prefill DCP "
                    f"rank {a_r} of {a}, yet registered with it; run kvbridge-sglang of the same "
                    "version on both servers (the decode maps ranks by the owner rule)"
                )
            src_ptrs, dst_ptrs = self._reshard_entries(dst_kv_ptrs, dst_layer_ids)
            runs = kvbridge.sglang.build_reshard_transfer_runs(
                np.asarray(prefill_kv_indices, dtype=np.int64),
                np.asarray(dst_kv_indices, dtype=np.int64),
                src_page_size=page,
                dst_page_size=page,
                src_dcp_size=a,
                src_dcp_rank=a_r,
                dst_dcp_size=dst_dcp_size,
                dst_dcp_rank=dst_dcp_rank,
                decode_prefix_len=decode_prefix_len,
                chunk_start=src_page_offset * page * a,
                num_tokens=num_kv_tokens,
            )
        except (ValueError, RuntimeError) as e:
            return self.engine.fail(f"{type(e).__name__}: {e}")
        return self._write_runs(session_id, runs, src_ptrs, dst_ptrs, dcp_token_item_lens)

    def _reshard_entries(self, dst_kv_ptrs: list, dst_layer_ids: list) -> tuple:
        """Source and destination buffer of each KV entry, paired as SGLang's DCP path does."""
        #= sglang 0.5.23 sglang/srt/disaggregation/mooncake/conn.py MooncakeKVManager.send_kvcache_dcp test: test_mla_prefill_dcp_a_to_decode_dcp_b_owner_rule
        ## src_layer_ids = self.kv_args.kv_layer_ids
        ## if src_layer_ids or dst_layer_ids:
        ## dst_indices = resolve_dcp_dst_entry_indices(
        src_layer_ids = self.kv_args.kv_layer_ids
        if src_layer_ids or dst_layer_ids:
            dst_indices = mooncake_conn.resolve_dcp_dst_entry_indices(
                src_layer_ids, dst_layer_ids, len(self.kv_args.kv_data_ptrs), len(dst_kv_ptrs)
            )
            return self.kv_args.kv_data_ptrs, [dst_kv_ptrs[j] for j in dst_indices]
        src, dst, _ = self.get_mla_kv_ptrs_with_pp(self.kv_args.kv_data_ptrs, dst_kv_ptrs)
        return src, dst


class KvbridgeKVSender(MooncakeKVSender):
    @property
    def supports_host_tensor_indices(self) -> bool:
        """SGLang's prefill (``send_kv_chunk``) reads this per sender: when true it copies each
        chunk's page indices from the GPU into pinned host memory without waiting and records a
        ``torch.cuda.Event`` that the transfer worker waits on, so the scheduler does not stall
        on the copy. That is for pools on a GPU. Pools in host memory (``--device cpu``) have
        their indices on the host already, and pinned memory and CUDA events need a GPU (no
        NVIDIA driver: the scheduler dies on the first request), so they take SGLang's plain
        path. Mooncake's class declares it true whatever the device."""
        #= sglang 0.5.23 sglang/srt/disaggregation/mooncake/conn.py MooncakeKVSender test: test_a_gpu_pool_sender_keeps_the_pinned_memory_path, test_mooncakes_own_sender_is_unchanged
        ## supports_host_tensor_indices = True
        return not self.kv_mgr.pool_memory.on_host


class KvbridgeKVReceiver(MooncakeKVReceiver):
    """SGLang's receiver; what it sends a prefill carries that prefill's own session id, whose
    region ids the decode deregisters when it fails the prefill's rooms (see
    :meth:`KvbridgeKVManager._handle_node_failure`)."""

    def _register_kv_args(self) -> bool:
        with self.kv_mgr.session_group(self.bootstrap_addr):
            return super()._register_kv_args()

    def send_metadata(self, *args, **kwargs):
        with self.kv_mgr.session_group(self.bootstrap_addr):
            return super().send_metadata(*args, **kwargs)


def _is_parallel_info_query(request: web.Request) -> bool:
    """SGLang's query for the whole server's parallel info: every rank -1."""
    #= sglang 0.5.23 sglang/srt/disaggregation/common/conn.py CommonKVManager.try_ensure_parallel_info test: test_the_bootstrap_server_publishes_the_field_and_refuses_two_dcp_sizes
    ## f"prefill_dp_rank={-1}&prefill_cp_rank={-1}&"
    ## f"target_tp_rank={-1}&target_pp_rank={-1}"
    keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
    return all(request.query.get(k) == "-1" for k in keys)


class KvbridgeKVBootstrapServer(MooncakeKVBootstrapServer):
    """SGLang's bootstrap server, also keeping and publishing kvbridge's registration field
    (the prefill's DCP size, which SGLang's parallel info leaves out)."""

    def __init__(self, host: str, port: int):
        # Before SGLang's __init__ starts the server thread.
        self.kvbridge_field: Optional[dict] = None
        super().__init__(host, port)

    async def _handle_route_put(self, request: web.Request):
        data = await request.json()  # aiohttp keeps the body: SGLang's handler reads it again
        field = data.get(reshard.FIELD)
        try:
            reshard.parse_field(field)
        except ValueError as e:
            return web.Response(text=str(e), status=400)
        # The DCP size is the topology every decode maps by: one value per prefill server. The
        # rest of the field follows the latest registration, as SGLang's rank table does.
        dcp = (field or {}).get("dcp_size", 1)
        seen = (self.kvbridge_field or {}).get("dcp_size", 1)
        if self._registered_count and dcp != seen:
            return web.Response(
                text=(
                    f"prefill ranks registered different DCP sizes in their {reshard.FIELD!r} "
                    f"fields ({seen}, then {dcp}); every rank of one prefill server runs with the "
                    "same --dcp-size"
                ),
                status=400,
            )
        response = await super()._handle_route_put(request)
        if response.status == 200:
            self.kvbridge_field = field
        return response

    async def _handle_route_get(self, request: web.Request):
        response = await super()._handle_route_get(request)
        if response.status != 200 or self.kvbridge_field is None or not _is_parallel_info_query(request):
            return response
        payload = json.loads(response.body)
        payload[reshard.FIELD] = self.kvbridge_field
        return web.json_response(payload, status=200)
