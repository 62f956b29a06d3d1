"""kvbridge.Engine in one process (loopback and real transports): data, typed errors for bad
input, the GIL released while Rust waits, and use from several threads."""

import threading

import numpy as np
import pytest

import kvbridge


@pytest.fixture
def pair():
    """Two loopback engines; `a` is connected to `b`."""
    a, b = kvbridge.Engine("loopback"), kvbridge.Engine("loopback")
    yield a, b, a.connect(b.local_descriptor())
    a.close()
    b.close()


def ops(*rows):
    return np.array(rows, dtype=np.uint64)


def test_write_moves_the_bytes_and_notifies(pair):
    a, b, peer = pair
    src = np.arange(1 << 16, dtype=np.uint32)
    region = a.register_buffer(src)
    dst = b.allocate(src.nbytes)
    t = a.write(peer, ops((region, 0, dst.region, 0, src.nbytes)), notification=b"room 1")
    assert t.wait(timeout=60.0) is True
    assert t.poll() == "done"
    assert t.wait(timeout=60.0) is True  # the final state is kept
    assert (np.asarray(dst).view(np.uint32) == src).all()
    assert b.notifications(timeout=60.0) == [(1, b"room 1")]
    assert b.notifications() == []


def test_register_takes_a_pointer_and_keeps_the_owner(pair):
    a, b, peer = pair
    src = np.full(4096, 7, dtype=np.uint8)
    region = a.register(src.ctypes.data, src.nbytes, owner=src)
    dst = b.allocate(4096)
    assert a.write(peer, ops((region, 0, dst.region, 0, 4096))).wait(timeout=60.0)
    assert (np.asarray(dst) == 7).all()
    a.deregister(region)
    with pytest.raises(kvbridge.UnknownRegionError):
        a.write(peer, ops((region, 0, dst.region, 0, 1)))


def test_zero_ops_and_zero_lengths_complete(pair):
    a, b, peer = pair
    dst = b.allocate(64)
    src = a.allocate(64)
    assert a.write(peer, np.zeros((0, 5), dtype=np.uint64)).wait(timeout=60.0)
    assert a.write(peer, ops((src.region, 64, dst.region, 64, 0))).wait(timeout=60.0)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((1, 5), dtype=np.int64),
        np.zeros((1, 5), dtype=np.float64),
        np.zeros((1, 5), dtype=">u8"),
        np.zeros((1, 4), dtype=np.uint64),
        np.zeros(5, dtype=np.uint64),
        [[1, 0, 1, 0, 8]],
        "ops",
    ],
    ids=["int64", "float64", "big-endian", "4-columns", "1-d", "list", "str"],
)
def test_bad_ops_raise_invalid_argument(pair, bad):
    a, _, peer = pair
    with pytest.raises(kvbridge.InvalidArgumentError, match="uint64"):
        a.write(peer, bad)


def test_out_of_bounds_and_unknown_regions_are_refused_before_any_byte(pair):
    a, b, peer = pair
    src = a.allocate(4096)
    dst = b.allocate(4096)
    np.asarray(src)[:] = 1
    with pytest.raises(kvbridge.OutOfBoundsError, match="4096 bytes"):
        a.write(peer, ops((src.region, 0, dst.region, 1, 4096)), timeout=5.0).wait(timeout=60.0)
    with pytest.raises(kvbridge.OutOfBoundsError):
        a.write(peer, ops((src.region, 2**64 - 1, dst.region, 0, 2)))
    with pytest.raises(kvbridge.UnknownRegionError):
        a.write(peer, ops((999, 0, dst.region, 0, 1)))
    assert (np.asarray(dst) == 0).all()


@pytest.mark.parametrize(
    ("ptr", "length", "match"),
    [
        (0x1000, -1, "negative"),
        (-4096, 16, "negative"),
        (0, 16, "NULL"),
        (2**64 - 8, 16, "overflows"),
        (2**64, 16, "2\\*\\*64"),
        (0x1000, 2**63, "isize"),
        ("0x1000", 16, "int"),
    ],
)
def test_bad_pointer_ranges_raise(pair, ptr, length, match):
    a, _, _ = pair
    with pytest.raises(kvbridge.InvalidArgumentError, match=match):
        a.register(ptr, length)


def test_bad_buffers_raise(pair):
    a, _, _ = pair
    with pytest.raises(kvbridge.InvalidArgumentError, match="read-only"):
        a.register_buffer(b"immutable")
    with pytest.raises(kvbridge.InvalidArgumentError, match="C-contiguous"):
        a.register_buffer(np.zeros((8, 8))[:, ::2])
    with pytest.raises(kvbridge.InvalidArgumentError, match="buffer protocol"):
        a.register_buffer(object())
    arr = np.zeros(64, dtype=np.uint8)
    a.register_buffer(arr)
    with pytest.raises(kvbridge.InvalidArgumentError, match="overlap"):
        a.register_buffer(arr[8:])


def test_a_registered_bytearray_cannot_be_resized(pair):
    a, _, _ = pair
    buf = bytearray(64)
    a.register_buffer(buf)
    with pytest.raises(BufferError):
        buf.extend(b"x" * 4096)


def test_device_memory_is_refused_by_host_only_transports(pair):
    a, _, _ = pair
    with pytest.raises(kvbridge.UnsupportedError, match="device memory"):
        a.register(0x7F0000000000, 4096, kind="cuda", device=0)
    with pytest.raises(kvbridge.InvalidArgumentError, match="kind"):
        a.register(0x7F0000000000, 4096, kind="tpu")


def test_transport_names_and_options():
    try:
        kvbridge.Engine("nixl").close()  # a build with the `nixl` feature and its runtime
    except kvbridge.UnsupportedError as e:
        assert "not built with NIXL" in str(e) and "--features nixl" in str(e)
    except kvbridge.KvbridgeError as e:
        assert "NIXL runtime" in str(e)  # built with NIXL, but its runtime is not set up
    with pytest.raises(kvbridge.InvalidArgumentError, match="unknown transport"):
        kvbridge.Engine("carrier-pigeon")
    with pytest.raises(kvbridge.InvalidArgumentError, match="tcp"):
        kvbridge.Engine("loopback", bind="127.0.0.1:0")
    with pytest.raises(kvbridge.InvalidArgumentError, match="ip:port"):
        kvbridge.Engine("tcp", bind="localhost")
    with kvbridge.Engine("tcp", bind="127.0.0.1:0", secret=b"s3cret") as e:
        assert e.transport == "tcp"
        assert e.capabilities["cross_process"] is True
        assert e.local_descriptor().startswith(b"kvbridge-tcp/")


def test_bad_descriptors_and_foreign_peers(pair):
    a, b, _ = pair
    with pytest.raises(kvbridge.BadDescriptorError):
        a.connect(b"not a descriptor")
    other = kvbridge.Engine("loopback")
    stranger = other.connect(b.local_descriptor())
    with pytest.raises(kvbridge.InvalidArgumentError, match="another engine"):
        a.write(stranger, np.zeros((0, 5), dtype=np.uint64))
    other.close()


def test_bad_timeouts_raise(pair):
    a, _, peer = pair
    with pytest.raises(kvbridge.InvalidArgumentError, match="seconds"):
        a.write(peer, np.zeros((0, 5), dtype=np.uint64), timeout=-1.0)
    with pytest.raises(kvbridge.InvalidArgumentError, match="seconds"):
        a.notifications(timeout=float("nan"))


def test_a_closed_engine_raises_closed(pair):
    a, b, peer = pair
    a.close()
    a.close()
    assert a.closed
    for call in (
        lambda: a.allocate(16),
        lambda: a.connect(b.local_descriptor()),
        lambda: a.write(peer, np.zeros((0, 5), dtype=np.uint64)),
        lambda: a.register_buffer(bytearray(8)),
    ):
        with pytest.raises(kvbridge.ClosedError):
            call()


def test_the_context_manager_closes():
    with kvbridge.Engine("loopback") as e:
        assert not e.closed
    assert e.closed


def test_cancel_returns_a_final_state(pair):
    a, b, peer = pair
    src = a.allocate(1 << 20)
    dst = b.allocate(1 << 20)
    t = a.write(peer, ops((src.region, 0, dst.region, 0, 1 << 20)))
    assert t.cancel() in ("cancelled", "done")
    assert t.poll() in ("cancelled", "done")
    if t.poll() == "cancelled":
        with pytest.raises(kvbridge.CancelledError):
            t.wait(timeout=60.0)


def test_the_gil_is_released_while_waiting(pair):
    """The main thread waits in Rust for a notification that only another Python thread can
    cause: if the wait held the GIL, that thread could not run and the wait would end empty."""
    a, b, peer = pair
    src = a.allocate(64)
    dst = b.allocate(64)
    started = threading.Event()
    ticks = []

    def other():
        started.wait()
        for i in range(1000):  # pure-Python work: needs the GIL
            ticks.append(i)
        a.write(peer, ops((src.region, 0, dst.region, 0, 64)), notification=b"from the thread")

    worker = threading.Thread(target=other)
    worker.start()
    started.set()
    got = b.notifications(timeout=120.0)
    worker.join()
    assert got == [(1, b"from the thread")]
    assert len(ticks) == 1000


def test_many_threads_share_one_engine(pair):
    a, b, peer = pair
    n, size = 8, 1 << 16
    src = np.random.default_rng(5).integers(0, 256, size=n * size, dtype=np.uint8)
    region = a.register_buffer(src)
    dst = b.allocate(n * size)
    errors = []

    def send(i):
        try:
            for _ in range(10):
                t = a.write(peer, ops((region, i * size, dst.region, i * size, size)))
                assert t.wait(timeout=60.0)
                assert t.poll() == "done"
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert (np.asarray(dst) == src).all()


def test_two_threads_wait_on_one_transfer(pair):
    a, b, peer = pair
    src = a.allocate(1 << 20)
    dst = b.allocate(1 << 20)
    t = a.write(peer, ops((src.region, 0, dst.region, 0, 1 << 20)))
    results = []
    threads = [threading.Thread(target=lambda: results.append(t.wait(timeout=60.0))) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == [True] * 4


def test_the_stubs_declare_every_class_and_method():
    """Each engine, agent and error class of the native module is in `_native.pyi`, with
    every public method it has."""
    import ast
    import pathlib

    import kvbridge._native as native

    stub = pathlib.Path(kvbridge.__file__).with_name("_native.pyi")
    tree = ast.parse(stub.read_text())
    declared = {
        node.name: {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }
    ours = [
        "Engine", "Memory", "Peer", "Transfer", "BootstrapServer", "PrefillAgent",
        "DecodeAgent", "KVPoll",
    ] + [name for name in dir(native) if name.endswith("Error")]
    for name in ours:
        assert name in declared, f"{name} is missing from _native.pyi"
        cls = getattr(native, name)
        if isinstance(cls, type) and not issubclass(cls, (BaseException, int)):
            public = {m for m in vars(cls) if not m.startswith("_")}
            assert public <= declared[name], f"{name}: {public - declared[name]} not in the stub"


def test_strided_ops_copy_rows_and_refuse_bad_strides(pair):
    a, b, peer = pair
    src = np.arange(16 * 64, dtype=np.uint8).reshape(16, 64)
    region = a.register_buffer(src)
    dst = b.allocate(8 * 64)
    # Every other row of the source, packed: 8 rows of 64 bytes.
    t = a.write(peer, ops((region, 0, dst.region, 0, 64, 8, 128, 64)))
    assert t.wait(timeout=60.0)
    assert t.nbytes == 8 * 64
    assert (np.asarray(dst).reshape(8, 64) == src[::2]).all()
    with pytest.raises(kvbridge.InvalidArgumentError, match="overlap"):
        a.write(peer, np.array([(region, 0, dst.region, 0, 64, 2, 64, 32)], dtype=np.uint64))
    with pytest.raises(kvbridge.OutOfBoundsError):
        a.write(peer, np.array([(region, 0, dst.region, 0, 64, 9, 64, 64)], dtype=np.uint64))
    with pytest.raises(kvbridge.OutOfBoundsError):
        a.write(peer, np.array([(region, 0, dst.region, 0, 64, 2, 2**63, 64)], dtype=np.uint64))


def _use_the_inherited_engine(engine, queue):
    try:
        engine.allocate(64)
        queue.put("no error")
    except kvbridge.UnsupportedError as e:
        queue.put(str(e))


def test_a_forked_child_is_refused_not_hung():
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with kvbridge.Engine("loopback") as engine:
        engine.allocate(64)  # the runtime runs in this process
        queue = ctx.Queue()
        child = ctx.Process(target=_use_the_inherited_engine, args=(engine, queue))
        child.start()
        message = queue.get(timeout=120)
        child.join(timeout=120)
    assert "forked" in message and "spawn" in message, message


def test_read_pulls_and_tcp_refuses_it(pair):
    a, b, peer = pair
    remote = b.allocate(256)
    np.asarray(remote)[:] = np.arange(256, dtype=np.uint8)
    local = a.allocate(256)
    assert a.read(peer, ops((local.region, 0, remote.region, 0, 256))).wait(timeout=60.0)
    assert (np.asarray(local) == np.arange(256, dtype=np.uint8)).all()
    with kvbridge.Engine("tcp") as x, kvbridge.Engine("tcp") as y:
        src, dst = x.allocate(64), y.allocate(64)
        p = x.connect(y.local_descriptor())
        with pytest.raises(kvbridge.UnsupportedError, match="read"):
            x.read(p, ops((src.region, 0, dst.region, 0, 64))).wait(timeout=60.0)


def test_concurrent_registrations_of_the_same_bytes_admit_one():
    """Threads registering the same buffer at once: exactly one wins, the others are refused
    (two regions over the same bytes would bypass each other's claims)."""
    with kvbridge.Engine("loopback") as engine:
        for _ in range(20):
            arr = np.zeros(4096, dtype=np.uint8)
            barrier = threading.Barrier(8)
            won, refused = [], []

            def race():
                barrier.wait()
                try:
                    won.append(engine.register_buffer(arr))
                except kvbridge.InvalidArgumentError:
                    refused.append(1)

            threads = [threading.Thread(target=race) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert (len(won), len(refused)) == (1, 7)
            engine.deregister(won[0])


def test_probe_and_disconnect(pair):
    a, b, peer = pair
    a.probe(peer, timeout=60.0)
    a.disconnect(peer)
    with pytest.raises(kvbridge.UnknownPeerError):
        a.write(peer, np.zeros((0, 5), dtype=np.uint64))
    with pytest.raises(kvbridge.InvalidArgumentError, match="seconds"):
        a.probe(peer, timeout=-1.0)


@pytest.mark.parametrize("transport", ["loopback", "tcp"])
def test_an_alias_is_the_same_memory_and_deregistering_it_fences_only_its_holders(transport):
    a, b = kvbridge.Engine(transport), kvbridge.Engine(transport)
    peer = a.connect(b.local_descriptor())
    src = a.allocate(4096)
    np.asarray(src)[:] = 9
    dst = b.allocate(4096)
    alias = b.alias(dst.region)
    assert alias != dst.region
    # A write through the alias lands in the same bytes.
    assert a.write(peer, ops((src.region, 0, alias, 0, 2048))).wait(timeout=60.0)
    assert (np.asarray(dst)[:2048] == 9).all() and (np.asarray(dst)[2048:] == 0).all()
    b.deregister(alias)
    # Refused before a byte moves, at post or at completion; the original id still works.
    np.asarray(src)[:] = 5
    with pytest.raises(kvbridge.KvbridgeError):
        a.write(peer, ops((src.region, 0, alias, 2048, 2048))).wait(timeout=60.0)
    assert (np.asarray(dst)[2048:] == 0).all()
    assert a.write(peer, ops((src.region, 0, dst.region, 2048, 2048))).wait(timeout=60.0)
    assert (np.asarray(dst)[2048:] == 5).all()
    with pytest.raises(kvbridge.InvalidArgumentError, match="not registered"):
        b.alias(alias)
    # The bytes stay registered while any id of them does: a new registration over them is refused.
    with pytest.raises(kvbridge.InvalidArgumentError, match="overlap"):
        b.register(np.asarray(dst).ctypes.data, 64)
    a.close()
    b.close()
