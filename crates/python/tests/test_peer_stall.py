"""A prefill process that stops running for a while (SIGSTOP, as a host whose CPUs other
processes hold stops it) after its decode asked for a room: with the default liveness the
decode declares it lost (two heartbeats unanswered, or nothing heard on its TCP sessions for
10 s) and the room fails with that cause; a
decode whose TCP keep-alive timeout and heartbeat allow the pause receives every byte once
the prefill runs again.

The prefill is this file run as a script (``python test_peer_stall.py prefill
KEEPALIVE_TIMEOUT|default``): it prints
its bootstrap address, then ``ready`` once the decode's metadata came, and sends the room's
KV when it reads a line on its standard input.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import kvbridge

LAYERS, PAGE, ROW, PAGES = 2, 16, 576, 4
ITEM = PAGE * ROW
ROOM = 7
TOKENS = 48
SRC, DST = [0, 1, 2], [3, 1, 0]
# Longer than the default liveness takes at its slowest: 10 s of silence on a TCP session,
# checked every 1 s keep-alive interval, or two unanswered heartbeats 5 s apart (10-15 s
# after the stop, by the heartbeat's phase), with slack for a loaded host. At 12 s the test
# once saw the room succeed while another process kept both CPUs busy.
STOPPED_S = 18.0


def descriptor(role):
    return kvbridge.PeerDescriptor.mla(role, PAGE, LAYERS, ROW)


def entries(region):
    return [(region, layer * PAGES * ITEM, PAGES * ITEM) for layer in range(LAYERS)]


def prefill_kv():
    return np.random.default_rng(5).integers(0, 256, size=(LAYERS, PAGES, PAGE, ROW), dtype=np.uint8)


def prefill_main(keepalive_timeout):
    kv = prefill_kv()
    options = {"keepalive_timeout": float(keepalive_timeout)} if keepalive_timeout != "default" else {}
    with kvbridge.BootstrapServer() as server, kvbridge.Engine("tcp", **options) as engine:
        region = engine.register_buffer(kv)
        with kvbridge.PrefillAgent(engine, descriptor("prefill"), entries(region), bootstrap_addr=server.addr) as agent:
            agent.create_room(ROOM)
            print(server.addr, flush=True)
            agent.wait_ready(ROOM, timeout=60.0)
            print("ready", flush=True)
            sys.stdin.readline()
            try:
                agent.send_chunk(ROOM, SRC, TOKENS, last=True)
                agent.wait(ROOM, timeout=60.0)
            except kvbridge.KvbridgeError as e:
                print(f"prefill: {e}", file=sys.stderr, flush=True)


def run(engine_options, agent_options):
    """The decode's room state and wrong bytes, and its failure, after the prefill was stopped
    for ``STOPPED_S`` seconds between the decode's metadata and the send. ``engine_options``
    go to both engines: a stopped side that runs again has heard nothing for as long, and its
    own keep-alive would drop the peer it did not hear."""
    prefill = subprocess.Popen(
        [sys.executable, __file__, "prefill", str(engine_options.get("keepalive_timeout", "default"))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        addr = prefill.stdout.readline().strip()
        with kvbridge.Engine("tcp", **engine_options) as engine:
            mem = engine.allocate(LAYERS * PAGES * ITEM)
            kv = np.asarray(mem).reshape(LAYERS, PAGES, PAGE, ROW)
            with kvbridge.DecodeAgent(engine, descriptor("decode"), entries(mem.region), **agent_options) as agent:
                agent.receive(ROOM, addr, DST)
                assert prefill.stdout.readline().strip() == "ready"
                os.kill(prefill.pid, signal.SIGSTOP)
                time.sleep(STOPPED_S)
                os.kill(prefill.pid, signal.SIGCONT)
                prefill.stdin.write("send\n")
                prefill.stdin.flush()
                try:
                    state = agent.wait(ROOM, timeout=60.0)
                except kvbridge.KVTransferError:
                    state = agent.poll(ROOM)
                want = np.zeros_like(kv)
                src = prefill_kv()
                for s, d in zip(SRC, DST):
                    want[:, d] = src[:, s]
                return state, int(np.count_nonzero(kv != want)), agent.failure(ROOM)
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
        prefill.stdin.close()
        try:
            prefill.wait(timeout=90)
        except subprocess.TimeoutExpired:
            prefill.kill()
            prefill.wait(timeout=30)


def test_a_prefill_stopped_longer_than_the_default_liveness_is_declared_lost():
    state, _, failure = run({}, {})
    assert state == kvbridge.KVPoll.Failed
    # Whichever notices first: the heartbeats, or the TCP sessions' keep-alive.
    assert "did not answer 2 consecutive heartbeats" in failure or "keep-alive timeout" in failure, failure


def test_a_decode_that_allows_the_pause_gets_every_byte():
    state, wrong, failure = run({"keepalive_timeout": 30.0}, {"heartbeat_interval": 15.0})
    assert (state, wrong, failure) == (kvbridge.KVPoll.Success, 0, None)


def test_keepalive_timeout_is_checked():
    with pytest.raises(ValueError, match="at least 2 seconds"):
        kvbridge.Engine("tcp", keepalive_timeout=0.5)
    with pytest.raises(ValueError, match="keepalive_timeout applies to transport=\"tcp\" only|tcp"):
        kvbridge.Engine("loopback", keepalive_timeout=30.0)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "prefill":
    prefill_main(sys.argv[2])
