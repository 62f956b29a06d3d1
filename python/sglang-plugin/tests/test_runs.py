"""A chunk moves as runs (docs/sglang.md, "Moving a chunk"): SGLang's page indices become
kvbridge's coalesced runs, and each chunk is one engine write per decode rank, whatever
SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES says; the DCP paths' writes in flight settle before
their room concludes."""

import kvbridge
import numpy as np
import pytest

import harness

pytestmark = pytest.mark.sglang


def _sglang_groups(src, dst):
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous

    return group_concurrent_contiguous(np.asarray(src), np.asarray(dst))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_page_runs_are_sglangs_groups(dtype):
    from kvbridge_sglang.conn import page_runs

    rng = np.random.default_rng(5)
    for case in range(200):
        n = int(rng.integers(1, 60))
        # Stretches of consecutive pages on both sides, cut at random places.
        src = np.cumsum(rng.choice([1, 1, 1, 2, 5], size=n)).astype(dtype) + rng.integers(0, 9)
        dst = np.cumsum(rng.choice([1, 1, 1, 3], size=n)).astype(dtype)
        if case % 3 == 0:
            dst = rng.permutation(n).astype(dtype)
        runs = page_runs(src, dst)
        s_groups, d_groups = _sglang_groups(src, dst)
        assert runs.dtype == np.int64 and runs.shape == (len(s_groups), 3)
        assert [list(range(a, a + k)) for a, _, k in runs.tolist()] == s_groups
        assert [list(range(b, b + k)) for _, b, k in runs.tolist()] == d_groups


def test_page_runs_leave_what_they_do_not_plan_to_sglangs_function():
    from kvbridge_sglang.conn import page_runs

    assert page_runs(np.array([], np.int32), np.array([4], np.int32)).shape == (0, 3)
    assert page_runs(np.array([1, 2]), np.array([1])) is None  # SGLang's ValueError
    assert page_runs(np.array([1.0, 2.0]), np.array([1.0, 2.0])) is None
    assert page_runs(np.array([[1, 2]]), np.array([[1, 2]])) is None


def test_run_progressions_cover_their_runs_exactly():
    from kvbridge_sglang.conn import run_progressions

    def expand(prog):
        return [
            (s + k * ss, d + k * ds, n) for s, d, n, count, ss, ds in prog.tolist() for k in range(count)
        ]

    rng = np.random.default_rng(9)
    for case in range(500):
        n = int(rng.integers(0, 40))
        # Steps that repeat, change and go backwards; runs of one or two lengths.
        src = np.cumsum(rng.choice([4, 4, 4, 1, 9, -30], size=n)) + 100
        dst = np.cumsum(rng.choice([1, 1, 1, 2, 5, -7], size=n)) + 100
        rows = rng.choice([1, 1, 1, 2], size=n) if case % 2 else np.ones(n, dtype=np.int64)
        runs = np.stack([src, dst, rows], axis=1).astype(np.int64)
        prog = run_progressions(runs)
        assert prog.dtype == np.int64 and prog.shape[1] == 6
        assert expand(prog) == [tuple(r) for r in runs.tolist()]
        many = prog[:, 3] > 1
        # Strides a transport takes: non-negative, destinations of one op disjoint.
        assert (prog[many, 4] >= 0).all() and (prog[many, 5] >= prog[many, 2]).all()
    # A DCP rank's rows of two consecutive pages and of one more page: two progressions.
    rows = [(8 * p + r, i, 1) for i, (p, r) in enumerate([(3, 1), (3, 5), (4, 1), (4, 5), (9, 1), (9, 5)])]
    assert run_progressions(np.array(rows)).tolist() == [[25, 0, 1, 4, 4, 1], [73, 4, 1, 2, 4, 1]]


@pytest.fixture
def bootstrap():
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvbridge_sglang.example import classes

    port = harness.free_port()
    args = harness.publish("prefill", port)
    cls = classes()
    server = cls["BOOTSTRAP_SERVER"]("127.0.0.1", port)
    yield args, cls, f"127.0.0.1:{port}", DisaggregationMode
    server.close()


def test_each_chunk_is_one_write_of_its_runs(bootstrap, monkeypatch):
    from sglang.srt.disaggregation.base import KVPoll

    from kvbridge_sglang.conn import page_runs

    # SGLang would split each chunk into engine calls of 2 pages for Mooncake.
    monkeypatch.setenv("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES", "2")
    args, cls, addr, mode = bootstrap
    layers, page_bytes = 3, 4 * 64
    prefill = harness.Pool(layers=layers, pages=24, page_bytes=page_bytes).fill(8)
    decode = harness.Pool(layers=layers, pages=24, page_bytes=page_bytes)
    p_mgr = cls["MANAGER"](prefill.kv_args(4), mode.PREFILL, args, True)
    d_mgr = cls["MANAGER"](decode.kv_args(4), mode.DECODE, args, True)
    counting = harness.CountingEngine(p_mgr.engine.engine)
    p_mgr.engine.engine = counting
    # Three chunks: runs of consecutive pages on both sides, and single pages.
    src = [0, 1, 2, 3, 9, 10, 4, 20, 21, 22, 5, 6]
    dst = [7, 8, 9, 10, 2, 3, 0, 11, 12, 13, 23, 1]
    chunks = [slice(0, 5), slice(5, 9), slice(9, 12)]
    sender = cls["SENDER"](p_mgr, addr, 61)
    harness.wait_for(lambda: d_mgr.try_ensure_parallel_info(addr), "the prefill's parallel info")
    receiver = cls["RECEIVER"](d_mgr, addr, 61)
    receiver.init(0)
    sender.init(len(src), aux_index=1)
    receiver.send_metadata(np.asarray(dst, dtype=np.int32), aux_index=2)
    harness.poll_until(sender, {KVPoll.WaitingForInput}, "sender ready")
    for chunk in chunks:
        sender.send(np.asarray(src[chunk], dtype=np.int32))
    assert harness.poll_until(sender, {KVPoll.Success}, "sender") == KVPoll.Success
    assert harness.poll_until(receiver, {KVPoll.Success}, "receiver") == KVPoll.Success
    for layer, (p, d) in enumerate(zip(prefill.kv, decode.kv)):
        want = np.zeros_like(d)
        want[dst] = p[src]
        assert np.array_equal(d, want), f"layer {layer}"
    assert np.array_equal(decode.aux[2], prefill.aux[1])
    # One write per chunk (its runs times the layers), then the aux row's.
    runs = [len(page_runs(np.array(src[c]), np.array(dst[c]))) for c in chunks]
    assert runs == [2, 3, 3]
    assert counting.writes == [layers * r for r in runs] + [1]


class _Transfer:
    """A posted write that fails when waited for (``PeerLostError``), recording its calls."""

    def __init__(self, fails: bool):
        self.fails, self.calls = fails, []

    def wait(self):
        self.calls.append("wait")
        if self.fails:
            raise kvbridge.PeerLostError("tcp: peer 127.0.0.1:9 lost: connection reset")
        return True

    def cancel(self):
        self.calls.append("cancel")
        return "cancelled"


def test_a_room_concludes_only_after_its_writes_in_flight_and_fails_with_their_cause(bootstrap):
    from sglang.srt.disaggregation.base import KVPoll

    args, cls, _, mode = bootstrap
    pool = harness.Pool(layers=1, pages=4, page_bytes=64)
    mgr = cls["MANAGER"](pool.kv_args(4), mode.PREFILL, args, True)
    table, lock = mgr._in_flight, mgr._in_flight_lock
    # A room whose writes landed concludes Success, each write waited for once.
    ok = [_Transfer(False), _Transfer(False)]
    mgr.request_status[71] = KVPoll.Transferring
    with lock:
        table[71] = [("session-a", t) for t in ok]
    assert mgr.conclude_transfer(bootstrap_room=71, status=KVPoll.Success, targets=[]) == KVPoll.Success
    assert [t.calls for t in ok] == [["wait"], ["wait"]]
    # One write failing turns Success into Failed with kvbridge's cause; its session is failed.
    writes = [_Transfer(False), _Transfer(True)]
    mgr.request_status[72] = KVPoll.Transferring
    with lock:
        table[72] = [("session-a", writes[0]), ("session-b", writes[1])]
    assert mgr.conclude_transfer(bootstrap_room=72, status=KVPoll.Success, targets=[]) == KVPoll.Failed
    assert "PeerLostError: tcp: peer 127.0.0.1:9 lost" in mgr.failure_records[72]
    assert "session-b" in mgr.failed_sessions and "session-a" not in mgr.failed_sessions
    # A room concluded Failed (an abort) has its writes cancelled, not waited for.
    aborted = _Transfer(False)
    mgr.request_status[73] = KVPoll.Transferring
    with lock:
        table[73] = [("session-a", aborted)]
    mgr.conclude_failure(bootstrap_room=73, failure_reason="Aborted by AbortReq.")
    assert aborted.calls == ["cancel"] and 73 not in table
