"""The connector's worker side on real kvbridge agents, without vLLM: a prefill worker with
plain torch tensors for its KV cache."""

import logging
import socket
import time

import pytest

torch = pytest.importorskip("torch")

from kvbridge_vllm.scheduler import Send, Work  # noqa: E402
from kvbridge_vllm.settings import Settings  # noqa: E402
from kvbridge_vllm.worker import Geometry, Worker  # noqa: E402

BLOCKS, KV_HEADS, BLOCK, HEAD = 8, 2, 16, 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nixl_or_skip() -> None:
    """Skips where this kvbridge has no NIXL or no runtime (docs/vllm.md, "Transports")."""
    import kvbridge

    try:
        kvbridge.Engine("nixl").close()
    except kvbridge.KvbridgeError as e:
        pytest.skip(f"kvbridge.Engine('nixl') cannot start here: {e}")


@pytest.fixture(params=["tcp", "nixl"])
def transport(request) -> str:
    """Each transport the connector takes; nixl over host memory (UCX on this host)."""
    if request.param == "nixl":
        nixl_or_skip()
    return request.param


def prefill_worker(settings: Settings) -> Worker:
    geometry = Geometry(
        block_size=BLOCK, num_blocks=BLOCKS, total_kv_heads=KV_HEADS, head_size=HEAD,
        tp_size=1, tp_rank=0, dtype="bfloat16",
    )
    worker = Worker(settings, producer=True, geometry=geometry)
    layers = {f"layer.{i}": torch.zeros(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16) for i in range(2)}
    worker.register(layers)
    return worker


def test_a_finished_request_waits_waiting_timeout_for_its_decode_not_bootstrap_timeout(caplog):
    """The settings say a prefill keeps a finished request's blocks for ``waiting_timeout``
    seconds; ``bootstrap_timeout`` is the decode's wait for the prefill. (The prefill's room
    failed after ``bootstrap_timeout`` while its decode's first request was still being read on
    a loaded host.)"""
    settings = Settings.from_extra(
        {"bootstrap_port": free_port(), "bootstrap_timeout": 0.5, "waiting_timeout": 3.0}, env={}
    )
    caplog.set_level(logging.WARNING, logger="vllm.kvbridge")
    worker = prefill_worker(settings)
    try:
        worker.start(Work(sends=[Send("req-1", room=41, block_ids=(0, 1), num_tokens=20)]))
        started = time.monotonic()
        while time.monotonic() - started < 1.5:  # three bootstrap timeouts
            sent, _, _ = worker.results()
            assert "req-1" not in sent, "the room ended before waiting_timeout"
            time.sleep(0.1)
        while time.monotonic() - started < 10:
            sent, _, _ = worker.results()
            if "req-1" in sent:
                break
            time.sleep(0.1)
        took = time.monotonic() - started
        assert "req-1" in sent, "the room never ended: its blocks would be held forever"
        assert 2.5 < took < 6, took
        assert "timed out after 3.0s in KVPoll.Bootstrapping" in caplog.text, caplog.text
    finally:
        worker.close()


# --- MLA with decode context parallelism, prefill DCP a -> decode DCP b --------------------
#
# vLLM's slot mapping (vllm/v1/worker/block_table.py, cp_kv_cache_interleave_size 1): the DCP
# group shares one block table of virtual blocks of block_size * d tokens; position p lives on
# DCP rank p % d, in slot table[p // (block_size * d)] * block_size + (p % (block_size * d)) // d.

LATENT, MLA_BLOCKS, LAYERS = 64, 16, 2


def slot(p: int, table: list, dcp: int) -> tuple:
    """(DCP rank, slot) of position ``p``, by vLLM's rule."""
    virtual = BLOCK * dcp
    return p % dcp, table[p // virtual] * BLOCK + (p % virtual) // dcp


def token_row(p: int, layer: int) -> "torch.Tensor":
    return torch.full((LATENT,), float((p * 7 + layer * 131) % 251 + 1), dtype=torch.bfloat16)


def mla_workers(settings: Settings, producer: bool, dcp: int) -> list:
    """One worker per rank of a server at TP = DCP = ``dcp`` (rank 0 first: it starts the
    prefill's bootstrap server), each with zeroed ``[blocks, block_size, latent]`` layers."""
    workers = []
    for rank in range(dcp):
        geometry = Geometry(
            block_size=BLOCK, num_blocks=MLA_BLOCKS, total_kv_heads=1, head_size=LATENT,
            tp_size=dcp, tp_rank=rank, dtype="bfloat16", mla=True, dcp_size=dcp, dcp_rank=rank,
        )
        worker = Worker(settings, producer=producer, geometry=geometry)
        # vLLM's CPU MLA shape, [num_blocks, 1, block_size, latent] (a real server's, which a
        # three-dimensional stand-in once hid).
        layers = {f"layer.{i}": torch.zeros(MLA_BLOCKS, 1, BLOCK, LATENT, dtype=torch.bfloat16) for i in range(LAYERS)}
        worker.register(layers)
        worker.tensors = list(layers.values())  # the test's handle on the rank's KV cache
        workers.append(worker)
    return workers


def mismatches(decode: list, table: list, positions: range, dcp: int) -> list:
    """Positions whose row on the decode is not the prefill's, and written rows no position
    owns (a write outside the request's slots)."""
    wrong, owned = [], {}
    for p in positions:
        rank, at = slot(p, table, dcp)
        owned.setdefault(rank, set()).add(at)
        for layer in range(LAYERS):
            row = decode[rank].tensors[layer].view(-1, LATENT)[at]
            if not torch.equal(row, token_row(p, layer)):
                wrong.append((p, layer))
    for rank, worker in enumerate(decode):
        for layer in range(LAYERS):
            rows = worker.tensors[layer].view(-1, LATENT)
            stray = [i for i in torch.nonzero(rows.abs().sum(dim=1)).flatten().tolist() if i not in owned.get(rank, set())]
            wrong.extend(("stray", rank, layer, i) for i in stray)
    return wrong


@pytest.mark.parametrize("a, b, tokens, prefix", [(1, 2, 70, 0), (2, 1, 70, 0), (1, 4, 100, 0), (2, 4, 150, 64), (4, 2, 129, 0)])
def test_mla_dcp_a_to_b_lands_each_token_where_vllms_slot_mapping_reads_it(a, b, tokens, prefix, transport):
    """Every prompt token's latent, every layer, lands in the decode slot vLLM's DCP slot
    mapping gives it, from whichever prefill DCP rank held it; no other row is written. With a
    prefix, only the tokens after it move. A flipped byte fails the same check."""
    from kvbridge_vllm.params import RemoteKv
    from kvbridge_vllm.scheduler import Receive

    settings = Settings.from_extra(
        {"bootstrap_port": free_port(), "waiting_timeout": 30.0, "transport": transport}, env={}
    )
    prefill_table = list(range(3, 3 + -(-tokens // (BLOCK * a))))
    decode_table = list(range(MLA_BLOCKS - 1, MLA_BLOCKS - 1 - -(-tokens // (BLOCK * b)), -1))
    prefill = mla_workers(settings, True, a)
    decode = mla_workers(settings, False, b)
    try:
        for p in range(tokens):
            rank, at = slot(p, prefill_table, a)
            for layer in range(LAYERS):
                prefill[rank].tensors[layer].view(-1, LATENT)[at] = token_row(p, layer)
        room = 4242 + a * 10 + b
        for w in prefill:
            w.start(Work(sends=[Send("req", room=room, block_ids=tuple(prefill_table), num_tokens=tokens)]))
        kv = RemoteKv(settings.bootstrap_addr, room, num_tokens=tokens, block_size=BLOCK, tp_size=a)
        for w in decode:
            w.start(Work(receives=[Receive("req", kv, tuple(decode_table), cached_tokens=prefix)]))
        pending = {id(w) for w in prefill + decode}
        end = time.monotonic() + 60
        while pending and time.monotonic() < end:
            for w in prefill + decode:
                sent, received, failed = w.results()
                assert not failed, f"a decode rank failed its load: {w.agent.failure(room)}"
                if "req" in sent | received:
                    pending.discard(id(w))
            time.sleep(0.02)
        assert not pending, "the transfer did not end within 60 s"
        assert mismatches(decode, decode_table, range(prefix, tokens), b) == []
        # The control: the check sees one flipped byte.
        rank, at = slot(tokens - 1, decode_table, b)
        decode[rank].tensors[0].view(-1, LATENT)[at][0] += 1
        assert mismatches(decode, decode_table, range(prefix, tokens), b) == [(tokens - 1, 0)]
    finally:
        for w in decode + prefill:
            w.close()


# --- vLLM's GPU layout (FlashAttention): [2, num_blocks, block_size, kv_heads, head_size] -----

FLASH_BLOCKS, FLASH_HEADS, FLASH_HEAD = 8, 2, 32


def flash_value(p: int, head: int, kv: int, layer: int) -> float:
    return float((p * 5 + head * 37 + kv * 101 + layer * 13) % 241 + 1)


def flash_workers(settings: Settings, producer: bool, tp: int) -> list:
    workers = []
    for rank in range(tp):
        geometry = Geometry(
            block_size=BLOCK, num_blocks=FLASH_BLOCKS, total_kv_heads=FLASH_HEADS, head_size=FLASH_HEAD,
            tp_size=tp, tp_rank=rank, dtype="bfloat16",
        )
        worker = Worker(settings, producer=producer, geometry=geometry)
        heads = FLASH_HEADS // tp
        layers = {
            f"layer.{i}": torch.zeros(2, FLASH_BLOCKS, BLOCK, heads, FLASH_HEAD, dtype=torch.bfloat16)
            for i in range(LAYERS)
        }
        worker.register(layers)
        worker.tensors = list(layers.values())
        workers.append(worker)
    return workers


def flash_mismatches(workers: list, table: list, tokens: int) -> list:
    """(position, head, K or V, layer) whose row is not the expected one, on the rank of a
    server at TP ``len(workers)`` that holds the head."""
    tp = len(workers)
    heads = FLASH_HEADS // tp
    wrong = []
    for p in range(tokens):
        block, at = table[p // BLOCK], p % BLOCK
        for head in range(FLASH_HEADS):
            cache = workers[head // heads].tensors
            for layer in range(LAYERS):
                for kv in range(2):
                    row = cache[layer][kv, block, at, head % heads]
                    if not torch.equal(row, torch.full_like(row, flash_value(p, head, kv, layer))):
                        wrong.append((p, head, kv, layer))
    return wrong


def run_transfer(prefill: list, decode: list, settings: Settings, room: int, tables: tuple, tokens: int) -> None:
    from kvbridge_vllm.params import RemoteKv
    from kvbridge_vllm.scheduler import Receive

    for w in prefill:
        w.start(Work(sends=[Send("req", room=room, block_ids=tuple(tables[0]), num_tokens=tokens)]))
    kv = RemoteKv(settings.bootstrap_addr, room, num_tokens=tokens, block_size=BLOCK, tp_size=len(prefill))
    for w in decode:
        w.start(Work(receives=[Receive("req", kv, tuple(tables[1]), cached_tokens=0)]))
    pending = {id(w) for w in prefill + decode}
    end = time.monotonic() + 60
    while pending and time.monotonic() < end:
        for w in prefill + decode:
            sent, received, failed = w.results()
            assert not failed, "a decode rank failed its load (see the log)"
            if "req" in sent | received:
                pending.discard(id(w))
        time.sleep(0.02)
    assert not pending, "the transfer did not end within 60 s"


@pytest.mark.parametrize("a, b", [(1, 2), (2, 1), (1, 1)])
def test_flash_attention_pages_move_head_by_head_between_tp_sizes(a, b, transport):
    """vLLM's GPU layout, K and V planes of token-major pages, registered as a K and a V entry
    per layer (SGLang's MHA pool): each token's K and V of each head lands on the decode rank
    that holds the head, at the same token of the decode's block; a wrong row fails the check."""
    settings = Settings.from_extra({"bootstrap_port": free_port(), "transport": transport}, env={})
    tokens = 40  # two full blocks and a partial one
    tables = ([1, 4, 6], [7, 2, 0])
    prefill = flash_workers(settings, True, a)
    decode = flash_workers(settings, False, b)
    try:
        heads = FLASH_HEADS // a
        for p in range(tokens):
            for head in range(FLASH_HEADS):
                cache = prefill[head // heads].tensors
                for layer in range(LAYERS):
                    for kv in range(2):
                        cache[layer][kv, tables[0][p // BLOCK], p % BLOCK, head % heads] = flash_value(p, head, kv, layer)
        run_transfer(prefill, decode, settings, 900 + a * 10 + b, tables, tokens)
        assert flash_mismatches(decode, tables[1], tokens) == []
        decode[-1].tensors[1][1, tables[1][0], 3, 0, 5] += 1  # V of token 3, the last rank's first head
        assert flash_mismatches(decode, tables[1], tokens) == [(3, FLASH_HEADS - FLASH_HEADS // b, 1, 1)]
    finally:
        for w in decode + prefill:
            w.close()


def test_a_cache_tensor_in_another_layout_is_refused_with_the_shapes_it_takes():
    """VLLM_KV_CACHE_LAYOUT=HND gives vLLM a permuted view of the same memory: not contiguous
    in its logical order, so not what the connector would describe."""
    settings = Settings.from_extra({"bootstrap_port": free_port()}, env={})
    geometry = Geometry(block_size=BLOCK, num_blocks=FLASH_BLOCKS, total_kv_heads=2, head_size=32, tp_size=1, tp_rank=0, dtype="bfloat16")
    hnd = torch.zeros(2, FLASH_BLOCKS, 2, BLOCK, 32, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    worker = Worker(settings, producer=False, geometry=geometry)
    try:
        with pytest.raises(ValueError, match=r"shape \(2, 8, 16, 2, 32\) \(contiguous: False\).*FlashAttention"):
            worker.register({"layer.0": hnd})
        assert worker.engine is None  # refused before anything was started
    finally:
        worker.close()


class _OnDevice:
    """Stands for a tensor on a device this machine lacks: only what the check reads."""

    def __init__(self, kind: str):
        import types

        # torch names CUDA devices without a GPU; an NPU it may not know at all.
        self.device = torch.device(kind, 0) if kind == "cuda" else types.SimpleNamespace(type=kind, index=0)


@pytest.mark.parametrize("transport, kind, match", [
    ("tcp", "cuda", r"is on cuda:0, and kvbridge's tcp transport moves host memory only: set \"transport\": \"nixl\""),
    ("tcp", "npu", r"on NVIDIA GPUs \(cuda\)"),
])
def test_a_gpu_cache_on_a_host_only_transport_is_refused_before_anything_starts(transport, kind, match):
    geometry = Geometry(block_size=BLOCK, num_blocks=FLASH_BLOCKS, total_kv_heads=2, head_size=32, tp_size=1, tp_rank=0, dtype="bfloat16")
    worker = Worker(Settings.from_extra({"transport": transport, "bootstrap_port": free_port()}, env={}), producer=False, geometry=geometry)
    with pytest.raises(ValueError, match=match):
        worker.register({"layer.0": _OnDevice(kind)})
    assert worker.engine is None and worker.agent is None  # nothing was started
