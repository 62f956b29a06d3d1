"""The engine benchmark runs and verifies every byte (a 1 MiB smoke run; speed is not checked)."""

import pytest

from kvbridge import bench_engine


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_engine_bench_runs_and_verifies(transport):
    header, row = bench_engine.lines(runs=2, mib=1, rust=None, transport=transport)
    assert header.split()[:3] == ["transport", "block", "python"]
    assert row.split()[0] == transport
    assert row.split()[-1] == "True"
