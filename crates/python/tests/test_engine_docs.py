"""The scripts of docs/python.md run as written: decode.py and prefill.py in two processes
(over TCP and shared memory), and the adapter example."""

import pathlib
import re
import subprocess
import sys

import pytest

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "python.md"


def script(name):
    """The ```python block of docs/python.md whose first line is `# <name>`."""
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        if block.splitlines()[0].startswith(f"# {name}"):
            return block
    raise AssertionError(f"docs/python.md has no `# {name}` block")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_the_two_process_walkthrough_runs(tmp_path, transport):
    for name in ("decode.py", "prefill.py"):
        (tmp_path / name).write_text(script(name))
    decode = subprocess.Popen(
        [sys.executable, "decode.py", transport], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    prefill = subprocess.run(
        [sys.executable, "prefill.py", transport],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out, _ = decode.communicate(timeout=120)
    assert prefill.returncode == 0, prefill.stderr
    assert prefill.stdout == f"prefill: {2 * 2 * 16 * 576} bytes written\n"
    assert decode.returncode == 0
    assert out == "decode: room 1: every byte verified\n"


def test_the_adapter_example_runs(tmp_path):
    (tmp_path / "adapter.py").write_text(script("adapter.py"))
    run = subprocess.run(
        [sys.executable, "adapter.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "adapter: room 5 transferred\n"
