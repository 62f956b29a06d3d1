"""SGLang's real managers on numpy-backed KV pools, in one process (or one per process).

What SGLang's scheduler does around a transfer (prefill.py / decode.py of SGLang 0.5.23),
cut to the calls that matter: build ``KVArgs`` from the pools, make a manager per rank,
a sender per prefill request and a receiver per decode request, then poll.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from kvbridge_sglang.example import Pool, publish  # noqa: F401 (the tests' pools and setup)

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")

# Generous: the CI machine is loaded; nothing here is a timed assertion.
DEADLINE_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what: str, deadline: float = DEADLINE_S):
    end = time.monotonic() + deadline
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            what = what() if callable(what) else what
            raise AssertionError(f"timed out after {deadline} s waiting for {what}")
        time.sleep(0.02)


def poll_until(obj, states, what: str, deadline: float = DEADLINE_S):
    """Polls a sender or receiver until its state is one of ``states``; returns it."""
    from sglang.srt.disaggregation.base import KVPoll

    seen = []

    def done():
        state = obj.poll()
        if not seen or seen[-1] != state:
            seen.append(state)
        if state in states:
            return (state,)  # KVPoll.Failed is 0: wrapped so that it counts as found
        if state == KVPoll.Failed and KVPoll.Failed not in states:
            try:
                obj.failure_exception()
            except Exception as e:  # the cause, for the assertion message
                raise AssertionError(f"{what}: Failed ({e}); states {seen}") from e
            raise AssertionError(f"{what}: Failed; states {seen}")
        return None

    return wait_for(done, lambda: f"{what} (states so far {seen})", deadline)[0]


def ranks(tp, rank, dcp):
    """Parallel-state overrides for attention-TP rank ``rank`` of ``tp`` with DCP ``dcp`` (DCP
    is nested in attention TP: DCP rank ``rank mod dcp``)."""
    return dict(
        tp_size=tp, attn_tp_size=tp, moe_tp_size=tp, tp_rank=rank, attn_tp_rank=rank, moe_tp_rank=rank,
        attn_dcp_size=dcp, attn_dcp_rank=rank % dcp,
    )


# Prefill DCP a -> decode DCP b: one MLA request of RESHARD_N tokens, pages of RESHARD_P tokens
# of RESHARD_TB bytes, two layers (test_transfer.py, test_two_processes.py).
RESHARD_P, RESHARD_TB, RESHARD_N = 4, 64, 37


def reshard_pages(a, b):
    """The prefill's virtual pages (RESHARD_P * a tokens each) and the decode's (* b)."""
    n, p = RESHARD_N, RESHARD_P
    return [12, 3, 7, 0, 9, 14, 1, 5, 10, 2][: -(-n // (p * a))], [5, 1, 6, 3, 7, 0, 2, 4, 8, 9][: -(-n // (p * b))]


def reshard_pools(a, b):
    """Prefill DCP rank a_r's pool holds position p (p mod a == a_r) at local row p div a, on
    the prefill pages; returns the a pools and decode rank b_r's expected pool by the owner
    rule (position p at local row p div b, on the decode pages). Deterministic in (a, b)."""
    P, tb, n = RESHARD_P, RESHARD_TB, RESHARD_N
    src_pages, d_pages = reshard_pages(a, b)
    tokens = np.random.default_rng(10 * a + b).integers(0, 256, (2, n, tb), dtype=np.uint8)
    prefills = [Pool(layers=2, pages=16, page_bytes=P * tb).fill(a + b) for _ in range(a)]
    want = [[np.zeros((10 * P, tb), dtype=np.uint8) for _ in range(2)] for _ in range(b)]
    for layer in range(2):
        for p in range(n):
            y, x = p // a, p // b
            rows = prefills[p % a].kv[layer].reshape(-1, tb)
            rows[src_pages[y // P] * P + y % P] = tokens[layer, p]
            want[p % b][layer][d_pages[x // P] * P + x % P] = tokens[layer, p]
    for pool in prefills[1:]:
        pool.aux[:] = prefills[0].aux  # aux rows are the same on every TP rank
    return prefills, [[w.reshape(10, P * tb) for w in ranks] for ranks in want]


def send_in_two_chunks(sender, a):
    """2 prefill pages (2 * RESHARD_P * a tokens), then the rest."""
    src_pages, _ = reshard_pages(a, 1)
    first = 2 * RESHARD_P * a
    sender.send(np.asarray(src_pages[:2], dtype=np.int32), num_kv_tokens=first)
    sender.send(np.asarray(src_pages[2:], dtype=np.int32), num_kv_tokens=RESHARD_N - first)


class CountingEngine:
    """A ``kvbridge.Engine`` that records the number of ops (descriptors) of every write it
    posts."""

    def __init__(self, engine):
        self._engine, self.writes = engine, []

    def write(self, peer, ops, **kw):
        self.writes.append(len(ops))
        return self._engine.write(peer, ops, **kw)

    def __getattr__(self, name):
        return getattr(self._engine, name)
