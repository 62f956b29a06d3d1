"""The connector's scheduler-side rules, settings and request parameters, without vLLM."""

import logging

import pytest

from kvbridge_vllm import params, scheduler
from kvbridge_vllm.settings import Settings


def test_settings_default_and_refuse_with_the_key_and_what_it_takes():
    s = Settings.from_extra(None, env={})
    assert (s.transport, s.host, s.bootstrap_addr) == ("tcp", "127.0.0.1", "127.0.0.1:8998")
    assert Settings.from_extra({}, env={"VLLM_HOST_IP": "10.0.0.7"}).host == "10.0.0.7"
    assert Settings.from_extra({"transport": "nixl", "bootstrap_port": 9000}, env={}).bootstrap_addr.endswith(":9000")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['trasnport'\].*it takes"):
        Settings.from_extra({"trasnport": "tcp"}, env={})
    with pytest.raises(ValueError, match=r"\['transport'\] = 'udp'.*tcp or nixl"):
        Settings.from_extra({"transport": "udp"}, env={})
    # A decode's KV cache is vLLM's memory, which the shared-memory transport cannot write.
    with pytest.raises(ValueError, match=r"\['transport'\] = 'shm'.*vLLM allocates its KV cache"):
        Settings.from_extra({"transport": "shm"}, env={})
    with pytest.raises(ValueError, match="bootstrap_port.*1-65535"):
        Settings.from_extra({"bootstrap_port": 0}, env={})
    with pytest.raises(ValueError, match="waiting_timeout.*positive number of seconds"):
        Settings.from_extra({"waiting_timeout": -1}, env={})
    assert s.peer_timeout == 10.0 and Settings.from_extra({"peer_timeout": 90}, env={}).peer_timeout == 90
    with pytest.raises(ValueError, match=r"\['peer_timeout'\] = 1.*at least 2 seconds"):
        Settings.from_extra({"peer_timeout": 1}, env={})


def test_the_field_round_trips_and_a_bad_one_says_what_is_wrong():
    kv = params.RemoteKv("127.0.0.1:8998", room=7, num_tokens=300, block_size=128, tp_size=1)
    p = kv.to_params()
    assert p["do_remote_prefill"] is True and params.remote_kv(p) == kv
    assert params.remote_kv(None) is None and params.remote_kv({"do_remote_decode": True}) is None
    with pytest.raises(ValueError, match="carries no 'kvbridge' field"):
        params.remote_kv({"do_remote_prefill": True})
    with pytest.raises(ValueError, match="version 9.*reads version 1"):
        params.remote_kv({"do_remote_prefill": True, "kvbridge": {"version": 9}})
    with pytest.raises(ValueError, match="malformed"):
        params.remote_kv({"do_remote_prefill": True, "kvbridge": {"version": 1, "room": 1}})
    with pytest.raises(ValueError, match="out of range"):
        params.remote_kv({**p, "kvbridge": {**p["kvbridge"], "room": -1}})


def _prefill():
    return scheduler.SchedulerState(Settings.from_extra(None, env={}), block_size=128, tp_size=1, producer=True)


def _decode():
    return scheduler.SchedulerState(Settings.from_extra(None, env={}), block_size=128, tp_size=1, producer=False)


def test_a_finished_prefill_request_holds_its_blocks_until_its_transfer_ends():
    s = _prefill()
    hold, out = s.finished("r1", {"do_remote_decode": True}, True, [4, 9], 200)
    assert hold is True
    kv = params.remote_kv(out)
    assert (kv.bootstrap_addr, kv.num_tokens, kv.block_size, kv.tp_size) == ("127.0.0.1:8998", 200, 128, 1)
    assert 0 <= kv.room < 2**63
    work = s.take_work()
    assert work.sends == [scheduler.Send("r1", kv.room, (4, 9), 200)] and s.take_work().sends == []
    assert s.sends_pending()
    s.transfers_ended(["r1"], [])
    assert not s.sends_pending()


@pytest.mark.parametrize(
    "req_params,completed,blocks",
    [({"do_remote_decode": True}, False, [1]),  # aborted: nothing to send
     (None, True, [1]),  # a plain request
     ({"do_remote_decode": True}, True, [])],  # no blocks
)
def test_other_finished_requests_free_their_blocks_at_once(req_params, completed, blocks):
    s = _prefill()
    assert s.finished("r", req_params, completed, blocks, 10) == (False, None)
    assert s.take_work().sends == [] and not s.sends_pending()


def test_a_decode_request_loads_every_prompt_token_the_prefill_computed():
    s = _decode()
    p = params.RemoteKv("10.0.0.1:8998", 5, 300, 128, 1).to_params()
    assert s.matched_tokens("d1", p, 0, 301) == (300, True)
    assert s.matched_tokens("d1", p, 128, 301) == (172, True)  # a local prefix hit
    assert s.matched_tokens("d1", p, 300, 301) == (0, False)
    s.after_alloc("d1", p, [7, 8, 9], 172, 301)
    (r,) = s.take_work().receives
    assert (r.req_id, r.block_ids, r.cached_tokens, r.kv.room) == ("d1", (7, 8, 9), 128, 5)
    # One transfer per request: vLLM calls again once the KV landed.
    assert p["do_remote_prefill"] is False
    s.after_alloc("d1", p, [7, 8, 9], 0, 301)
    assert s.take_work().receives == []


def test_a_decode_request_that_ends_while_loading_aborts_its_room():
    s = _decode()
    p = params.RemoteKv("10.0.0.1:8998", 5, 300, 128, 1).to_params()
    s.after_alloc("d1", p, [7, 8, 9], 300, 300)
    s.take_work()
    assert s.finished("d1", p, False, [7, 8, 9], 0) == (False, None)
    assert s.take_work().aborts == ["d1"]
    s.transfers_ended([], ["d1"])
    assert s.finished("d1", p, False, [7, 8, 9], 0) == (False, None)
    assert s.take_work().aborts == []


def test_token_row_caches_take_another_block_size():
    """MLA or a GPU cache (``equal_blocks`` False): the prefill's blocks of 16 go to the
    decode's of 128, planned by kvbridge (tests/test_block_sizes.py moves them)."""
    s = scheduler.SchedulerState(Settings.from_extra(None, env={}), block_size=128, tp_size=1, producer=False, equal_blocks=False)
    p = params.RemoteKv("10.0.0.1:8998", 5, 300, 16, 1).to_params()
    assert s.matched_tokens("d1", p, 0, 300) == (300, True)


def test_which_caches_need_equal_blocks():
    from types import SimpleNamespace as NS

    from kvbridge_vllm.worker import head_major_blocks

    config = lambda mla, device: NS(model_config=NS(use_mla=mla), device_config=NS(device_type=device))  # noqa: E731
    assert head_major_blocks(config(False, "cpu"))
    assert not head_major_blocks(config(True, "cpu"))
    assert not head_major_blocks(config(False, "cuda"))


def test_a_pair_this_connector_cannot_serve_computes_its_prompt_with_one_error(caplog):
    s = _decode()
    p = params.RemoteKv("10.0.0.1:8998", 5, 300, 16, 2).to_params()  # another block size
    with caplog.at_level(logging.ERROR, logger="vllm.kvbridge"):
        assert s.matched_tokens("d1", p, 0, 300) == (0, False)
        assert s.matched_tokens("d1", p, 0, 300) == (0, False)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "block size 16 -> decode block size 128" in line and "same --block-size" in line
    assert "head-major" in line
    # TP sizes may differ (kvbridge slices heads, or sends MLA's whole latent): blocks not.
    assert s.matched_tokens("m1", params.RemoteKv("a:1", 5, 300, 128, 2).to_params(), 0, 300) == (300, True)
    bad = {"do_remote_prefill": True, "kvbridge": {"version": 2}}
    assert s.matched_tokens("d2", bad, 0, 300) == (0, False)


# --- the concurrent flow ----------------------------------------------------------------------


def test_concurrent_params_name_the_room_for_both_and_the_prompt_for_the_decode():
    to_prefill, to_decode = params.concurrent_params(77, "10.0.0.1:8998")
    assert params.requested_room(to_prefill) == 77
    kv = params.remote_kv(to_decode)
    assert (kv.room, kv.bootstrap_addr, kv.num_tokens) == (77, "10.0.0.1:8998", None)
    assert kv.tokens(300) == 300
    assert params.requested_room({"do_remote_decode": True}) is None  # sequential
    assert params.requested_room(None) is None
    with pytest.raises(ValueError, match=r"\['room'\] = 'x' is not a room"):
        params.requested_room({"do_remote_decode": True, "kvbridge": {"version": 1, "room": "x"}})
    with pytest.raises(ValueError, match="not version 1"):
        params.requested_room({"do_remote_decode": True, "kvbridge": {"version": 3, "room": 1}})


def _streamed(s, req_id="p1", room=77, prompt=300, **field):
    to_prefill, _ = params.concurrent_params(room, "x:1")
    to_prefill["kvbridge"].update(field)
    s.after_alloc(req_id, to_prefill, [3], 0, prompt)
    return to_prefill


def test_a_streamed_prefill_request_gets_its_table_and_computed_tokens_each_step():
    s = _prefill()
    p = _streamed(s)
    s.scheduled([scheduler.Scheduled("p1", (3, 4), True, 256), scheduler.Scheduled("other", (9,), True, 40)])
    (first,) = s.take_work().streams
    assert first == scheduler.Stream("p1", 77, (3, 4), 256, 300, True)
    s.scheduled([scheduler.Scheduled("p1", (5,), False, 301)])  # the last step: capped at the prompt
    (last,) = s.take_work().streams
    assert (last.block_ids, last.computed) == ((3, 4, 5), 300)
    hold, out = s.finished("p1", p, True, [3, 4, 5], 300)
    work = s.take_work()
    assert hold and work.released == ["p1"] and work.sends == [] and work.aborts == []
    assert params.remote_kv(out).room == 77 and s.sends_pending()
    s.transfers_ended(["p1"], [])
    assert not s.sends_pending()


def test_a_streamed_request_that_ends_early_aborts_and_one_never_scheduled_is_freed():
    s = _prefill()
    p = _streamed(s, "p1")
    s.scheduled([scheduler.Scheduled("p1", (3,), True, 128)])
    s.take_work()
    assert s.finished("p1", p, False, [3], 128) == (True, None)
    work = s.take_work()
    assert work.aborts == ["p1"] and work.released == ["p1"]
    q = _streamed(s, "p2", room=78)
    assert s.finished("p2", q, False, [3], 0) == (False, None)
    assert s.take_work().aborts == []


def test_a_preempted_stream_is_aborted_and_never_streamed_again():
    s = _prefill()
    p = _streamed(s)
    s.scheduled([scheduler.Scheduled("p1", (3,), True, 128)])
    s.take_work()
    s.scheduled([scheduler.Scheduled("p1", (8, 9), True, 256)], preempted={"p1"})
    work = s.take_work()
    assert work.aborts == ["p1"] and work.streams == []
    assert s.finished("p1", p, True, [8, 9], 300) == (True, None)


def test_layerwise_comes_from_the_request_or_the_setting(caplog):
    s = _prefill()
    _streamed(s, "a", layerwise=False)
    _streamed(s, "b")
    with caplog.at_level(logging.ERROR, logger="vllm.kvbridge"):
        _streamed(s, "c", layerwise="no")
    assert "['layerwise'] = 'no' is not true or false" in caplog.text
    s.scheduled([scheduler.Scheduled(r, (1,), True, 10) for r in "abc"])
    assert [w.layerwise for w in s.take_work().streams] == [False, True, True]
    with pytest.raises(ValueError, match="layerwise.*true or false"):
        Settings.from_extra({"layerwise": 1}, env={})


def test_a_concurrent_decode_request_loads_the_whole_prompt_and_lets_kvbridge_check_sizes():
    s = _decode()
    _, p = params.concurrent_params(5, "10.0.0.1:8998")
    assert s.matched_tokens("d1", p, 0, 260) == (260, True)
    s.after_alloc("d1", p, [7, 8, 9], 132, 260)
    (r,) = s.take_work().receives
    assert (r.cached_tokens, r.kv.room) == (128, 5)


TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_requests_trace_context_goes_with_its_room_and_a_malformed_one_is_dropped():
    """vLLM's Request.trace_headers reach the worker with the room (its spans take the caller's
    span as parent); a header that is not W3C's form is the client's mistake and is dropped,
    not a failed transfer."""
    assert scheduler.traceparent({"traceparent": TRACE, "tracestate": "x=1"}) == TRACE
    assert scheduler.traceparent({"traceparent": "00-nothex-01"}) is None
    assert scheduler.traceparent(None) is None and scheduler.traceparent({}) is None
    s = _prefill()
    p = {"do_remote_decode": True}
    s.finished("p1", p, True, [3, 4], 200, TRACE)
    (send,) = s.take_work().sends
    assert send.traceparent == TRACE
    to_prefill, _ = params.concurrent_params(5, "x:1")
    s.after_alloc("p2", to_prefill, [3], 0, 100, TRACE)
    s.scheduled([scheduler.Scheduled("p2", (3,), True, 100)])
    (stream,) = s.take_work().streams
    assert stream.traceparent == TRACE
    d = _decode()
    kv = params.RemoteKv("127.0.0.1:1", room=9, num_tokens=100, block_size=128, tp_size=1).to_params()
    d.after_alloc("d1", kv, [1], 100, 100, TRACE)
    (receive,) = d.take_work().receives
    assert receive.traceparent == TRACE
