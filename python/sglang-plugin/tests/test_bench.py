"""The benchmark (python -m kvbridge_sglang.bench) on a tiny request, so it keeps running."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sglang


def _run(*extra):
    cmd = [sys.executable, "-m", "kvbridge_sglang.bench", "--requests", "2", "--warmup", "1", "--json", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(done.stdout.strip().splitlines()[-1])


def _bench(backend, *extra):
    out, figures = _run("--backends", backend, "--tokens", "100", "--layers", "2", "--token-bytes", "64",
                        "--page-size", "16", *extra)
    assert figures["skipped"] == {}
    (result,) = figures["results"]
    assert result["backend"] == backend and result["verified"]  # every byte checked by the decode
    assert len(result["send_to_success_s"]) == len(result["metadata_to_success_s"]) == 2
    assert result["kv_bytes"] == 100 * 64 * 2
    assert f"{backend} " in out  # the table's row
    return result


def test_the_bench_moves_a_tiny_request_through_kvbridge():
    _bench("kvbridge")


def test_the_bench_moves_a_tiny_request_to_four_decode_dcp_ranks():
    """MLA prefill DCP 1 -> decode DCP 4: each decode rank's rows checked by the owner rule."""
    _bench("kvbridge", "--dcp", "4")


def test_the_bench_runs_kvbridges_own_end_to_end_beside_the_backend():
    from kvbridge_sglang import bench

    args = type("Args", (), {"kvbridge_lab": None, "layers": 61, "token_bytes": 1152, "tokens": 256,
                             "page_size": 64, "dcp": 1})()
    why = bench.unavailable("e2e", args)
    if why is not None:
        pytest.skip(why)
    out, figures = _run("--backends", "kvbridge,e2e", "--tokens", "256")
    assert figures["skipped"] == {}
    e2e = [r for r in figures["results"] if r["backend"] == "e2e"][0]
    assert e2e["verified"] and e2e["kv_bytes"] == 256 * 61 * 1152
    assert figures["ratios"]["kvbridge_vs_e2e"] > 0
    assert "kvbridge / e2e:" in out


def test_the_demo_row_runs_kvbridges_own_processes_on_the_same_geometry():
    """DCP 1 -> 4: ``kvbridge-lab demo`` with one decode process per rank, as the backend's
    row runs them, every byte verified; its time is the same span (metadata in -> Success)."""
    from kvbridge_sglang import bench

    args = type("Args", (), {"kvbridge_lab": None})()
    why = bench.unavailable("demo", args)
    if why is not None:
        pytest.skip(why)
    out, figures = _run("--backends", "kvbridge,demo", "--dcp", "4", "--tokens", "256", "--layers", "2",
                        "--token-bytes", "64", "--page-size", "16")
    assert figures["skipped"] == {}
    demo = [r for r in figures["results"] if r["backend"] == "demo"][0]
    assert demo["verified"] and demo["kv_bytes"] == 256 * 2 * 64
    assert demo["demo"]["requests"] == 3 and demo["demo"]["succeeded"] == 3  # 1 warm-up + 2
    assert "--dcp 4" in demo["command"] and "--tokens 256" in demo["command"]
    assert demo["prefill_p50_ms"] == demo["demo"]["transfer_ms"]["p50"] > 0
    assert figures["ratios"]["kvbridge_vs_demo"] > 0
    assert "kvbridge / demo:" in out


def test_the_demo_row_names_the_missing_binary():
    from kvbridge_sglang import bench

    args = type("Args", (), {"kvbridge_lab": "/nonexistent/kvbridge-lab"})()
    assert "cargo build --release -p kvbridge-lab" in bench.unavailable("demo", args)


def test_the_e2e_half_names_why_it_cannot_run_another_geometry():
    from kvbridge_sglang import bench

    args = type("Args", (), {"kvbridge_lab": sys.executable, "layers": 2, "token_bytes": 64,
                             "tokens": 100, "page_size": 16, "dcp": 1})()
    assert "61 layers of 1152 B" in bench.unavailable("e2e", args)
    args.kvbridge_lab = "/nonexistent/kvbridge-lab"
    assert "cargo build --release -p kvbridge-lab" in bench.unavailable("e2e", args)


def test_the_bench_moves_the_same_request_through_sglangs_mooncake_backend():
    from kvbridge_sglang import bench

    why = bench.unavailable("mooncake")
    if why is not None:
        pytest.skip(why)
    _bench("mooncake")


def test_the_engine_row_posts_the_same_rows_without_sglang():
    out, figures = _run("--backends", "kvbridge,engine", "--tokens", "100", "--layers", "2", "--token-bytes", "64",
                        "--page-size", "16")
    engine = [r for r in figures["results"] if r["backend"] == "engine"][0]
    assert engine["verified"] and engine["kv_bytes"] == 100 * 64 * 2
    assert engine["rows"] == 2 * 7  # one row per page (7 pages of 16 tokens) and layer
    assert "kvbridge / engine:" in out
