"""One side of the SGLang backend's fault tests across a real link: a prefill or a decode
manager (SGLang 0.5.23's classes, numpy pools, as `kvbridge_sglang.example`) that runs the
rooms the test names on its stdin, one command per line, and answers on stdout:

    prefill: serve R   -> "waiting R" once the decode asked for room R
             send R    -> "room R: success" or "room R: failed after S s: CAUSE"
    decode:  receive R -> "asked R", then "room R: verified" or "room R: failed after S s: CAUSE";
                          a failed room's pages get a canary
             check R   -> "canary R: intact" or "canary R: damaged" (bytes landed after the failure)

Every wait is bounded by --timeout; a line "ready" says the manager is up.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kvbridge_sglang.example import LAYERS, PAGE_SIZE, PAGES, SEED, TOKEN_BYTES, Pool, classes, publish

# Room r uses these pages on each side (disjoint between rooms on the decode side).
SRC = [3, 17, 8, 0, 30]
DST = {1: [9, 2, 31, 14, 5], 2: [1, 4, 6, 7, 10], 3: [11, 12, 13, 15, 16]}
CANARY = 0xA5


def say(line: str) -> None:
    print(line, flush=True)


def settle(obj, timeout: float):
    """Polls until Success or Failed; returns (state, seconds, cause)."""
    from sglang.srt.disaggregation.base import KVPoll

    t0 = time.monotonic()
    while True:
        state = obj.poll()
        if state in (KVPoll.Success, KVPoll.Failed):
            cause = ""
            if state == KVPoll.Failed:
                try:
                    obj.failure_exception()
                except Exception as e:  # SGLang's KVTransferError, with the cause
                    cause = str(e).replace("\n", " ")
            return state, time.monotonic() - t0, cause
        if time.monotonic() - t0 > timeout:
            return None, time.monotonic() - t0, f"still {KVPoll(state).name}"
        time.sleep(0.01)


def prefill(port: int, host: str, timeout: float) -> None:
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    args = publish("prefill", port, host=host)
    cls = classes()
    server = cls["BOOTSTRAP_SERVER"](host, port)
    pool = Pool(LAYERS, PAGES, PAGE_SIZE * TOKEN_BYTES).fill(SEED)
    manager = cls["MANAGER"](pool.kv_args(PAGE_SIZE), DisaggregationMode.PREFILL, args, True)
    senders = {}
    say("ready")
    for line in sys.stdin:
        cmd, room = line.split()
        room = int(room)
        if cmd == "serve":
            sender = senders[room] = cls["SENDER"](manager, f"{host}:{port}", room)
            sender.init(len(SRC), aux_index=2)
            end = time.monotonic() + timeout
            while sender.poll() != KVPoll.WaitingForInput and time.monotonic() < end:
                time.sleep(0.01)
            say(f"waiting {room}")
        elif cmd == "send":
            sender = senders[room]
            sender.send(np.asarray(SRC, dtype=np.int32))
            state, secs, cause = settle(sender, timeout)
            say(f"room {room}: success" if state == KVPoll.Success else f"room {room}: failed after {secs:.1f} s: {cause}")
    server.close()


def decode(port: int, host: str, timeout: float) -> None:
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    args = publish("decode", port)
    cls = classes()
    pool = Pool(LAYERS, PAGES, PAGE_SIZE * TOKEN_BYTES)
    manager = cls["MANAGER"](pool.kv_args(PAGE_SIZE), DisaggregationMode.DECODE, args, True)
    addr = f"{host}:{port}"
    src = Pool(LAYERS, PAGES, PAGE_SIZE * TOKEN_BYTES).fill(SEED)
    say("ready")
    for line in sys.stdin:
        cmd, room = line.split()
        room = int(room)
        pages = DST[room]
        if cmd == "receive":
            end = time.monotonic() + timeout
            while not manager.try_ensure_parallel_info(addr) and time.monotonic() < end:
                time.sleep(0.1)
            receiver = cls["RECEIVER"](manager, addr, room)
            receiver.init(0)
            receiver.send_metadata(np.asarray(pages, dtype=np.int32), aux_index=room)
            say(f"asked {room}")
            state, secs, cause = settle(receiver, timeout)
            if state == KVPoll.Success:
                same = all(np.array_equal(got[pages], s[SRC]) for got, s in zip(pool.kv, src.kv))
                say(f"room {room}: verified" if same else f"room {room}: success but the bytes differ")
            else:
                for b in pool.kv:
                    b[pages] = CANARY
                say(f"room {room}: failed after {secs:.1f} s: {cause}")
        elif cmd == "check":
            intact = all((b[pages] == CANARY).all() for b in pool.kv)
            say(f"canary {room}: {'intact' if intact else 'damaged'}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bootstrap-host", required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args()
    (prefill if a.role == "prefill" else decode)(a.port, a.bootstrap_host, a.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
