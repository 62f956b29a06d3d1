"""Where the pools live (docs/sglang.md, "Pools on GPUs"): host pools are registered as host
memory, CUDA pools as device memory of the server's GPU, and a transport that cannot move
device memory is refused with CUDA pools before anything is registered.

No GPU is needed: device pools are checked at the engine boundary (a recording engine stands
in for ``kvbridge.Engine`` and never touches the memory), with addresses no CPU could read.
"""

import pytest

import harness

pytestmark = pytest.mark.sglang

# Addresses of a pretend GPU pool: not mapped in this process, so any CPU read would crash it.
DEVICE_BASE = 0x7E00_0000_0000


def _publish(device: str, port: int):
    """This process's ServerArgs with ``--device device`` (what SGLang's scheduler publishes)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    args = ServerArgs(
        model_path="dummy",
        device=device,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="kvbridge",
        disaggregation_bootstrap_port=port,
    )
    publish(args, role="test")
    get_parallel().override_permanently(
        pp_group=None, tp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, dp_rank=0, pp_rank=0
    )
    return args


@pytest.fixture
def restore_cpu():
    yield
    harness.publish("prefill", harness.free_port())  # later tests run with --device cpu


def _device_kv_args(gpu_id: int, layers: int = 3, layer_bytes: int = 1 << 20):
    """KVArgs whose KV buffers are a pretend GPU pool (unreadable addresses) and whose aux
    buffer is host memory, as SGLang's MetadataBuffers are on CUDA servers."""
    pool = harness.Pool(layers=1, pages=1, page_bytes=64)  # only its aux rows are used
    args = pool.kv_args(page_size=16)
    args.kv_data_ptrs = [DEVICE_BASE + i * 2 * layer_bytes for i in range(layers)]
    args.kv_data_lens = [layer_bytes] * layers
    args.kv_item_lens = [16 * 576] * layers
    args.kv_layer_ids = list(range(layers))
    args.gpu_id = gpu_id
    return pool, args


class RecordingEngine:
    """Stands in for ``kvbridge.Engine``: records what is registered, moves nothing."""

    instances: list = []

    def __init__(self, transport="tcp", **options):
        self.transport, self.options, self.registered = transport, options, []
        self.device_memory = True
        RecordingEngine.instances.append(self)

    @property
    def capabilities(self):
        return {"device_memory": self.device_memory, "max_ops_per_batch": None, "reads": False}

    def register(self, ptr, length, kind="host", device=0, owner=None):
        self.registered.append((int(ptr), int(length), kind, int(device)))
        return len(self.registered)

    def deregister(self, region):
        pass

    def local_descriptor(self):
        return b"recording"

    def close(self):
        pass


def _decode_manager(args, kv_args):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvbridge_sglang.example import classes

    return classes()["MANAGER"](kv_args, DisaggregationMode.DECODE, args, True)


def test_pool_memory_follows_the_servers_device_and_gpu_id():
    from kvbridge_sglang import checks

    _, kv_args = _device_kv_args(gpu_id=3)
    assert checks.pool_memory(kv_args, "cpu") == checks.PoolMemory("host", 0)
    assert checks.pool_memory(kv_args, "cpu").on_host
    assert checks.pool_memory(kv_args, "cuda") == checks.PoolMemory("cuda", 3)
    assert checks.pool_memory(kv_args, "cuda:3") == checks.PoolMemory("cuda", 3)
    assert not checks.pool_memory(kv_args, "cuda").on_host
    with pytest.raises(ValueError, match="device 'npu'.*--device cpu"):
        checks.pool_memory(kv_args, "npu")
    kv_args.gpu_id = None
    with pytest.raises(ValueError, match="gpu_id is None"):
        checks.pool_memory(kv_args, "cuda")


def test_cuda_pools_are_registered_as_device_memory_of_the_servers_gpu(monkeypatch, restore_cpu):
    import kvbridge

    monkeypatch.setattr(kvbridge, "Engine", RecordingEngine)
    monkeypatch.setenv("KVBRIDGE_SGLANG_TRANSPORT", "nixl")
    RecordingEngine.instances.clear()
    args = _publish("cuda", harness.free_port())
    pool, kv_args = _device_kv_args(gpu_id=1)
    manager = _decode_manager(args, kv_args)
    assert manager.pool_memory.kind == "cuda" and manager.pool_memory.device == 1
    (engine,) = RecordingEngine.instances
    assert engine.transport == "nixl"
    kinds = {ptr: (kind, device) for ptr, _, kind, device in engine.registered}
    assert {p: kinds[p] for p in kv_args.kv_data_ptrs} == {p: ("cuda", 1) for p in kv_args.kv_data_ptrs}
    assert kinds[pool.aux.ctypes.data] == ("host", 0)  # the aux rows stay host memory
    assert len(engine.registered) == len(kv_args.kv_data_ptrs) + 1


def test_host_pools_are_registered_as_host_memory(monkeypatch, restore_cpu):
    """The control of the test above: the same manager with --device cpu registers every
    buffer as host memory."""
    import kvbridge

    monkeypatch.setattr(kvbridge, "Engine", RecordingEngine)
    monkeypatch.setenv("KVBRIDGE_SGLANG_TRANSPORT", "nixl")
    RecordingEngine.instances.clear()
    args = _publish("cpu", harness.free_port())
    pool = harness.Pool(layers=3, pages=4, page_bytes=64)
    kv_args = pool.kv_args(page_size=16)
    kv_args.gpu_id = 1
    manager = _decode_manager(args, kv_args)
    assert manager.pool_memory.on_host
    (engine,) = RecordingEngine.instances
    assert sorted(engine.registered) == sorted(
        (b.ctypes.data, b.nbytes, "host", 0) for b in pool.kv + [pool.aux]
    )


@pytest.mark.parametrize("transport", ["tcp", "loopback"])
def test_cuda_pools_on_a_host_only_transport_are_refused_with_the_fix(monkeypatch, restore_cpu, transport):
    monkeypatch.setenv("KVBRIDGE_SGLANG_TRANSPORT", transport)
    args = _publish("cuda", harness.free_port())
    _, kv_args = _device_kv_args(gpu_id=2)
    with pytest.raises(ValueError) as info:
        _decode_manager(args, kv_args)  # its unreadable pool addresses are never read
    text = str(info.value)
    assert "CUDA device 2" in text and f"KVBRIDGE_SGLANG_TRANSPORT={transport}" in text
    assert "KVBRIDGE_SGLANG_TRANSPORT=nixl" in text and "--device cpu" in text


def test_an_engine_without_device_memory_is_refused_with_cuda_pools(monkeypatch, restore_cpu):
    """The refusal also follows the engine's own capabilities, whatever the transport's name."""
    import kvbridge

    class HostOnly(RecordingEngine):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.device_memory = False

    monkeypatch.setattr(kvbridge, "Engine", HostOnly)
    monkeypatch.setenv("KVBRIDGE_SGLANG_TRANSPORT", "nixl")
    RecordingEngine.instances.clear()
    args = _publish("cuda", harness.free_port())
    _, kv_args = _device_kv_args(gpu_id=0)
    with pytest.raises(ValueError, match="CUDA device 0.*moves host memory only"):
        _decode_manager(args, kv_args)


def test_the_transport_table_agrees_with_the_engines_capabilities():
    """checks.DEVICE_TRANSPORTS (the refusal before SGLang's manager opens sockets) holds every
    transport whose engine declares device memory (NIXL declares it only where a GPU is; the
    manager checks the engine's own word again)."""
    import kvbridge

    from kvbridge_sglang import checks

    seen = 0
    for name in checks.TRANSPORTS:
        try:
            engine = kvbridge.Engine(name, bind="127.0.0.1:0") if name == "tcp" else kvbridge.Engine(name)
        except kvbridge.KvbridgeError:  # nixl where this build or machine has none
            continue
        with engine:
            if name not in checks.DEVICE_TRANSPORTS:
                assert engine.capabilities["device_memory"] is False, name
        seen += 1
    assert seen >= 2


def test_the_unknown_transport_refusal_lists_nixl(monkeypatch):
    from kvbridge_sglang import checks

    monkeypatch.setenv("KVBRIDGE_SGLANG_TRANSPORT", "shm")
    with pytest.raises(ValueError, match="tcp, loopback, nixl"):
        checks.transport()


def test_mooncakes_custom_memory_pool_is_refused(monkeypatch):
    from kvbridge_sglang import checks

    monkeypatch.setenv("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "NVLINK")
    with pytest.raises(ValueError, match="unset SGLANG_MOONCAKE_CUSTOM_MEM_POOL"):
        checks.check_server_args(type("Args", (), {"page_size": 16, "dcp_size": 1})())
