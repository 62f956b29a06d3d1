"""kvbridge.Engine("nixl"): two engines in one process, and a decode process, move bytes over
NIXL and every byte is verified. Skipped, saying why, when the package was built without its
`nixl` feature or the NIXL runtime (`cargo xtask nixl-setup`, KVBRIDGE_NIXL_LIB_DIR) is missing.

The decode side is this file run as a script (``python test_engine_nixl.py decode``), speaking
JSON lines on stdin/stdout like test_engine_two_process.py.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

import kvbridge

NBYTES = 1 << 20
SEED = 4321


def nixl_engine():
    """An Engine("nixl"), or a skip naming what is missing."""
    try:
        return kvbridge.Engine("nixl")
    except kvbridge.UnsupportedError as e:
        pytest.skip(f"this kvbridge has no NIXL: {e}")
    except kvbridge.KvbridgeError as e:
        if "NIXL runtime" in str(e):
            pytest.skip(f"no NIXL runtime: {e}")
        raise


def pattern():
    return np.random.default_rng(SEED).integers(0, 256, size=NBYTES, dtype=np.uint8)


def ops(*rows):
    return np.array(rows, dtype=np.uint64)


def test_two_engines_in_one_process_move_every_byte():
    with nixl_engine() as a, nixl_engine() as b:
        assert a.transport == "nixl"
        src = a.allocate(NBYTES)
        np.asarray(src)[:] = pattern()
        dst = b.allocate(NBYTES)
        peer = a.connect(b.local_descriptor())
        half = NBYTES // 2
        t = a.write(
            peer,
            ops((src.region, 0, dst.region, half, half), (src.region, half, dst.region, 0, half)),
            notification=b"nixl 1",
        )
        assert t.wait(timeout=60.0) is True
        assert t.poll() == "done"
        assert t.nbytes == NBYTES
        want = pattern()
        got = np.asarray(dst)
        assert (got[half:] == want[:half]).all()
        assert (got[:half] == want[half:]).all()
        assert [p for _, p in b.notifications(timeout=60.0)] == [b"nixl 1"]


def test_caller_memory_registers_and_moves():
    with nixl_engine() as a, nixl_engine() as b:
        src = pattern()
        region = a.register_buffer(src)
        dst = np.zeros(NBYTES, dtype=np.uint8)
        dst_region = b.register_buffer(dst)
        peer = a.connect(b.local_descriptor())
        t = a.write(peer, ops((region, 0, dst_region, 0, NBYTES)), notification=b"caller")
        assert t.wait(timeout=60.0) is True
        assert (dst == src).all()
        assert [p for _, p in b.notifications(timeout=60.0)] == [b"caller"]


def decode_main():
    """The decode process: allocate, publish where it is, verify after the write."""
    with kvbridge.Engine("nixl") as engine:
        memory = engine.allocate(NBYTES)
        print(
            json.dumps({"descriptor": engine.local_descriptor().hex(), "region": memory.region}),
            flush=True,
        )
        for line in sys.stdin:
            if json.loads(line)["op"] != "expect":
                break
            got = engine.notifications(timeout=60.0)
            wrong = int(np.count_nonzero(np.asarray(memory) != pattern()))
            print(
                json.dumps({"notifications": [p.decode() for _, p in got], "wrong_bytes": wrong}),
                flush=True,
            )


def test_a_decode_process_receives_every_byte():
    with nixl_engine() as engine:
        decode = subprocess.Popen(
            [sys.executable, __file__, "decode"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            hello = json.loads(decode.stdout.readline())
            src = engine.allocate(NBYTES)
            np.asarray(src)[:] = pattern()
            peer = engine.connect(bytes.fromhex(hello["descriptor"]))
            t = engine.write(peer, ops((src.region, 0, hello["region"], 0, NBYTES)), notification=b"p1")
            assert t.wait(timeout=60.0) is True
            decode.stdin.write(json.dumps({"op": "expect"}) + "\n")
            decode.stdin.flush()
            assert json.loads(decode.stdout.readline()) == {"notifications": ["p1"], "wrong_bytes": 0}
        finally:
            try:
                decode.stdin.write(json.dumps({"op": "quit"}) + "\n")
                decode.stdin.close()
            except BrokenPipeError:
                pass
            decode.wait(timeout=60)
    assert decode.returncode == 0


if __name__ == "__main__" and len(sys.argv) == 2 and sys.argv[1] == "decode":
    decode_main()
