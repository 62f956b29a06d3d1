"""A prefill and a decode of different ``--block-size``: the connector's worker side on real
kvbridge agents with torch tensors in vLLM's CPU layouts, every token's KV checked where the
decode's block table puts it, and nothing else written."""

import socket
import time

import pytest

torch = pytest.importorskip("torch")

from kvbridge_vllm.params import RemoteKv  # noqa: E402
from kvbridge_vllm.scheduler import Receive, Send, Work  # noqa: E402
from kvbridge_vllm.settings import Settings  # noqa: E402
from kvbridge_vllm.worker import Geometry, Worker  # noqa: E402

LAYERS, BLOCKS = 2, 24
LATENT = 64
KV_HEADS, HEAD = 2, 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def value(p: int, layer: int, head: int = 0, kv: int = 0) -> float:
    return float((p * 7 + layer * 131 + head * 37 + kv * 101) % 251 + 1)


SHAPES = {
    "mla": lambda block: (BLOCKS, 1, block, LATENT),  # vLLM's CPU MLA
    "flash": lambda block: (2, BLOCKS, block, KV_HEADS, HEAD),  # its GPU FlashAttention
    "cpu-mha": lambda block: (BLOCKS, KV_HEADS, block, 2 * HEAD),  # its CPU attention
}


class Side:
    """One TP 1 server's worker and its layers in one of vLLM's layouts (``SHAPES``)."""

    def __init__(self, settings: Settings, producer: bool, block: int, layout: str):
        self.block, self.layout = block, layout
        mla = layout == "mla"
        geometry = Geometry(
            block_size=block, num_blocks=BLOCKS, total_kv_heads=1 if mla else KV_HEADS,
            head_size=LATENT if mla else HEAD, tp_size=1, tp_rank=0, dtype="bfloat16", mla=mla,
        )
        self.worker = Worker(settings, producer=producer, geometry=geometry)
        shape = SHAPES[layout](block)
        self.layers = [torch.zeros(*shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.worker.register({f"layer.{i}": t for i, t in enumerate(self.layers)})

    def rows(self, layer: int, table: list, p: int) -> list:
        """(expected value, the row view) of position ``p`` in ``layer``: one latent row, or
        each head's K half and V half."""
        block, at = table[p // self.block], p % self.block
        t = self.layers[layer]
        if self.layout == "mla":
            return [(value(p, layer), t[block, 0, at])]
        if self.layout == "flash":
            return [(value(p, layer, h, kv), t[kv, block, at, h]) for h in range(KV_HEADS) for kv in range(2)]
        return [
            (value(p, layer, h, kv), t[block, h, at, kv * HEAD:(kv + 1) * HEAD])
            for h in range(KV_HEADS) for kv in range(2)
        ]

    def fill(self, table: list, tokens: int) -> None:
        for p in range(tokens):
            for layer in range(LAYERS):
                for v, row in self.rows(layer, table, p):
                    row.fill_(v)

    def mismatches(self, table: list, tokens: range) -> list:
        wrong, written = [], 0
        for p in tokens:
            for layer in range(LAYERS):
                for v, row in self.rows(layer, table, p):
                    written += row.numel()
                    if not torch.equal(row, torch.full_like(row, v)):
                        wrong.append((p, layer))
        # Nothing outside the request's rows: every nonzero element is one of them.
        nonzero = sum(int(torch.count_nonzero(t)) for t in self.layers)
        if nonzero != written:
            wrong.append(("stray", nonzero - written))
        return wrong


def table_for(tokens: int, block: int, start: int) -> list:
    """A non-contiguous block table: every other block from ``start``, wrapping."""
    return [(start + 2 * i) % BLOCKS for i in range(-(-tokens // block))]


def move(prefill: Side, decode: Side, settings: Settings, room: int, tables: tuple, tokens: int, cached: int) -> None:
    prefill.worker.start(Work(sends=[Send("req", room=room, block_ids=tuple(tables[0]), num_tokens=tokens)]))
    kv = RemoteKv(settings.bootstrap_addr, room, num_tokens=tokens, block_size=prefill.block, tp_size=1)
    decode.worker.start(Work(receives=[Receive("req", kv, tuple(tables[1]), cached_tokens=cached)]))
    pending = {"prefill", "decode"}
    end = time.monotonic() + 60
    while pending and time.monotonic() < end:
        for name, side in (("prefill", prefill), ("decode", decode)):
            sent, received, failed = side.worker.results()
            assert not failed, f"the decode failed its load: {side.worker.agent.failure(room)}"
            if "req" in sent | received:
                pending.discard(name)
        time.sleep(0.02)
    assert not pending, "the transfer did not end within 60 s"


@pytest.mark.parametrize("layout", ["mla", "flash"])
@pytest.mark.parametrize("a, b, tokens, cached", [(16, 32, 100, 0), (32, 16, 100, 0), (16, 48, 130, 48), (48, 16, 47, 0)])
def test_blocks_of_one_size_land_in_blocks_of_another(a, b, tokens, cached, layout):
    """Prefill blocks of ``a`` tokens, decode blocks of ``b``: each token's rows land at its
    position in the decode's block table; with ``cached`` tokens already on the decode (a
    multiple of its block), only the rest move. One changed element fails the same check."""
    settings = Settings.from_extra({"bootstrap_port": free_port(), "waiting_timeout": 30.0}, env={})
    prefill = Side(settings, True, a, layout)
    decode = Side(settings, False, b, layout)
    try:
        tables = (table_for(tokens, a, 1), table_for(tokens, b, 4))
        prefill.fill(tables[0], tokens)
        move(prefill, decode, settings, 7000 + a * 100 + b, tables, tokens, cached)
        assert decode.mismatches(tables[1], range(cached, tokens)) == []
        _, row = decode.rows(1, tables[1], tokens - 1)[-1]
        row[0] += 1
        assert decode.mismatches(tables[1], range(cached, tokens)) == [(tokens - 1, 1)]
    finally:
        decode.worker.close()
        prefill.worker.close()


def test_head_major_cpu_blocks_of_another_size_are_refused_with_the_reason(caplog):
    """vLLM's CPU attention (head-major blocks) between block sizes: kvbridge's planner refuses
    the pair when the decode asks for the room; the load fails with that reason and no byte of
    the decode's cache is written."""
    import logging

    settings = Settings.from_extra({"bootstrap_port": free_port(), "waiting_timeout": 5.0}, env={})
    prefill = Side(settings, True, 16, "cpu-mha")
    decode = Side(settings, False, 32, "cpu-mha")
    caplog.set_level(logging.ERROR, logger="vllm.kvbridge")
    try:
        tables = (table_for(40, 16, 1), table_for(40, 32, 4))
        prefill.fill(tables[0], 40)
        with pytest.raises(AssertionError, match="the decode failed its load"):
            move(prefill, decode, settings, 7999, tables, 40, 0)
        assert "KVB-PLAN: head-major pages" in caplog.text and "same block size" in caplog.text, caplog.text
        assert sum(int(torch.count_nonzero(t)) for t in decode.layers) == 0
    finally:
        decode.worker.close()
        prefill.worker.close()
