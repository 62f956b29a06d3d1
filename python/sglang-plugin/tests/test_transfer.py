"""One request between SGLang's own prefill and decode managers in one process, through
SGLang's bootstrap server, ZMQ messages and transfer worker, bytes moved by kvbridge."""

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
