"""The documented example: a prefill and a decode manager in two processes (docs/sglang.md)."""

import os
import subprocess
import sys

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
