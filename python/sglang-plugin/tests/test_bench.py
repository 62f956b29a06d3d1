"""The benchmark (python -m kvbridge_sglang.bench) on a tiny request, so it keeps running."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sglang


def _bench(backend):
    cmd = [sys.executable, "-m", "kvbridge_sglang.bench", "--backends", backend, "--tokens", "100",
           "--layers", "2", "--token-bytes", "64", "--page-size", "16", "--requests", "2",
           "--warmup", "1", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["skipped"] == {}
    (result,) = figures["results"]
    assert result["backend"] == backend and result["verified"]  # every byte checked by the decode
    assert len(result["send_to_success_s"]) == len(result["metadata_to_success_s"]) == 2
    assert result["kv_bytes"] == 100 * 64 * 2
    assert f"{backend} " in done.stdout  # the table's row
    return result


def test_the_bench_moves_a_tiny_request_through_kvbridge():
    _bench("kvbridge")


def test_the_bench_moves_the_same_request_through_sglangs_mooncake_backend():
    from kvbridge_sglang import bench

    why = bench.unavailable("mooncake")
    if why is not None:
        pytest.skip(why)
    _bench("mooncake")
