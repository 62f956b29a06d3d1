"""Which of SGLang's prefill paths the kvbridge sender takes (SGLang 0.5.23, prefill.py,
``send_kv_chunk``): the pinned-memory + ``torch.cuda.Event`` path only for pools on a GPU.

SGLang decides with ``getattr(sender, "supports_host_tensor_indices", False)``; a sender of a
host-pool manager that answered true crashed a real CPU prefill server on its first request
("Found no NVIDIA driver"; tests/serving runs such servers)."""

import types

import pytest

import harness

pytestmark = pytest.mark.sglang


def _sglang_decides(sender) -> bool:
    # The test SGLang's send_kv_chunk makes (reading the attribute as it does).
    return bool(getattr(sender, "supports_host_tensor_indices", False))


def test_a_host_pool_sender_takes_the_plain_path():
    port = harness.free_port()
    args = harness.publish("prefill", port)  # --device cpu; loads the plugin first
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend("kvbridge")
    server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
    manager = None
    try:
        pool = harness.Pool(layers=2, pages=4, page_bytes=64)
        manager = get_kv_class(backend, KVClassType.MANAGER)(pool.kv_args(4), DisaggregationMode.PREFILL, args, True)
        sender = get_kv_class(backend, KVClassType.SENDER)(manager, f"127.0.0.1:{port}", 7)
        assert manager.pool_memory.on_host
        assert _sglang_decides(sender) is False
    finally:
        if manager is not None:
            manager.engine.close()
        server.close()


def test_a_gpu_pool_sender_keeps_the_pinned_memory_path():
    """On a CUDA server the path stays: it keeps SGLang's scheduler from waiting on the
    device-to-host copy of the page indices."""
    from kvbridge_sglang import checks
    from kvbridge_sglang.conn import KvbridgeKVSender

    sender = KvbridgeKVSender.__new__(KvbridgeKVSender)  # only the attribute SGLang reads
    sender.kv_mgr = types.SimpleNamespace(pool_memory=checks.PoolMemory("cuda", 1))
    assert _sglang_decides(sender) is True
    sender.kv_mgr = types.SimpleNamespace(pool_memory=checks.PoolMemory("host", 0))
    assert _sglang_decides(sender) is False


def test_mooncakes_own_sender_is_unchanged():
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    assert MooncakeKVSender.supports_host_tensor_indices is True
