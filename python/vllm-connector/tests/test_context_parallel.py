"""Decode context parallelism as vLLM configures it: the connector built by vLLM's own config
classes (``VllmConfig`` with ``decode_context_parallel_size``) on tiny seeded models. vLLM on a
CPU does not serve DCP (its CPU MLA returns no softmax LSE: docs/vllm.md), so the bytes of DCP
a -> b are checked against vLLM's slot mapping in ``test_worker.py``; here, what a server
started with DCP gets from the connector: accepted for MLA with vLLM's default interleave,
refused with the reason for what kvbridge cannot move."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest

pytestmark = pytest.mark.vllm

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "..", "..", "sglang-plugin", "tests", "serving", "tiny_models.py")


def _tiny():
    spec = importlib.util.spec_from_file_location("kvbridge_vllm_tests_tiny", TINY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def models():
    tiny = _tiny()
    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-cp-") as d:
        yield {
            "mla": tiny.make("deepseek_v2", d, latent=(512, 64)),
            "gqa": tiny.make("llama", os.path.join(d, "llama"), head_dim=32),
        }


def connector(model: str, dcp: int, interleave: int = 1, role: str = "kv_consumer", tp: int = 2):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbridge_vllm.connector import KvbridgeConnector

    config = VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16", max_model_len=512, enforce_eager=True),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, decode_context_parallel_size=dcp, cp_kv_cache_interleave_size=interleave
        ),
        cache_config=CacheConfig(block_size=16),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvbridgeConnector", kv_connector_module_path="kvbridge_vllm.connector", kv_role=role
        ),
    )
    return KvbridgeConnector(config, KVConnectorRole.SCHEDULER)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_an_mla_server_with_dcp_gets_a_connector(models, role):
    c = connector(models["mla"], dcp=2, role=role)
    assert (c._dcp_size, c._block_size) == (2, 16)


def test_dcp_on_a_model_without_mla_is_refused_with_the_reason(models):
    """vLLM runs a GQA model with DCP where TP exceeds its KV heads (here 4 > 2): each head on
    several ranks, split by position, which kvbridge's planner does not move."""
    with pytest.raises(ValueError, match="decode-context-parallel-size 2 on a model without MLA"):
        connector(models["gqa"], dcp=2, tp=4)


def test_dcp_interleaved_by_more_than_one_token_is_refused(models):
    with pytest.raises(ValueError, match="cp-kv-cache-interleave-size 2 with DCP 2"):
        connector(models["mla"], dcp=2, interleave=2)
