"""The decode's fence groups (`KvbridgeTransferEngine.get_session_id(group)`, `fence`): each
prefill writes through region ids of its own, and fencing one prefill refuses its writes
before a byte moves while the others go on."""

import numpy as np
import pytest

from kvbridge_sglang.engine import KvbridgeTransferEngine

N = 4096


@pytest.fixture
def engines():
    decode = KvbridgeTransferEngine("tcp", host="127.0.0.1", timeout=10.0)
    prefill = KvbridgeTransferEngine("tcp", host="127.0.0.1", timeout=10.0)
    pool, src = np.zeros(4 * N, dtype=np.uint8), np.full(N, 7, dtype=np.uint8)
    decode.register(pool.ctypes.data, pool.nbytes)
    prefill.register(src.ctypes.data, src.nbytes)
    yield decode, prefill, pool, src
    decode.close()
    prefill.close()


def test_a_fenced_prefill_lands_nothing_and_the_others_go_on(engines):
    decode, prefill, pool, src = engines
    at = lambda page: pool.ctypes.data + page * N  # noqa: E731
    sid_a, sid_b = decode.get_session_id("10.0.0.1:8998"), decode.get_session_id("10.0.0.2:8998")
    assert sid_a != sid_b != decode.get_session_id()
    assert prefill.batch_transfer_sync(sid_a, [src.ctypes.data], [at(0)], [N]) == 0
    assert (pool[:N] == 7).all()

    decode.fence("10.0.0.1:8998")
    src[:] = 9
    assert prefill.batch_transfer_sync(sid_a, [src.ctypes.data], [at(1)], [N]) == -1
    assert "region" in prefill.take_error()
    assert (pool[N : 2 * N] == 0).all(), "a fenced prefill's write landed"
    # Another prefill's ids are untouched; the fenced one gets fresh ids with its next session.
    assert prefill.batch_transfer_sync(sid_b, [src.ctypes.data], [at(2)], [N]) == 0
    assert (pool[2 * N : 3 * N] == 9).all()
    fresh = decode.get_session_id("10.0.0.1:8998")
    assert fresh != sid_a
    assert prefill.batch_transfer_sync(fresh, [src.ctypes.data], [at(3)], [N]) == 0
    assert (pool[3 * N :] == 9).all()


def test_deregistering_a_buffer_drops_every_groups_alias(engines):
    decode, prefill, pool, src = engines
    sid = decode.get_session_id("10.0.0.1:8998")
    decode.deregister(pool.ctypes.data)
    assert prefill.batch_transfer_sync(sid, [src.ctypes.data], [pool.ctypes.data], [N]) == -1
    assert not pool.any()
    # Nothing of the buffer is registered any more: it can be registered again.
    decode.register(pool.ctypes.data, pool.nbytes)
