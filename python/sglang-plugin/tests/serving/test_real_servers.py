"""Real SGLang 0.5.23 servers (``python -m sglang.launch_server`` on this CPU) carry two tiny
models' KV through kvbridge: a prefill + decode pair with ``--disaggregation-transfer-backend
kvbridge`` decodes exactly the greedy tokens of a single server, each of them transformers'
greedy choice too; KV damaged on its way gives other tokens; one prefill feeds two decodes; a
request aborted mid-transfer fails on both sides and the next ones succeed; a restarted decode
works with the same prefill.

Each model's servers are started once, all at once, and shared by that model's tests
(module-scoped fixture, one model after the other); each server runs in a process group of its
own and is ended by its id. Server logs go to a temporary directory
(``KVBRIDGE_SERVING_LOG_DIR`` to keep them). docs/sglang.md, "Serving a model".
"""

from __future__ import annotations

import os
import random
import time

import pytest

import servers
import tiny_models

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(servers.unavailable() is not None, reason=str(servers.unavailable())),
]

MODELS = tiny_models.MODELS
NEW_TOKENS = 16
PAGE = 16  # --page-size of every server (servers.Server)
CHUNK = 64  # the prefill's --chunked-prefill-size: a long prompt is sent in several chunks
# Rooms from these marks on (2**59 rooms each) make the prefill's test entry point damage layer
# 0 of the KV it hands over / pause after each chunk (site/kvbridge_serving_tests.py).
# Ordinary rooms are far below.
DAMAGE_ROOMS = 2**61
SLOW_ROOMS = 2**60
SLOW_S = 1.0
VOCAB_LOW, VOCAB_HIGH = 3, 380  # ids past the special tokens, within the tiny vocabulary


def _prompt(rng: random.Random, n: int) -> list:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


class Stack:
    """One model's servers: a single server, a prefill and a decode (and, for the Llama, a
    second decode on the same prefill)."""

    def __init__(self, model: str, path: str, log_dir: str, second_decode: bool):
        self.model, self.path, self.log_dir = model, path, log_dir
        self.single = servers.Server(f"{model}-single", path, log_dir)
        self.prefill = servers.Server(
            f"{model}-prefill", path, log_dir, mode="prefill",
            args=("--chunked-prefill-size", str(CHUNK)),
            env={
                "KVBRIDGE_SERVING_DAMAGE_ROOMS": str(DAMAGE_ROOMS),
                "KVBRIDGE_SERVING_SLOW_ROOMS": f"{SLOW_ROOMS}:{SLOW_S}",
            },
        )
        self.decode = self.new_decode("decode")
        self.decode2 = self.new_decode("decode2") if second_decode else None
        self.router = servers.Router(self.prefill, self.decode)
        self.extra: list = []  # servers a test starts later; the fixture stops them too

    def new_decode(self, name: str) -> servers.Server:
        return servers.Server(f"{self.model}-{name}", self.path, self.log_dir, mode="decode")

    def all(self) -> list:
        return [s for s in (self.single, self.prefill, self.decode, self.decode2) if s is not None]

    def single_tokens(self, ids: list) -> list:
        return servers.output_ids(self.single.generate({"input_ids": ids, "sampling_params": servers.sampling(NEW_TOKENS)}))

    def transformers_disagrees(self, prompt: list, tokens: list) -> list:
        return tiny_models.greedy_mismatches(self.path, prompt, tokens)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module", params=MODELS)
def stack(request, model_dir, tmp_path_factory):
    """One model's servers, started together; pytest runs every test of one model before it
    starts the next model's servers (at most four servers at once: about 3 GB each here)."""
    model = request.param
    log_dir = os.environ.get("KVBRIDGE_SERVING_LOG_DIR") or str(tmp_path_factory.mktemp("server-logs"))
    st = Stack(model, tiny_models.make(model, model_dir), log_dir, second_decode=(model == "llama"))
    shm_before = servers.left_shm()
    servers.start_all(st.all())
    try:
        yield st
    finally:
        st.router.close()
        servers.stop_all(st.all() + st.extra)
    # Ending a server by its process group must not leave SGLang's files in /dev/shm.
    left = servers.left_shm() - shm_before
    assert not left, f"{model}'s servers left {sorted(left)} in /dev/shm after they were stopped"


# The tests that need the second decode, or that one model's servers suffice for.
llama_only = pytest.mark.parametrize("stack", ["llama"], indirect=True)


def _log_since(server: servers.Server, offset: int) -> str:
    with open(server.log_path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def _log_size(server: servers.Server) -> int:
    return os.path.getsize(server.log_path)


def _assert_same(stack: Stack, what: str, prompts: list, pair: list, single: list):
    """The pair's tokens equal the single server's, and each is transformers' greedy choice
    (tiny_models.greedy_mismatches: bf16 ties aside)."""
    for i, (ids, p, s) in enumerate(zip(prompts, pair, single)):
        where = f"{stack.model} {what} #{i} ({len(ids)} prompt tokens)"
        assert len(p) == NEW_TOKENS, f"{where}: the pair gave {len(p)} tokens: {p}"
        assert p == s, f"{where}: prefill+decode {p}, single server {s}"
        problems = stack.transformers_disagrees(ids, p)
        assert not problems, f"{where}: tokens {p}, transformers disagrees: " + "; ".join(problems)


# Prompt lengths: shorter than a page; several pages in one chunk; several chunks.
LENGTHS = {"under_a_page": 5, "several_pages": 7 * PAGE + 3, "several_chunks": 4 * CHUNK + 37}


@pytest.mark.parametrize("kind", list(LENGTHS))
def test_pair_decodes_the_single_servers_and_transformers_tokens(stack, kind):
    model = stack.model
    rng = random.Random(f"{model}-{kind}")
    ids = _prompt(rng, LENGTHS[kind])
    before = _log_size(stack.prefill)
    pair = stack.router.generate(ids, NEW_TOKENS)
    _assert_same(stack, kind, [ids], [pair], [stack.single_tokens(ids)])
    if kind == "several_chunks":
        # The prompt was new to the prefill: its chunked prefill ran (and sent) several chunks.
        chunks = _log_since(stack.prefill, before).count(f"#new-token: {CHUNK},")
        assert chunks >= LENGTHS[kind] // CHUNK, f"{model}: {chunks} full prefill chunks in {stack.prefill.log_path}"


def test_concurrent_requests(stack):
    model = stack.model
    rng = random.Random(f"{model}-concurrent")
    prompts = [_prompt(rng, n) for n in (9, 40, 3 * CHUNK + 5, 2 * PAGE, 101, 17)]
    futures = [stack.router.submit(ids, NEW_TOKENS) for ids in prompts]
    pair = [servers.output_ids(d.result(timeout=servers.REQUEST_S + 10)) for _, d in futures]
    for p, _ in futures:
        p.result(timeout=servers.REQUEST_S + 10)
    single = [stack.single_tokens(ids) for ids in prompts]
    _assert_same(stack, "concurrent", prompts, pair, single)


def test_damaged_kv_gives_other_tokens(stack):
    """The control: the same kind of request, with the prefill's layer-0 KV zeroed as it is
    handed to the transfer (site/kvbridge_serving_tests.py), decodes other tokens. So equal
    tokens above do depend on the KV that kvbridge moved. A fresh prompt: the damaged pages
    stay in the prefill's prefix cache, where no other test's prompt matches them."""
    model = stack.model
    ids = _prompt(random.Random(f"{model}-damaged"), 3 * PAGE + 1)  # one prefill chunk
    room = DAMAGE_ROOMS + servers.next_room()
    before = _log_size(stack.prefill)
    damaged = stack.router.generate(ids, NEW_TOKENS, room=room)
    intact = stack.single_tokens(ids)
    assert f"room {room}: layer 0 of" in _log_since(stack.prefill, before), (
        f"the prefill did not damage room {room}: see {stack.prefill.log_path}"
    )
    assert not stack.transformers_disagrees(ids, intact)
    assert len(damaged) == NEW_TOKENS
    # The first token is the prefill's, computed before the damage (one chunk); the rest is
    # the decode's, from the KV it received.
    assert damaged[0] == intact[0], f"{model}: the prefill's own token changed: {damaged} vs {intact}"
    assert damaged[1:] != intact[1:], f"{model}: damaged KV still decoded the intact tokens {intact}"
    # transformers' check fails on them too: both comparisons can fail.
    assert stack.transformers_disagrees(ids, damaged), f"{model}: transformers accepts the damaged tokens {damaged}"


@llama_only
def test_one_prefill_feeds_two_decodes(stack):
    second = servers.Router(stack.prefill, stack.decode2)
    try:
        rng = random.Random("two-decodes")
        prompts = [_prompt(rng, n) for n in (12, 2 * CHUNK + 9, 50, 33)]
        # Alternating between the decodes, all in flight at once.
        futures = [(stack.router if i % 2 == 0 else second).submit(ids, NEW_TOKENS) for i, ids in enumerate(prompts)]
        pair = [servers.output_ids(d.result(timeout=servers.REQUEST_S + 10)) for _, d in futures]
        for p, _ in futures:
            p.result(timeout=servers.REQUEST_S + 10)
        single = [stack.single_tokens(ids) for ids in prompts]
        _assert_same(stack, "two decodes", prompts, pair, single)
    finally:
        second.close()


def _wait_in_log(server: servers.Server, offset: int, text: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while text not in _log_since(server, offset):
        if time.monotonic() > end:
            raise AssertionError(f"{text!r} did not appear in {server.log_path} within {deadline_s} s")
        time.sleep(0.05)


@llama_only
def test_a_request_aborted_mid_transfer_fails_and_the_next_ones_succeed(stack):
    """The decode aborts a request after the prefill handed over its first chunk (the prefill
    pauses after each chunk of this room, 5 chunks): the decode's request ends with SGLang's
    transfer error, the prefill's request fails too, and the pair keeps serving."""
    rng = random.Random("abort")
    ids = _prompt(rng, 4 * CHUNK + 20)
    room = SLOW_ROOMS + servers.next_room()
    rid = f"abort-{room}"
    before = _log_size(stack.prefill)
    started = time.monotonic()
    pf, df = stack.router.submit(ids, NEW_TOKENS, room=room, rid=rid)
    _wait_in_log(stack.prefill, before, f"room {room}: a chunk of", servers.REQUEST_S)
    stack.decode.abort(rid)
    with pytest.raises(servers.RequestError) as decode_error:
        df.result(timeout=servers.REQUEST_S + 10)
    # The decode's request ended while the prefill was still handing over this room's chunks.
    chunks = _log_since(stack.prefill, before).count(f"room {room}: a chunk of")
    assert chunks < -(-len(ids) // CHUNK), f"the decode answered only after all {chunks} chunks were handed over"
    assert decode_error.value.status == 500
    assert "Aborted" in str(decode_error.value.body), decode_error.value.body
    with pytest.raises(servers.RequestError) as prefill_error:
        pf.result(timeout=servers.REQUEST_S + 10)
    assert "transfer failed" in str(prefill_error.value.body), prefill_error.value.body
    assert time.monotonic() - started < servers.REQUEST_S

    prompts = [ids, _prompt(rng, 70)]
    pair = [stack.router.generate(p, NEW_TOKENS) for p in prompts]
    single = [stack.single_tokens(p) for p in prompts]
    _assert_same(stack, "after an abort", prompts, pair, single)


@llama_only
def test_a_restarted_decode_works_with_the_same_prefill(stack):
    prefill_pid = stack.prefill.proc.pid
    rng = random.Random("restart")
    first = _prompt(rng, 45)
    assert servers.Router(stack.prefill, stack.decode2).generate(first, NEW_TOKENS) == stack.single_tokens(first)

    stack.decode2.stop()
    assert not stack.decode2.alive()
    restarted = stack.new_decode("decode2-restarted")
    stack.extra.append(restarted)
    servers.start_all([restarted])
    router = servers.Router(stack.prefill, restarted)
    try:
        prompts = [first, _prompt(rng, 2 * CHUNK + 1)]
        pair = [router.generate(p, NEW_TOKENS) for p in prompts]
    finally:
        router.close()
    assert stack.prefill.alive() and stack.prefill.proc.pid == prefill_pid
    single = [stack.single_tokens(p) for p in prompts]
    _assert_same(stack, "restarted decode", prompts, pair, single)

