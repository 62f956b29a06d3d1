"""One request between SGLang's own prefill and decode managers in one process, through
SGLang's bootstrap server, ZMQ messages and transfer worker, bytes moved by kvbridge."""

import contextlib
import math

import numpy as np
import pytest

import harness

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def sglang_env():
    port = harness.free_port()
    args = harness.publish("prefill", port)
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend("kvbridge")
    classes = {t: get_kv_class(backend, t) for t in KVClassType if t != KVClassType.KVARGS}
    server = classes[KVClassType.BOOTSTRAP_SERVER]("127.0.0.1", port)
    yield {
        "args": args,
        "port": port,
        "addr": f"127.0.0.1:{port}",
        "mode": DisaggregationMode,
        "cls": classes,
        "t": KVClassType,
    }
    server.close()


def _managers(env, prefill: harness.Pool, decode: harness.Pool, page_size: int):
    t, mode, cls = env["t"], env["mode"], env["cls"]
    p = cls[t.MANAGER](prefill.kv_args(page_size), mode.PREFILL, env["args"], True)
    d = cls[t.MANAGER](decode.kv_args(page_size), mode.DECODE, env["args"], True)
    return p, d


def _one_request(env, p_mgr, d_mgr, room, src_pages, dst_pages, p_aux, d_aux):
    from sglang.srt.disaggregation.base import KVPoll

    t, cls, addr = env["t"], env["cls"], env["addr"]
    sender = cls[t.SENDER](p_mgr, addr, room)
    harness.wait_for(lambda: d_mgr.try_ensure_parallel_info(addr), "the prefill's parallel info")
    receiver = cls[t.RECEIVER](d_mgr, addr, room)
    receiver.init(0)
    sender.init(len(src_pages), aux_index=p_aux)
    receiver.send_metadata(np.asarray(dst_pages, dtype=np.int32), aux_index=d_aux)
    harness.poll_until(sender, {KVPoll.WaitingForInput}, "sender ready")
    sender.send(np.asarray(src_pages, dtype=np.int32))
    assert harness.poll_until(sender, {KVPoll.Success}, "sender") == KVPoll.Success
    assert harness.poll_until(receiver, {KVPoll.Success}, "receiver") == KVPoll.Success
    return sender, receiver


def test_tp1_to_tp1_every_byte(sglang_env):
    p_mgr, _ = _tp1(sglang_env)
    assert p_mgr.engine.engine.transport == "tcp"


def test_tp1_to_tp1_over_loopback(sglang_env, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_SGLANG_TRANSPORT", "loopback")
    p_mgr, d_mgr = _tp1(sglang_env)
    assert p_mgr.engine.engine.transport == d_mgr.engine.engine.transport == "loopback"


def test_tp1_to_tp1_host_pools_over_nixl(sglang_env, monkeypatch):
    """KVBRIDGE_SGLANG_TRANSPORT=nixl with host pools: every byte through SGLang's managers and
    NIXL (docs/sglang.md, "Pools on GPUs")."""
    import kvbridge

    try:
        kvbridge.Engine("nixl").close()
    except kvbridge.KvbridgeError as e:  # a package without NIXL, or no runtime found
        pytest.skip(f"kvbridge.Engine('nixl') cannot start here: {e}")
    monkeypatch.setenv("KVBRIDGE_SGLANG_TRANSPORT", "nixl")
    p_mgr, d_mgr = _tp1(sglang_env)
    assert p_mgr.engine.engine.transport == d_mgr.engine.engine.transport == "nixl"
    assert p_mgr.pool_memory.on_host


def _tp1(sglang_env):
    prefill = harness.Pool(layers=3, pages=16, page_bytes=4 * 576).fill(1)
    decode = harness.Pool(layers=3, pages=16, page_bytes=4 * 576)
    p_mgr, d_mgr = _managers(sglang_env, prefill, decode, page_size=4)
    src, dst = [3, 9, 4, 11, 0], [7, 1, 2, 15, 8]
    _one_request(sglang_env, p_mgr, d_mgr, 11, src, dst, p_aux=2, d_aux=5)

    expected = [np.zeros_like(b) for b in decode.kv]
    for e, p in zip(expected, prefill.kv):
        e[dst] = p[src]
    for e, got in zip(expected, decode.kv):
        assert np.array_equal(got, e)
    aux = np.zeros_like(decode.aux)
    aux[5] = prefill.aux[2]
    assert np.array_equal(decode.aux, aux)
    return p_mgr, d_mgr


def _owner_rule_expected(prefill, decode_pages, src_pages, d_pages, n_tokens, page_size, dcp, rank, token_bytes):
    """Decode rank ``rank``'s pool after the request: position p lives on rank p mod dcp at
    local row x = p div dcp, physical row D[x div P]*P + x mod P (docs/planning.md)."""
    out = []
    for layer in range(prefill.layers):
        src = prefill.kv[layer].reshape(-1, token_bytes)
        want = np.zeros((decode_pages * page_size, token_bytes), dtype=np.uint8)
        for p in range(rank, n_tokens, dcp):
            x = p // dcp
            want[d_pages[x // page_size] * page_size + x % page_size] = src[
                src_pages[p // page_size] * page_size + p % page_size
            ]
        out.append(want.reshape(decode_pages, page_size * token_bytes))
    return out


def test_mla_prefill_dcp1_to_decode_dcp4_owner_rule(sglang_env):
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.runtime_context import get_parallel

    t, mode, cls, addr = sglang_env["t"], sglang_env["mode"], sglang_env["cls"], sglang_env["addr"]
    P, dcp, tb, n = 4, 4, 64, 37
    prefill = harness.Pool(layers=2, pages=16, page_bytes=P * tb).fill(2)
    decodes = [harness.Pool(layers=2, pages=8, page_bytes=P * tb) for _ in range(dcp)]
    p_mgr = cls[t.MANAGER](prefill.kv_args(P), mode.PREFILL, sglang_env["args"], True)
    d_mgrs = []
    try:
        for r in range(dcp):
            # DCP is nested in attention TP: decode rank r is TP rank r of 4.
            get_parallel().override_permanently(**harness.ranks(tp=dcp, rank=r, dcp=dcp))
            d_mgrs.append(
                cls[t.MANAGER](decodes[r].kv_args(P, engine_rank=r), mode.DECODE, sglang_env["args"], True)
            )
    finally:
        get_parallel().override_permanently(**harness.ranks(tp=1, rank=0, dcp=1))
    counting = harness.CountingEngine(p_mgr.engine.engine)
    p_mgr.engine.engine = counting
    # ceil(37 / 4) prefill pages, 3 to 10 consecutive; ceil(37 / 16) virtual pages of 16
    # tokens, consecutive.
    src_pages = [12, 3, 4, 5, 6, 7, 8, 9, 10, 2]
    d_pages = [5, 6, 7]
    room = 21
    sender = cls[t.SENDER](p_mgr, addr, room)
    receivers = []
    for d_mgr in d_mgrs:
        harness.wait_for(lambda: d_mgr.try_ensure_parallel_info(addr), "the prefill's parallel info")
        rcv = cls[t.RECEIVER](d_mgr, addr, room)
        rcv.init(0)
        receivers.append(rcv)
    sender.init(len(src_pages), aux_index=1)
    for rcv in receivers:
        rcv.send_metadata(np.asarray(d_pages, dtype=np.int32), aux_index=3)
    harness.poll_until(sender, {KVPoll.WaitingForInput}, "sender ready")
    sender.send(np.asarray(src_pages, dtype=np.int32), num_kv_tokens=n)
    assert harness.poll_until(sender, {KVPoll.Success}, "sender") == KVPoll.Success
    for r, rcv in enumerate(receivers):
        assert harness.poll_until(rcv, {KVPoll.Success}, f"decode rank {r}") == KVPoll.Success
    for r in range(dcp):
        want = _owner_rule_expected(prefill, 8, src_pages, d_pages, n, P, dcp, r, tb)
        for layer, (w, got) in enumerate(zip(want, decodes[r].kv)):
            assert np.array_equal(got, w), f"decode rank {r} layer {layer}"
        assert np.array_equal(decodes[r].aux[3], prefill.aux[1])
    # One strided op per layer and stretch of a rank's rows (one row per page here: pages 12,
    # 3..10, 2 are three stretches; rank 0 has 10 rows, the others 9, the last on page 10),
    # not one op per row and layer (20, 18, 18, 18).
    assert sorted(w for w in counting.writes if w > 1) == [4, 4, 4, 6], counting.writes


def _setup_request(env, p_mgr, d_mgr, room, n_pages, dst_pages, p_aux=0, d_aux=0):
    from sglang.srt.disaggregation.base import KVPoll

    t, cls, addr = env["t"], env["cls"], env["addr"]
    sender = cls[t.SENDER](p_mgr, addr, room)
    harness.wait_for(lambda: d_mgr.try_ensure_parallel_info(addr), "the prefill's parallel info")
    receiver = cls[t.RECEIVER](d_mgr, addr, room)
    receiver.init(0)
    sender.init(n_pages, aux_index=p_aux)
    receiver.send_metadata(np.asarray(dst_pages, dtype=np.int32), aux_index=d_aux)
    harness.poll_until(sender, {KVPoll.WaitingForInput}, "sender ready")
    return sender, receiver


def _failure_text(obj):
    from sglang.srt.disaggregation.common.conn import KVTransferError

    with pytest.raises(KVTransferError) as info:
        obj.failure_exception()
    return str(info.value)


def test_abort_mid_transfer_fails_both_sides_and_nothing_lands_after(sglang_env):
    from sglang.srt.disaggregation.base import KVPoll

    prefill = harness.Pool(layers=2, pages=16, page_bytes=4 * 64).fill(3)
    decode = harness.Pool(layers=2, pages=16, page_bytes=4 * 64)
    p_mgr, d_mgr = _managers(sglang_env, prefill, decode, page_size=4)
    src, dst = [1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15]
    sender, receiver = _setup_request(sglang_env, p_mgr, d_mgr, 31, len(src), dst, 1, 2)
    sender.send(np.asarray(src[:3], dtype=np.int32))  # the first chunk of two
    harness.wait_for(lambda: all(np.array_equal(d[dst[:3]], p[src[:3]]) for d, p in zip(decode.kv, prefill.kv)),
                     "the first chunk's bytes")
    receiver.abort()
    assert receiver.poll() == KVPoll.Failed
    assert harness.poll_until(sender, {KVPoll.Failed}, "sender after the abort") == KVPoll.Failed
    sender.send(np.asarray(src[3:], dtype=np.int32))  # the last chunk, after the abort
    assert "Aborted" in _failure_text(receiver)
    _failure_text(sender)
    # What the first chunk wrote stays; nothing of the second chunk or the aux row lands.
    p_mgr.engine.engine.notifications(timeout=1.0)
    for d, p in zip(decode.kv, prefill.kv):
        assert np.array_equal(d[dst[:3]], p[src[:3]])
        assert not d[dst[3:]].any()
    assert not decode.aux.any()


def test_dead_decode_engine_fails_the_room_with_kvbridges_cause(sglang_env):
    from sglang.srt.disaggregation.base import KVPoll

    prefill = harness.Pool(layers=2, pages=8, page_bytes=4 * 64).fill(4)
    decode = harness.Pool(layers=2, pages=8, page_bytes=4 * 64)
    p_mgr, d_mgr = _managers(sglang_env, prefill, decode, page_size=4)
    sender, receiver = _setup_request(sglang_env, p_mgr, d_mgr, 41, 2, [5, 6])
    d_mgr.engine.close()  # the decode's transfer engine is gone
    sender.send(np.asarray([0, 1], dtype=np.int32))
    assert harness.poll_until(sender, {KVPoll.Failed}, "sender") == KVPoll.Failed
    assert "kvbridge:" in _failure_text(sender)
    assert harness.poll_until(receiver, {KVPoll.Failed}, "receiver") == KVPoll.Failed
    # The decode learns the cause from the prefill's status message.
    assert "kvbridge: IoError" in _failure_text(receiver)
    assert not any(d.any() for d in decode.kv)


def test_the_page_and_dcp_paths_plan_with_kvbridges_planner(sglang_env, monkeypatch):
    """The page path groups pages into kvbridge's runs, the prefill-DCP-1 path plans with
    kvbridge's run builder; SGLang's own planner functions are never called."""
    import kvbridge.sglang
    from sglang.srt.disaggregation.mooncake import conn as mooncake_conn

    from kvbridge_sglang import conn

    calls = []

    def counted(name, real):
        def call(*a, **k):
            calls.append(name)
            return real(*a, **k)

        return call

    monkeypatch.setitem(
        conn._RUNS_GLOBALS, "group_concurrent_contiguous",
        counted("page runs", conn._RUNS_GLOBALS["group_concurrent_contiguous"]),
    )
    monkeypatch.setattr(
        kvbridge.sglang, "build_dcp_transfer_runs",
        counted("dcp runs", kvbridge.sglang.build_dcp_transfer_runs),
    )
    for name in ("build_dcp_token_transfer_plan", "group_concurrent_contiguous"):
        assert conn.PLANNER[name] is getattr(kvbridge.sglang, name)

        def refused(*a, _name=name, **k):
            raise AssertionError(f"SGLang's {_name} was called")

        # SGLang's own functions, where the Mooncake methods would look them up.
        monkeypatch.setattr(mooncake_conn, name, refused)
    test_mla_prefill_dcp1_to_decode_dcp4_owner_rule(sglang_env)
    assert calls.count("dcp runs") == 4  # one chunk, four decode ranks
    calls.clear()
    _tp1(sglang_env)
    assert calls == ["page runs"]


@contextlib.contextmanager
def _reshard_request(sglang_env, a, b, room):
    """Prefill DCP a (one manager per rank) and decode DCP b managers on a bootstrap server of
    their own (SGLang's keeps the TP size of its first prefill), one request bootstrapped:
    yields (senders, receivers, prefill pools, decode pools)."""
    from sglang.srt.runtime_context import get_parallel

    t, mode, cls = sglang_env["t"], sglang_env["mode"], sglang_env["cls"]
    P, tb = harness.RESHARD_P, harness.RESHARD_TB
    src_pages, d_pages = harness.reshard_pages(a, b)
    prefills, _ = harness.reshard_pools(a, b)
    decodes = [harness.Pool(layers=2, pages=10, page_bytes=P * tb) for _ in range(b)]
    port = harness.free_port()
    args = harness.publish("prefill", port)
    server = cls[t.BOOTSTRAP_SERVER]("127.0.0.1", port)
    addr = f"127.0.0.1:{port}"
    try:
        p_mgrs, d_mgrs = [], []
        for r in range(a):
            get_parallel().override_permanently(**harness.ranks(tp=a, rank=r, dcp=a))
            p_mgrs.append(cls[t.MANAGER](prefills[r].kv_args(P, engine_rank=r), mode.PREFILL, args, True))
        for r in range(b):
            get_parallel().override_permanently(**harness.ranks(tp=b, rank=r, dcp=b))
            d_mgrs.append(cls[t.MANAGER](decodes[r].kv_args(P, engine_rank=r), mode.DECODE, args, True))
        get_parallel().override_permanently(**harness.ranks(tp=1, rank=0, dcp=1))
        senders = [cls[t.SENDER](m, addr, room) for m in p_mgrs]
        receivers = []
        for r, d_mgr in enumerate(d_mgrs):
            harness.wait_for(lambda: d_mgr.try_ensure_parallel_info(addr), "the prefill's parallel info")
            info = d_mgr.prefill_info_table[addr]
            # kvbridge's registration field, published by SGLang's bootstrap server.
            assert info.kvbridge["version"] == 1 and info.kvbridge["dcp_size"] == a
            assert info.kvbridge["descriptor"]["kv_item_lens"] == [P * tb] * 2
            # The owner rule's sources, not SGLang's TP-size mapping.
            assert info.target_tp_ranks == [s for s in range(a) if s % math.gcd(a, b) == r % math.gcd(a, b)]
            rcv = cls[t.RECEIVER](d_mgr, addr, room)
            rcv.init(0)
            receivers.append(rcv)
        for s in senders:
            s.init(len(src_pages), aux_index=1)
        for rcv in receivers:
            rcv.send_metadata(np.asarray(d_pages, dtype=np.int32), aux_index=3)
        yield senders, receivers, prefills, decodes
    finally:
        get_parallel().override_permanently(**harness.ranks(tp=1, rank=0, dcp=1))
        harness.publish("prefill", sglang_env["port"])  # the module's server for later tests
        server.close()


@pytest.mark.parametrize("a,b", [(2, 4), (4, 2), (2, 1)])
def test_mla_prefill_dcp_a_to_decode_dcp_b_owner_rule(sglang_env, a, b):
    """Prefill DCP a -> decode DCP b (SGLang's own classes refuse a > 1, a != b): each decode
    rank reads from the prefill ranks that own its rows, in two chunks; every byte of every
    decode rank's pool is the owner rule's."""
    from sglang.srt.disaggregation.base import KVPoll

    _, want = harness.reshard_pools(a, b)
    with _reshard_request(sglang_env, a, b, room=50 + 10 * a + b) as (senders, receivers, prefills, decodes):
        for s in senders:
            harness.poll_until(s, {KVPoll.WaitingForInput}, "sender ready")
        for s in senders:
            harness.send_in_two_chunks(s, a)
        for r, s in enumerate(senders):
            assert harness.poll_until(s, {KVPoll.Success}, f"prefill rank {r}") == KVPoll.Success
        for r, rcv in enumerate(receivers):
            assert harness.poll_until(rcv, {KVPoll.Success}, f"decode rank {r}") == KVPoll.Success
        for r in range(b):
            for layer, (w, got) in enumerate(zip(want[r], decodes[r].kv)):
                assert np.array_equal(got, w), f"decode rank {r} layer {layer}"
            assert np.array_equal(decodes[r].aux[3], prefills[0].aux[1])


def test_a_planner_refusal_fails_the_room_with_kvbridges_message(sglang_env):
    """A chunk whose pages do not cover its tokens: kvbridge's planner refuses it, the room
    fails on both sides with the planner's message and problem code, nothing lands."""
    from sglang.srt.disaggregation.base import KVPoll

    src_pages, _ = harness.reshard_pages(2, 4)
    with _reshard_request(sglang_env, 2, 4, room=90) as (senders, receivers, _, decodes):
        for s in senders:
            harness.poll_until(s, {KVPoll.WaitingForInput}, "sender ready")
        for s in senders:
            s.send(np.asarray(src_pages[:2], dtype=np.int32), num_kv_tokens=harness.RESHARD_N)
            s.send(np.asarray(src_pages[2:], dtype=np.int32), num_kv_tokens=0)
        assert harness.poll_until(senders[0], {KVPoll.Failed}, "prefill rank 0") == KVPoll.Failed
        text = _failure_text(senders[0])  # SGLang hands the failure record out once
        assert "kvbridge: ValueError" in text and "KVB-E041" in text, text
        for r, rcv in enumerate(receivers):
            assert harness.poll_until(rcv, {KVPoll.Failed}, f"decode rank {r}") == KVPoll.Failed
        assert "KVB-E041" in _failure_text(receivers[0])
        assert not any(d.kv[layer].any() for d in decodes for layer in range(2))
