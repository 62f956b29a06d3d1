"""SGLang's transfer-engine interface (register by address, write by address) over
``kvbridge.Engine``.

SGLang's managers speak in raw pointers: ``kv_data_ptrs`` and friends on both sides, and a
transfer is a list of ``(src_ptr, dst_ptr, len)``. kvbridge speaks in registered regions and
offsets, so each side registers every buffer as its own region, and the decode's *session id*
(the string SGLang carries to the prefill in its ZMQ registration message) holds the engine's
descriptor and its region table: ``kvbridge1:`` + hex of JSON ``{"d": descriptor hex,
"r": [[base, len, region], ...]}`` + ``:`` + a number (SGLang's Mooncake manager reads
session ids as ``host:port`` and spreads rooms over its queues by the port). The prefill turns each pointer pair into
``(local_region, local_offset, remote_region, remote_offset, len)`` rows; the engine checks
every row's bounds before a byte moves.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from typing import Callable, Optional, Sequence

import numpy as np

import kvbridge

logger = logging.getLogger(__name__)

SESSION_PREFIX = "kvbridge1:"
# Seconds one batch of writes may take before it fails (docs/sglang.md, "Settings").
TIMEOUT_ENV = "KVBRIDGE_SGLANG_TIMEOUT"


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "30")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


class _RegionTable:
    """Sorted ``(base, len, region)`` rows; maps pointers to ``(region, offset)``."""

    def __init__(self, rows: Sequence[Sequence[int]]):
        rows = sorted((int(b), int(n), int(r)) for b, n, r in rows)
        self.bases = np.array([r[0] for r in rows], dtype=np.uint64)
        self.lens = np.array([r[1] for r in rows], dtype=np.uint64)
        self.ids = np.array([r[2] for r in rows], dtype=np.uint64)

    def locate(self, ptrs: np.ndarray, lengths: np.ndarray, side: str) -> tuple:
        idx = np.searchsorted(self.bases, ptrs, side="right").astype(np.int64) - 1
        bad = idx < 0
        safe = np.where(bad, 0, idx)
        offsets = ptrs - np.where(bad, ptrs, self.bases[safe])
        bad |= offsets + lengths > np.where(bad, 0, self.lens[safe])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise kvbridge.OutOfBoundsError(
                f"{side} range at address {int(ptrs[i]):#x} of {int(lengths[i])} bytes is in no "
                f"registered buffer ({len(self.bases)} registered); SGLang's kv_data_ptrs/"
                "aux_data_ptrs and the transfer disagree: check the KVArgs the manager was built with"
            )
        return self.ids[safe], offsets


class KvbridgeTransferEngine:
    """What SGLang's Mooncake manager calls on its engine, done by a ``kvbridge.Engine``.

    ``device_buffers`` maps the base address of every buffer in GPU memory to its CUDA device
    ordinal: those are registered as device memory (``kind="cuda"``), never touched by the
    CPU; every other buffer is host memory."""

    def __init__(
        self,
        transport: str,
        host: str,
        timeout: Optional[float] = None,
        device_buffers: Optional[dict[int, int]] = None,
    ):
        self.timeout = _timeout() if timeout is None else timeout
        if transport == "tcp":
            self.engine = kvbridge.Engine("tcp", bind=f"{host}:0")
        else:
            self.engine = kvbridge.Engine(transport)
        self._max_ops = self.engine.capabilities.get("max_ops_per_batch")
        self._device_buffers = {int(p): int(d) for p, d in (device_buffers or {}).items()}
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[int, int]] = {}  # base -> (len, region)
        self._local: Optional[_RegionTable] = None
        self._session_id: Optional[str] = None
        # Per prefill (a decode's fence group, by bootstrap address): its own region ids for
        # every buffer (aliases of the same memory) and the session id that carries them. Only
        # where this engine's transport refuses a write to a deregistered id before a byte
        # moves (tcp, loopback); NIXL's peers write registered memory through UCX directly.
        self._fences = transport in ("tcp", "loopback")
        self._groups: dict[str, dict[int, int]] = {}
        self._group_sessions: dict[str, str] = {}
        self._peers: dict[str, tuple[kvbridge.Peer, _RegionTable]] = {}
        self._last_error: Optional[str] = None
        # () -> (room, traceparent) of the calling thread's request, recorded on each write's
        # span (set by the manager; docs/tracing.md).
        self.write_context: Callable[[], tuple] = lambda: (None, None)

    # Registration (both sides).
    def register(self, ptr: int, length: int) -> int:
        return self.batch_register([ptr], [length])

    def batch_register(self, ptrs: Sequence[int], lengths: Sequence[int]) -> int:
        with self._lock:
            for ptr, length in zip(ptrs, lengths):
                if int(length) == 0 or int(ptr) in self._regions:
                    continue
                device = self._device_buffers.get(int(ptr))
                if device is None:
                    region = self.engine.register(int(ptr), int(length))
                else:
                    region = self.engine.register(int(ptr), int(length), kind="cuda", device=device)
                self._regions[int(ptr)] = (int(length), region)
            self._changed()
        return 0

    def deregister(self, ptr: int) -> int:
        return self.batch_deregister([ptr])

    def batch_deregister(self, ptrs: Sequence[int]) -> int:
        with self._lock:
            for ptr in ptrs:
                for aliases in self._groups.values():
                    alias = aliases.pop(int(ptr), None)
                    if alias is not None:
                        self.engine.deregister(alias)
                entry = self._regions.pop(int(ptr), None)
                if entry is not None:
                    self.engine.deregister(entry[1])
            self._changed()
        return 0

    def _changed(self) -> None:
        self._local = _RegionTable([(b, n, r) for b, (n, r) in self._regions.items()])
        self._session_id = None
        self._group_sessions.clear()

    def _encode_session(self, rows) -> str:
        body = {"d": self.engine.local_descriptor().hex(), "r": rows}
        encoded = json.dumps(body).encode()
        return f"{SESSION_PREFIX}{encoded.hex()}:{zlib.crc32(encoded) & 0xFFFF}"

    def get_session_id(self, group: Optional[str] = None) -> str:
        """The session id a peer writes with. With `group` (a decode names the prefill's
        bootstrap address), the ids in it are that group's own aliases of every buffer, so
        :meth:`fence` can cut that group off alone."""
        with self._lock:
            if group is None or not self._fences:
                if self._session_id is None:
                    self._session_id = self._encode_session(
                        [[b, n, r] for b, (n, r) in sorted(self._regions.items())]
                    )
                return self._session_id
            session = self._group_sessions.get(group)
            if session is None:
                aliases = self._groups.setdefault(group, {})
                for base, (_, region) in self._regions.items():
                    if base not in aliases:
                        aliases[base] = self.engine.alias(region)
                session = self._group_sessions[group] = self._encode_session(
                    [[b, n, aliases[b]] for b, (n, _) in sorted(self._regions.items())]
                )
            return session

    def fence(self, group: str) -> None:
        """Deregisters `group`'s aliases: once this returns, no write of a peer that was given
        that group's session id lands (refused before a byte moves); its next session id
        (:meth:`get_session_id`) carries fresh ids."""
        with self._lock:
            aliases = self._groups.pop(group, {})
            self._group_sessions.pop(group, None)
            for alias in aliases.values():
                try:
                    self.engine.deregister(alias)
                except kvbridge.ClosedError:
                    return  # a closed engine takes no write at all
                except kvbridge.KvbridgeError as e:
                    logger.warning("kvbridge: could not fence region %d of %s: %s", alias, group, e)

    # Transfers (prefill side).
    def _peer(self, session_id: str) -> tuple[kvbridge.Peer, _RegionTable]:
        with self._lock:
            found = self._peers.get(session_id)
        if found is not None:
            return found
        if not session_id.startswith(SESSION_PREFIX):
            raise kvbridge.BadDescriptorError(
                f"session id {session_id[:40]!r} is not a kvbridge decode's: both servers "
                "need --disaggregation-transfer-backend kvbridge"
            )
        try:
            encoded = session_id[len(SESSION_PREFIX) :].rsplit(":", 1)[0]
            body = json.loads(bytes.fromhex(encoded))
            descriptor, rows = bytes.fromhex(body["d"]), body["r"]
        except (ValueError, KeyError, TypeError) as e:
            raise kvbridge.BadDescriptorError(
                f"session id of {len(session_id)} characters is not kvbridge's encoding ({e}); "
                "use the same kvbridge-sglang version on prefill and decode"
            ) from None
        peer = self.engine.connect(descriptor)
        found = (peer, _RegionTable(rows))
        with self._lock:
            self._peers[session_id] = found
        return found

    def batch_transfer_sync(
        self,
        session_id: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
    ) -> int:
        """0 when every byte landed; -1 otherwise, the cause kept for :meth:`take_error`."""
        return self.batch_transfer_rows(session_id, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_rows(
        self,
        session_id: str,
        buffers,
        peer_buffer_addresses,
        lengths,
        rows=None,
    ) -> int:
        """:meth:`batch_transfer_sync` where copy ``i`` may be ``counts[i]`` copies of
        ``lengths[i]`` bytes, the ``k``-th from ``buffers[i] + k * src_strides[i]`` to
        ``peer_buffer_addresses[i] + k * dst_strides[i]`` (``rows`` is ``(counts, src_strides,
        dst_strides)``; ``None``: one copy each): one strided descriptor instead of one per
        copy. 0 when every byte landed; -1 otherwise, the cause kept for :meth:`take_error`."""
        try:
            for transfer in self.post_rows(session_id, buffers, peer_buffer_addresses, lengths, rows):
                transfer.wait()
            return 0
        except kvbridge.KvbridgeError as e:
            return self.fail(f"{type(e).__name__}: {e}")

    def post_rows(self, session_id: str, buffers, peer_buffer_addresses, lengths, rows=None) -> list:
        """:meth:`batch_transfer_rows` without the wait: the posted ``kvbridge.Transfer``s (one,
        or one per part where the transport bounds a batch). Raises kvbridge's errors."""
        if len(buffers) == 0:
            return []
        peer, remote = self._peer(session_id)
        src = np.asarray(buffers, dtype=np.uint64)
        dst = np.asarray(peer_buffer_addresses, dtype=np.uint64)
        lens = np.asarray(lengths, dtype=np.uint64)
        with self._lock:
            local = self._local
        if local is None:
            raise kvbridge.UnknownRegionError("no buffer is registered on this side")
        if rows is None:
            src_region, src_off = local.locate(src, lens, "source")
            dst_region, dst_off = remote.locate(dst, lens, "destination")
            ops = np.stack([src_region, src_off, dst_region, dst_off, lens], axis=1)
            counts = None
        else:
            counts, src_strides, dst_strides = (np.asarray(r, dtype=np.uint64) for r in rows)
            # Every copy of an op lies in the buffer its first copy starts in.
            before_last = counts - np.uint64(1)
            src_region, src_off = local.locate(src, lens + before_last * src_strides, "source")
            dst_region, dst_off = remote.locate(dst, lens + before_last * dst_strides, "destination")
            ops = np.stack(
                [src_region, src_off, dst_region, dst_off, lens, counts, src_strides, dst_strides],
                axis=1,
            )
        ops = np.ascontiguousarray(ops)
        room, traceparent = self.write_context()
        posted = []
        try:
            for part in self._parts(ops, counts):
                posted.append(
                    self.engine.write(peer, part, timeout=self.timeout, room=room, traceparent=traceparent)
                )
        except kvbridge.KvbridgeError:
            for transfer in posted:  # no byte of a refused write lands
                transfer.cancel()
            raise
        return posted

    def _parts(self, ops: np.ndarray, counts) -> list:
        """``ops`` as one write, or as parts of at most the transport's ``max_ops_per_batch``
        copies each where it bounds a batch (a transport without strided ops counts every
        copy of a strided op)."""
        if not self._max_ops:
            return [ops]
        if counts is None:
            return [ops[i : i + self._max_ops] for i in range(0, len(ops), self._max_ops)]
        # An op starting before `span` copies of its part have started ends within the bound.
        span = max(1, self._max_ops - int(counts.max()) + 1)
        starts = np.cumsum(counts) - counts
        cuts = np.flatnonzero(np.diff(starts // np.uint64(span))) + 1
        return np.split(ops, cuts)

    def fail(self, cause: str) -> int:
        """Keeps ``cause`` for :meth:`take_error` and returns -1, SGLang's failed transfer."""
        with self._lock:
            self._last_error = cause
        logger.warning("kvbridge: transfer to a decode failed: %s", cause)
        return -1

    def transfer_sync(self, session_id: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        return self.batch_transfer_sync(session_id, [buffer], [peer_buffer_address], [length])

    def take_error(self) -> Optional[str]:
        """The cause of the last failed transfer, once (SGLang records a room's failure in
        another thread than the one whose write failed)."""
        with self._lock:
            last, self._last_error = self._last_error, None
        return last

    def send_probe(self, session_id: str) -> int:
        try:
            peer, _ = self._peer(session_id)
            self.engine.probe(peer, timeout=min(self.timeout, 5.0))
            return 0
        except kvbridge.KvbridgeError:
            return -1

    def close(self) -> None:
        self.engine.close()
