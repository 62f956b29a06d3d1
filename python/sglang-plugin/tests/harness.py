"""SGLang's real managers on numpy-backed KV pools, in one process (or one per process).

What SGLang's scheduler does around a transfer (prefill.py / decode.py of SGLang 0.5.23),
cut to the calls that matter: build ``KVArgs`` from the pools, make a manager per rank,
a sender per prefill request and a receiver per decode request, then poll.
"""

from __future__ import annotations

import os
import socket
import time

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
