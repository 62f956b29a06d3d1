"""The vLLM part of the GPU check (python/sglang-plugin/gpu_check.py, ``--part vllm``) cannot run
without GPUs; what it can be checked for here is the servers it would start: the harness's CPU
servers turned into GPU servers with KvbridgeConnector over NIXL."""

import importlib.util
import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GPU_CHECK = os.path.join(HERE, "..", "..", "sglang-plugin", "gpu_check.py")


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("kvbridge_gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_vllm_servers_of_the_gpu_check_run_on_gpus_over_nixl(tmp_path):
    gpu_check = load_gpu_check()
    harness = gpu_check._vllm_harness()
    decode = harness.VllmServer("decode", str(tmp_path), str(tmp_path), role="kv_consumer")
    assert decode.env["VLLM_TARGET_DEVICE"] == "cpu"
    gpu_check.vllm_on_gpu(decode, "0,1", ["--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"])
    assert not any(k in decode.env for k in gpu_check._VLLM_CPU_ENV), decode.env
    assert decode.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    config = json.loads(decode.cmd[decode.cmd.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KvbridgeConnector" and config["kv_role"] == "kv_consumer"
    assert config["kv_connector_extra_config"]["transport"] == "nixl"
    assert decode.cmd[-4:] == ["--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"]
    assert "--gpu-memory-utilization" in decode.cmd


def test_without_a_gpu_the_check_says_so_and_stops():
    gpu_check = load_gpu_check()
    if gpu_check.gpu_count() > 0:
        pytest.skip("a GPU is here: the check runs itself")
    assert gpu_check.main(["--part", "vllm"]) == 2
