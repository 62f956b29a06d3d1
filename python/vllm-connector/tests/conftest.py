"""vLLM tests are marked ``vllm`` and skipped where vLLM is not installed."""

import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (docs/vllm.md, \"Install\")")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
