"""A prefill and a decode Python process run one request's lifecycle through
kvbridge.PrefillAgent / kvbridge.DecodeAgent (bootstrap, two chunks, aux row, Success), over
shared memory and over TCP; every byte of the decode's KV pool and aux buffer is verified.

The decode is this file run as a script (``python test_agents_two_process.py decode TRANSPORT
BOOTSTRAP_ADDR``); the test process is the prefill and runs the bootstrap server.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

import kvbridge

LAYERS, PAGE, ROW, PAGES = 2, 16, 576, 8
ITEM = PAGE * ROW
AUX_ROW, AUX_ROWS = 64, 4
ROOM = 42
SRC_PAGES = [3, 5, 6]  # 48 tokens: chunk 1 = pages 3, 5 (32 tokens), chunk 2 = page 6
DST_PAGES = [7, 1, 2]
TOKENS = 48
P_AUX, D_AUX = 1, 2
SEED = 99


def descriptor(role):
    return kvbridge.PeerDescriptor.mla(role, PAGE, LAYERS, ROW, aux_item_lens=[AUX_ROW])


def prefill_data():
    rng = np.random.default_rng(SEED)
    kv = rng.integers(0, 256, size=(LAYERS, PAGES, PAGE, ROW), dtype=np.uint8)
    aux = rng.integers(0, 256, size=(AUX_ROWS, AUX_ROW), dtype=np.uint8)
    return kv, aux


def expected_decode():
    kv, aux = prefill_data()
    out_kv, out_aux = np.zeros_like(kv), np.zeros_like(aux)
    for s, d in zip(SRC_PAGES, DST_PAGES):
        out_kv[:, d] = kv[:, s]
    out_aux[D_AUX] = aux[P_AUX]
    return out_kv, out_aux


def entries(region, layers, bytes_per_layer):
    """One (region, offset, len) KV entry per layer of a pool registered as one region."""
    return [(region, layer * bytes_per_layer, bytes_per_layer) for layer in range(layers)]


def decode_main(transport, bootstrap_addr):
    with kvbridge.Engine(transport) as engine:
        kv_mem = engine.allocate(LAYERS * PAGES * ITEM)
        aux_mem = engine.allocate(AUX_ROWS * AUX_ROW)
        kv = np.asarray(kv_mem).reshape(LAYERS, PAGES, PAGE, ROW)
        aux = np.asarray(aux_mem).reshape(AUX_ROWS, AUX_ROW)
        with kvbridge.DecodeAgent(
            engine,
            descriptor("decode"),
            entries(kv_mem.region, LAYERS, PAGES * ITEM),
            [aux_mem],
        ) as agent:
            agent.receive(ROOM, bootstrap_addr, np.array(DST_PAGES), aux_index=D_AUX)
            state = agent.wait(ROOM, timeout=120.0)
            want_kv, want_aux = expected_decode()
            print(
                json.dumps(
                    {
                        "state": state.name,
                        "wrong_kv": int(np.count_nonzero(kv != want_kv)),
                        "wrong_aux": int(np.count_nonzero(aux != want_aux)),
                    }
                ),
                flush=True,
            )


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_request_moves_through_the_agents(transport):
    kv, aux = prefill_data()
    with kvbridge.BootstrapServer() as server, kvbridge.Engine(transport) as engine:
        kv_region = engine.register_buffer(kv)
        aux_region = engine.register_buffer(aux)
        prefill = kvbridge.PrefillAgent(
            engine,
            descriptor("prefill"),
            entries(kv_region, LAYERS, PAGES * ITEM),
            [aux_region],
            bootstrap_addr=server.addr,
        )
        with prefill:
            prefill.create_room(ROOM)
            assert prefill.poll(ROOM) == kvbridge.KVPoll.Bootstrapping
            decode = subprocess.Popen(
                [sys.executable, __file__, "decode", transport, server.addr],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert prefill.wait_ready(ROOM, timeout=120.0) == 0
                assert prefill.poll(ROOM) == kvbridge.KVPoll.WaitingForInput
                prefill.send_chunk(ROOM, np.array(SRC_PAGES[:2], dtype=np.int64), 32)
                prefill.send_chunk(ROOM, SRC_PAGES[2:], TOKENS - 32, last=True, aux_index=P_AUX)
                assert prefill.wait(ROOM, timeout=120.0) == kvbridge.KVPoll.Success
                reply = json.loads(decode.stdout.readline())
            finally:
                decode.wait(timeout=120)
            assert reply == {"state": "Success", "wrong_kv": 0, "wrong_aux": 0}
            assert decode.returncode == 0
            metrics = prefill.metrics()
            assert metrics["rooms_succeeded"] == 1
            assert prefill.failure(ROOM) is None


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "decode":
    decode_main(sys.argv[2], sys.argv[3])
