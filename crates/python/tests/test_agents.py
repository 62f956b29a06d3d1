"""kvbridge.PrefillAgent / DecodeAgent in one process: SGLang's KVPoll, a request end to end
while another thread drives the prefill (the GIL is released in waits), and typed errors."""

import threading
import time

import numpy as np
import pytest

import kvbridge

PAGE, ROW, LAYERS, PAGES = 16, 576, 2, 8
ITEM = PAGE * ROW


def descriptor(role):
    return kvbridge.PeerDescriptor.mla(role, PAGE, LAYERS, ROW)


def move_two_pages(prefill, decode, server, p_kv, d_kv, room, src_pages, dst_pages):
    """Fills the prefill's pools, moves `src_pages` into the decode's `dst_pages` as one room and
    checks every byte of them in every layer."""
    for layer, m in enumerate(p_kv):
        np.asarray(m)[:] = np.arange(m.nbytes, dtype=np.uint64).astype(np.uint8) + layer
    prefill.create_room(room)
    decode.receive(room, server.addr, dst_pages)
    assert prefill.wait_ready(room, timeout=120.0) == 0
    prefill.send_chunk(room, src_pages, 2 * PAGE, last=True)
    assert prefill.wait(room, timeout=120.0) == kvbridge.KVPoll.Success
    assert decode.wait(room, timeout=120.0) == kvbridge.KVPoll.Success
    for layer in range(LAYERS):
        src, dst = np.asarray(p_kv[layer]), np.asarray(d_kv[layer])
        for s, d in zip(src_pages, dst_pages):
            assert (dst[d * ITEM : (d + 1) * ITEM] == src[s * ITEM : (s + 1) * ITEM]).all()


def test_kvpoll_has_sglangs_names_and_values():
    assert [(p.name, int(p)) for p in kvbridge.KVPoll] == [
        ("Failed", 0),
        ("Bootstrapping", 1),
        ("WaitingForInput", 2),
        ("Transferring", 3),
        ("Success", 4),
    ]


@pytest.fixture
def setup():
    server = kvbridge.BootstrapServer()
    p_engine, d_engine = kvbridge.Engine("loopback"), kvbridge.Engine("loopback")
    p_kv = [p_engine.allocate(PAGES * ITEM) for _ in range(LAYERS)]
    d_kv = [d_engine.allocate(PAGES * ITEM) for _ in range(LAYERS)]
    prefill = kvbridge.PrefillAgent(
        p_engine, descriptor("prefill"), p_kv, bootstrap_addr=server.addr
    )
    decode = kvbridge.DecodeAgent(d_engine, descriptor("decode"), d_kv)
    yield server, prefill, decode, p_kv, d_kv
    prefill.close()
    decode.close()
    p_engine.close()
    d_engine.close()
    server.close()


def test_a_request_while_another_thread_sends(setup):
    server, prefill, decode, p_kv, d_kv = setup
    for layer, m in enumerate(p_kv):
        np.asarray(m)[:] = np.arange(m.nbytes, dtype=np.uint64).astype(np.uint8) + layer
    prefill.create_room(7)
    errors = []

    def prefill_side():
        try:
            assert prefill.wait_ready(7, timeout=120.0) == 0
            prefill.send_chunk(7, [4, 2], 2 * PAGE, last=True)
            assert prefill.wait(7, timeout=120.0) == kvbridge.KVPoll.Success
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    worker = threading.Thread(target=prefill_side)
    worker.start()
    decode.receive(7, server.addr, [5, 0])
    # Waits in Rust with the GIL released: the prefill thread runs meanwhile.
    assert decode.wait(7, timeout=120.0) == kvbridge.KVPoll.Success
    worker.join()
    assert errors == []
    assert decode.poll(7) == kvbridge.KVPoll.Success
    for src, dst in zip(p_kv, d_kv):
        s = np.asarray(src).reshape(PAGES, ITEM)
        d = np.asarray(dst).reshape(PAGES, ITEM)
        assert (d[5] == s[4]).all() and (d[0] == s[2]).all()
    assert decode.metrics()["rooms_succeeded"] == 1
    decode.clear(7)
    with pytest.raises(kvbridge.RoomError, match="not known"):
        decode.poll(7)


def test_transfer_time_counts_from_the_metadata_to_success(setup):
    """What the prefill does after the decode's metadata came is in it (here a 0.3 s wait
    before the send); it is only there once the room succeeded."""
    server, prefill, decode, p_kv, d_kv = setup
    prefill.create_room(8)
    started = time.monotonic()
    decode.receive(8, server.addr, [1])
    assert prefill.wait_ready(8, timeout=120.0) == 0
    assert decode.transfer_time(8) is None
    time.sleep(0.3)
    prefill.send_chunk(8, [3], PAGE, last=True)
    assert decode.wait(8, timeout=120.0) == kvbridge.KVPoll.Success
    took = decode.transfer_time(8)
    assert 0.3 <= took <= time.monotonic() - started, took
    decode.clear(8)
    assert prefill.wait(8, timeout=120.0) == kvbridge.KVPoll.Success
    with pytest.raises(kvbridge.RoomError, match="not known"):
        decode.poll(7)


def test_a_chunk_sent_layer_by_layer_lands_whole_and_only_its_final_part_concludes(setup):
    server, prefill, decode, p_kv, d_kv = setup
    for layer, m in enumerate(p_kv):
        np.asarray(m)[:] = (np.arange(m.nbytes, dtype=np.uint64) * 7).astype(np.uint8) + layer
    prefill.create_room(9)
    decode.receive(9, server.addr, [6, 1])
    assert prefill.wait_ready(9, timeout=120.0) == 0
    prefill.send_chunk(9, [3, 5], 2 * PAGE, last=True, layers=(0, 1))
    assert prefill.wait(9, timeout=0.2) == kvbridge.KVPoll.Transferring
    with pytest.raises(kvbridge.KvbridgeError, match="expects layers from 1"):
        prefill.send_chunk(9, [3, 5], 2 * PAGE, last=True, layers=(0, 1))
    prefill.send_chunk(9, [3, 5], 2 * PAGE, last=True, layers=(1, 2))
    assert decode.wait(9, timeout=120.0) == kvbridge.KVPoll.Success
    for src, dst in zip(p_kv, d_kv):
        s = np.asarray(src).reshape(PAGES, ITEM)
        d = np.asarray(dst).reshape(PAGES, ITEM)
        assert (d[6] == s[3]).all() and (d[1] == s[5]).all()


def test_wait_with_a_timeout_returns_the_current_state(setup):
    _, prefill, _, _, _ = setup
    prefill.create_room(1)
    assert prefill.wait(1, timeout=0.05) == kvbridge.KVPoll.Bootstrapping
    with pytest.raises(kvbridge.TimedOutError):
        prefill.wait_ready(1, timeout=0.05)
    with pytest.raises(kvbridge.RoomError, match="already exists"):
        prefill.create_room(1)
    with pytest.raises(kvbridge.RoomError):
        prefill.send_chunk(1, [0], PAGE)


def test_an_aborted_room_fails_with_kvtransfererror(setup):
    server, prefill, decode, _, _ = setup
    prefill.create_room(3)
    decode.receive(3, server.addr, [1])
    decode.abort(3)
    with pytest.raises(kvbridge.KVTransferError, match="bootstrap_room=3"):
        decode.wait(3, timeout=120.0)
    assert decode.poll(3) == kvbridge.KVPoll.Failed
    assert "bootstrap_room=3" in decode.failure(3)


def test_bad_agent_input_raises_typed_errors():
    e = kvbridge.Engine("loopback")
    m = e.allocate(PAGES * ITEM)
    with pytest.raises(kvbridge.InvalidArgumentError, match="descriptor"):
        kvbridge.DecodeAgent(e, {"role": "decode"}, [m, m])
    with pytest.raises(kvbridge.InvalidArgumentError, match="descriptor"):
        kvbridge.DecodeAgent(e, "{not json", [m, m])
    with pytest.raises(kvbridge.InvalidArgumentError, match="KV entries"):
        kvbridge.DecodeAgent(e, descriptor("decode"), [m])
    with pytest.raises(kvbridge.InvalidArgumentError, match="entry"):
        kvbridge.DecodeAgent(e, descriptor("decode"), ["layer 0", m])
    with pytest.raises(kvbridge.UnknownRegionError):
        kvbridge.DecodeAgent(e, descriptor("decode"), [12345, m])
    with pytest.raises(kvbridge.InvalidArgumentError, match="prefill"):
        kvbridge.PrefillAgent(e, descriptor("decode"), [m, m], bootstrap_addr="127.0.0.1:1")
    d = kvbridge.DecodeAgent(e, descriptor("decode"), [m, (m.region, 0, m.nbytes)])
    with pytest.raises(kvbridge.InvalidArgumentError, match="page ids"):
        d.receive(1, "127.0.0.1:1", [-1])
    d.close()
    e.close()


def test_a_missing_prefill_fails_the_room():
    e = kvbridge.Engine("loopback")
    kv = [e.allocate(PAGES * ITEM) for _ in range(LAYERS)]
    with kvbridge.DecodeAgent(e, descriptor("decode"), kv, bootstrap_timeout=1.0) as d:
        # Nothing listens on port 1 of 127.0.0.1: the handshake cannot complete.
        d.receive(9, "127.0.0.1:1", [0])
        with pytest.raises(kvbridge.KVTransferError, match="bootstrap_room=9"):
            d.wait(9, timeout=120.0)
    e.close()


def test_an_unreachable_bootstrap_server_raises_peer_lost():
    e = kvbridge.Engine("loopback")
    kv = [e.allocate(PAGES * ITEM) for _ in range(LAYERS)]
    with pytest.raises(kvbridge.PeerLostError, match="bootstrap"):
        kvbridge.PrefillAgent(e, descriptor("prefill"), kv, bootstrap_addr="127.0.0.1:1")
    e.close()


def test_a_secret_guards_the_bootstrap_registry_and_the_control_channel():
    secret = b"one secret for the deployment"
    with kvbridge.BootstrapServer(secret=secret) as server:
        p_engine, d_engine = kvbridge.Engine("loopback"), kvbridge.Engine("loopback")
        p_kv = [p_engine.allocate(PAGES * ITEM) for _ in range(LAYERS)]
        d_kv = [d_engine.allocate(PAGES * ITEM) for _ in range(LAYERS)]
        # Without the secret the registry refuses the registration, and says why.
        with pytest.raises(kvbridge.KvbridgeError, match="shared secret"):
            kvbridge.PrefillAgent(p_engine, descriptor("prefill"), p_kv, bootstrap_addr=server.addr)
        prefill = kvbridge.PrefillAgent(
            p_engine, descriptor("prefill"), p_kv, bootstrap_addr=server.addr, secret=secret
        )
        decode = kvbridge.DecodeAgent(d_engine, descriptor("decode"), d_kv, secret=secret)
        move_two_pages(prefill, decode, server, p_kv, d_kv, 5, [4, 2], [1, 3])
        # A decode without the secret cannot even look the prefill up.
        stranger = kvbridge.DecodeAgent(d_engine, descriptor("decode"), d_kv, bootstrap_timeout=2.0)
        stranger.receive(6, server.addr, [0])
        with pytest.raises(kvbridge.KVTransferError, match="shared secret"):
            stranger.wait(6, timeout=120.0)
        for a in (stranger, decode, prefill):
            a.close()
        p_engine.close()
        d_engine.close()


def test_bound_on_every_interface_the_advertised_addresses_are_named_and_used():
    # What two hosts need: each listener binds 0.0.0.0 and names the host's own address.
    with kvbridge.BootstrapServer("0.0.0.0", advertise="127.0.0.1") as server:
        assert server.addr.startswith("127.0.0.1:")
        p_engine = kvbridge.Engine("tcp", bind="0.0.0.0:0", advertise="127.0.0.1")
        d_engine = kvbridge.Engine("tcp", bind="0.0.0.0:0", advertise="127.0.0.1")
        p_kv = [p_engine.allocate(PAGES * ITEM) for _ in range(LAYERS)]
        d_kv = [d_engine.allocate(PAGES * ITEM) for _ in range(LAYERS)]
        prefill = kvbridge.PrefillAgent(
            p_engine,
            descriptor("prefill"),
            p_kv,
            bootstrap_addr=server.addr,
            bind="0.0.0.0:0",
            advertise="127.0.0.1",
        )
        decode = kvbridge.DecodeAgent(
            d_engine, descriptor("decode"), d_kv, bind="0.0.0.0:0", advertise="127.0.0.1"
        )
        assert "127.0.0.1:" in prefill.endpoint, prefill.endpoint
        # Control: bound on every interface without advertise, the unusable 0.0.0.0 is named.
        unnamed = kvbridge.DecodeAgent(d_engine, descriptor("decode"), d_kv, bind="0.0.0.0:0")
        assert "0.0.0.0:" in unnamed.endpoint, unnamed.endpoint
        unnamed.close()
        move_two_pages(prefill, decode, server, p_kv, d_kv, 4, [1, 3], [2, 6])
        for a in (decode, prefill, p_engine, d_engine):
            a.close()


def test_bad_addresses_say_what_is_expected():
    e = kvbridge.Engine("loopback")
    kv = [e.allocate(PAGES * ITEM) for _ in range(LAYERS)]
    with pytest.raises(kvbridge.InvalidArgumentError, match="ip:port"):
        kvbridge.DecodeAgent(e, descriptor("decode"), kv, bind="10.0.0.5")
    with pytest.raises(kvbridge.InvalidArgumentError, match="advertise must be"):
        kvbridge.DecodeAgent(e, descriptor("decode"), kv, advertise="0.0.0.0")
    with pytest.raises(kvbridge.InvalidArgumentError, match="advertise must be"):
        kvbridge.BootstrapServer("0.0.0.0", advertise="host-a")
    with pytest.raises(kvbridge.InvalidArgumentError, match="advertise"):
        kvbridge.Engine("loopback", advertise="127.0.0.1")
    e.close()


def test_send_when_ready_sends_from_the_decodes_prefix_once_it_asks(setup):
    """Handed over before the decode asks: the KV goes once its metadata comes, without the
    caller waiting, from the page that holds the decode's prefix on."""
    server, prefill, decode, p_kv, d_kv = setup
    for layer, m in enumerate(p_kv):
        np.asarray(m)[:] = (np.arange(m.nbytes, dtype=np.uint64) * 3 + layer).astype(np.uint8)
    prefill.create_room(9)
    prefill.send_when_ready(9, [6, 1, 3], 3 * PAGE, PAGE)
    assert prefill.poll(9) == kvbridge.KVPoll.Bootstrapping
    # The decode holds the first page already: pages 1 and 3 go to its pages 4 and 7.
    decode.receive(9, server.addr, [2, 4, 7], cached_prefix_len=PAGE)
    assert decode.wait(9, timeout=120.0) == kvbridge.KVPoll.Success
    assert prefill.wait(9, timeout=120.0) == kvbridge.KVPoll.Success
    for src, dst in zip(p_kv, d_kv):
        s = np.asarray(src).reshape(PAGES, ITEM)
        d = np.asarray(dst).reshape(PAGES, ITEM)
        assert (d[4] == s[1]).all() and (d[7] == s[3]).all()
        assert not d[2].any(), "the decode's prefix page was written"


def test_send_when_ready_refuses_a_table_too_short_for_its_tokens(setup):
    _, prefill, _, _, _ = setup
    prefill.create_room(10)
    with pytest.raises(kvbridge.InvalidArgumentError, match="2 pages of 16 tokens hold 32 tokens, fewer than num_kv_tokens 40"):
        prefill.send_when_ready(10, [1, 2], 40, PAGE)
    with pytest.raises(kvbridge.InvalidArgumentError, match="page_tokens is 0"):
        prefill.send_when_ready(10, [1, 2], 20, 0)
