"""A prefill and a decode Python process move a numpy-backed MLA pool through kvbridge.Engine,
over shared memory and over TCP, and every byte of the decode's pool is verified.

The decode side is this file run as a script (``python test_engine_two_process.py decode
TRANSPORT``), speaking JSON lines on stdin/stdout; the test process is the prefill.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

import kvbridge

# MLA: 2 layers of 576-byte token rows, page size 16, 8 pages per side.
LAYERS, PAGE, ROW, PAGES = 2, 16, 576, 8
ITEM = PAGE * ROW  # bytes of one page of one layer
SRC_PAGES = [3, 5, 6, 0]
DST_PAGES = [7, 1, 2, 4]
SEED = 1234


def prefill_pool():
    """The prefill's pool: random bytes from a fixed seed, one array for all layers."""
    rng = np.random.default_rng(SEED)
    return rng.integers(0, 256, size=(LAYERS, PAGES, PAGE, ROW), dtype=np.uint8)


def expected_decode_pool():
    """What the decode pool holds after the transfer: the mapped pages, zeros elsewhere."""
    src = prefill_pool()
    out = np.zeros_like(src)
    for s, d in zip(SRC_PAGES, DST_PAGES):
        out[:, d] = src[:, s]
    return out


def page_ops(src_region, dst_region):
    """One (local_region, local_offset, remote_region, remote_offset, len) row per layer and page."""
    rows = []
    for layer in range(LAYERS):
        base = layer * PAGES * ITEM
        for s, d in zip(SRC_PAGES, DST_PAGES):
            rows.append((src_region, base + s * ITEM, dst_region, base + d * ITEM, ITEM))
    return np.array(rows, dtype=np.uint64)


def strided_ops(src_region, dst_region):
    """The same copy as strided ops: one row per page, `count` = layers, stride = one layer."""
    layer = PAGES * ITEM
    rows = [
        (src_region, s * ITEM, dst_region, d * ITEM, ITEM, LAYERS, layer, layer)
        for s, d in zip(SRC_PAGES, DST_PAGES)
    ]
    return np.array(rows, dtype=np.uint64)


def decode_main(transport):
    """The decode process: allocate the pool, publish where it is, verify after the write."""
    with kvbridge.Engine(transport) as engine:
        memory = engine.allocate(LAYERS * PAGES * ITEM)
        pool = np.asarray(memory).reshape(LAYERS, PAGES, PAGE, ROW)
        print(
            json.dumps(
                {"descriptor": engine.local_descriptor().hex(), "region": memory.region}
            ),
            flush=True,
        )
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "expect":
                got = engine.notifications(timeout=60.0)
                wrong = int(np.count_nonzero(pool != expected_decode_pool()))
                pool[:] = 0  # before replying: the next write may follow the reply at once
                print(
                    json.dumps(
                        {
                            "notifications": [p.decode() for _, p in got],
                            "wrong_bytes": wrong,
                        }
                    ),
                    flush=True,
                )
            elif command["op"] == "quit":
                break


class Decode:
    def __init__(self, transport):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "decode", transport],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = json.loads(self.proc.stdout.readline())
        self.descriptor = bytes.fromhex(hello["descriptor"])
        self.region = hello["region"]

    def ask(self, **command):
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=60)


@pytest.fixture(params=["shm", "tcp"])
def transport(request):
    return request.param


def test_pool_moves_between_processes(transport):
    decode = Decode(transport)
    try:
        with kvbridge.Engine(transport) as engine:
            pool = prefill_pool()
            region = engine.register_buffer(pool)
            peer = engine.connect(decode.descriptor)
            for round_ in range(2):
                t = engine.write(peer, page_ops(region, decode.region), notification=f"r{round_}".encode())
                assert t.wait(timeout=60.0) is True
                assert t.poll() == "done"
                assert t.nbytes == LAYERS * len(SRC_PAGES) * ITEM
                reply = decode.ask(op="expect")
                assert reply == {"notifications": [f"r{round_}"], "wrong_bytes": 0}
    finally:
        decode.close()
    assert decode.proc.returncode == 0


def test_strided_ops_move_the_same_bytes(transport):
    decode = Decode(transport)
    try:
        with kvbridge.Engine(transport) as engine:
            region = engine.register_buffer(prefill_pool())
            peer = engine.connect(decode.descriptor)
            t = engine.write(peer, strided_ops(region, decode.region), notification=b"strided")
            assert t.wait(timeout=60.0)
            assert decode.ask(op="expect") == {"notifications": ["strided"], "wrong_bytes": 0}
    finally:
        decode.close()


def test_a_dead_peer_raises_a_typed_error(transport):
    decode = Decode(transport)
    with kvbridge.Engine(transport) as engine:
        region = engine.register_buffer(prefill_pool())
        peer = engine.connect(decode.descriptor)
        assert engine.write(peer, page_ops(region, decode.region)).wait(timeout=60.0)
        decode.proc.kill()
        decode.proc.wait(timeout=60)
        with pytest.raises(kvbridge.KvbridgeError) as raised:
            # The loss may surface at post or at wait, and on the first or a later batch.
            for _ in range(50):
                engine.write(peer, page_ops(region, decode.region), timeout=10.0).wait(timeout=60.0)
        assert isinstance(
            raised.value,
            (kvbridge.PeerLostError, kvbridge.BatchFailedError, kvbridge.UnknownPeerError),
        ), raised.value
        assert str(raised.value)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "decode":
    decode_main(sys.argv[2])
