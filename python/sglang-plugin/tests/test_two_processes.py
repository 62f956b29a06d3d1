"""The documented example: a prefill and a decode manager in two processes (docs/sglang.md)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import harness

pytestmark = pytest.mark.sglang


def test_one_request_between_two_processes_every_byte():
    _two_processes(dict(os.environ, SGLANG_HOST_IP="127.0.0.1"))


def test_one_request_between_two_processes_over_nixl():
    """The same pair with KVBRIDGE_SGLANG_TRANSPORT=nixl: host pools through NIXL's UCX
    between two processes (docs/sglang.md, "Pools on GPUs")."""
    import kvbridge

    try:
        kvbridge.Engine("nixl").close()
    except kvbridge.KvbridgeError as e:
        pytest.skip(f"kvbridge.Engine('nixl') cannot start here: {e}")
    _two_processes(dict(os.environ, SGLANG_HOST_IP="127.0.0.1", KVBRIDGE_SGLANG_TRANSPORT="nixl"))


def _two_processes(env):
    port = harness.free_port()
    cmd = [sys.executable, "-m", "kvbridge_sglang.example"]
    timeout = ["--port", str(port), "--timeout", str(harness.DEADLINE_S)]
    prefill = subprocess.Popen(cmd + ["prefill"] + timeout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        decode = subprocess.run(cmd + ["decode"] + timeout, env=env, capture_output=True, text=True, timeout=2 * harness.DEADLINE_S)
        out, _ = prefill.communicate(timeout=2 * harness.DEADLINE_S)
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()
    assert decode.returncode == 0, decode.stdout + decode.stderr
    assert "decode: room 1: every byte verified" in decode.stdout
    assert prefill.returncode == 0, out
    assert "prefill: room 1: 5 pages of 4 layers sent" in out


def test_a_dead_prefill_fails_the_decodes_room_by_the_deadline():
    """The prefill process is killed while the decode waits: SGLang's heartbeat notices and
    the room fails (not a hang)."""
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvbridge_sglang.example import classes

    port = harness.free_port()
    env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1")
    prefill = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_sglang.example", "prefill", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        args = harness.publish("decode", port)
        cls = classes()
        pool = harness.Pool(2, 4, 16 * 64)
        manager = cls["MANAGER"](pool.kv_args(16), DisaggregationMode.DECODE, args, True)
        addr = f"127.0.0.1:{port}"
        harness.wait_for(lambda: manager.try_ensure_parallel_info(addr), "the prefill's parallel info")
        # A room the prefill never sends: only its death can end it.
        receiver = cls["RECEIVER"](manager, addr, 99)
        receiver.init(0)
        receiver.send_metadata(np.asarray([1, 2], dtype=np.int32), aux_index=0)
        assert receiver.poll() != KVPoll.Failed
    finally:
        prefill.kill()
        prefill.wait()
    assert harness.poll_until(receiver, {KVPoll.Failed}, "the decode's room") == KVPoll.Failed
    with pytest.raises(KVTransferError):
        receiver.failure_exception()
    assert not any(b.any() for b in pool.kv)


def test_prefill_dcp2_to_decode_dcp4_between_two_processes_every_byte():
    """A prefill of DCP 2 (two ranks) in a child process, a decode of DCP 4 (four ranks) here:
    every decode rank reads from the prefill rank owning its rows, every byte checked."""
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_parallel

    from kvbridge_sglang.example import classes

    a, b, room = 2, 4, 7
    port = harness.free_port()
    env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1")
    script = os.path.join(os.path.dirname(__file__), "reshard_prefill.py")
    prefill = subprocess.Popen(
        [sys.executable, script, str(port), str(a), str(b), str(room)], env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        args = harness.publish("decode", port)
        cls = classes()
        sent, want = harness.reshard_pools(a, b)  # what the child fills, from the same seed
        _, d_pages = harness.reshard_pages(a, b)
        pools = [harness.Pool(2, 10, harness.RESHARD_P * harness.RESHARD_TB) for _ in range(b)]
        receivers = []
        addr = f"127.0.0.1:{port}"
        for r in range(b):
            get_parallel().override_permanently(**harness.ranks(tp=b, rank=r, dcp=b))
            kv_args = pools[r].kv_args(harness.RESHARD_P, engine_rank=r)
            manager = cls["MANAGER"](kv_args, DisaggregationMode.DECODE, args, True)
            harness.wait_for(lambda: manager.try_ensure_parallel_info(addr), "the prefill's parallel info")
            assert manager.prefill_info_table[addr].target_tp_ranks == [r % a]  # the owner rule
            receiver = cls["RECEIVER"](manager, addr, room)
            receiver.init(0)
            receivers.append(receiver)
        get_parallel().override_permanently(**harness.ranks(tp=1, rank=0, dcp=1))
        for receiver in receivers:
            receiver.send_metadata(np.asarray(d_pages, dtype=np.int32), aux_index=3)
        for r, receiver in enumerate(receivers):
            assert harness.poll_until(receiver, {KVPoll.Success}, f"decode rank {r}") == KVPoll.Success
        out, _ = prefill.communicate(input="", timeout=2 * harness.DEADLINE_S)
        assert prefill.returncode == 0 and "prefill: sent" in out, out
        for r in range(b):
            for layer, (w, got) in enumerate(zip(want[r], pools[r].kv)):
                assert np.array_equal(got, w), f"decode rank {r} layer {layer}"
            assert np.array_equal(pools[r].aux[3], sent[0].aux[1])
    finally:
        get_parallel().override_permanently(**harness.ranks(tp=1, rank=0, dcp=1))
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()
