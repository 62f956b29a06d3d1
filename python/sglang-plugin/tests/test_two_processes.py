"""The documented example: a prefill and a decode manager in two processes (docs/sglang.md)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import harness

pytestmark = pytest.mark.sglang


def test_one_request_between_two_processes_every_byte():
    port = harness.free_port()
    env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1")
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
