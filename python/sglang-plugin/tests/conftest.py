"""SGLang tests are marked ``sglang`` and skipped where SGLang 0.5.23 is not installed."""

import importlib.util
import os
import sys

import pytest

# Collecting the tests needs no SGLang and no installed plugin: the source tree stands in.
if importlib.util.find_spec("kvbridge_sglang") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "src"))

# Every socket SGLang opens stays on loopback.
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")


def pytest_collection_modifyitems(config, items):
    try:
        import sglang  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="SGLang 0.5.23 is not installed (python/sglang-plugin/requirements-sglang-0.5.23-cpu.txt)")
        for item in items:
            if "sglang" in item.keywords:
                item.add_marker(skip)
