"""The documented example: a prefill and a decode manager in two processes (docs/sglang.md)."""

import contextlib
import os
import queue
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import harness

pytestmark = pytest.mark.sglang


def test_one_request_between_two_processes_every_byte():
    _two_processes(dict(os.environ, SGLANG_HOST_IP="127.0.0.1"))


def test_one_request_between_two_processes_over_nixl():
    """The same pair with KVBRIDGE_SGLANG_TRANSPORT=nixl: host pools through NIXL's UCX
    between two processes (docs/sglang.md, "Pools on GPUs")."""
    _skip_without_nixl()
    _two_processes(dict(os.environ, SGLANG_HOST_IP="127.0.0.1", KVBRIDGE_SGLANG_TRANSPORT="nixl"))


def _skip_without_nixl():
    import kvbridge

    try:
        kvbridge.Engine("nixl").close()
    except kvbridge.KvbridgeError as e:
        pytest.skip(f"kvbridge.Engine('nixl') cannot start here: {e}")


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_one_request_across_a_real_link(transport):
    """The pair in two network namespaces joined by a veth pair (MTU 1500): each process
    listens on its own namespace's address (``SGLANG_HOST_IP``), the decode asks the prefill's
    bootstrap server across the link, and the prefill's engine connects to the address the
    decode's session id advertises (docs/sglang.md, "Two hosts"); NIXL with UCX over TCP."""
    if transport == "nixl":
        _skip_without_nixl()
    env = dict(os.environ, KVBRIDGE_SGLANG_TRANSPORT=transport, UCX_TLS="tcp")
    with _veth_pair() as ((ns_a, ip_a, _), (ns_b, ip_b, _)):
        _two_processes(
            dict(env, SGLANG_HOST_IP=ip_a),
            dict(env, SGLANG_HOST_IP=ip_b),
            prefill_in=["ip", "netns", "exec", ns_a],
            decode_in=["ip", "netns", "exec", ns_b],
            bootstrap_host=ip_a,
        )


LINK_PEER = os.path.join(os.path.dirname(__file__), "link_peer.py")


class _Peer:
    """A `link_peer.py` process: commands on its stdin, its answers read with a bound."""

    def __init__(self, argv, env):
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1,
        )
        self.lines: queue.Queue = queue.Queue()
        self.log: list = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        """The next line that starts with `prefix` (SGLang's log lines in between skipped)."""
        return self._next(lambda line: line.startswith(prefix), repr(prefix), timeout)

    def expect_text(self, text: str, timeout: float = 60.0) -> str:
        """The next line that contains `text` (a log line of SGLang's, say)."""
        return self._next(lambda line: text in line, repr(text), timeout)

    def _next(self, match, what: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"exited before saying {what}:\n{''.join(self.log[-40:])}")
            if match(line):
                return line
        raise AssertionError(f"no {what} after {timeout} s:\n{''.join(self.log[-40:])}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # by its pid (`ip netns exec` execs the program)
        self.proc.wait(timeout=30)


def _seconds(line: str) -> float:
    return float(line.split(" after ")[1].split(" s")[0])


# Fault tests: a 5 s write deadline and a heartbeat every 2 s that fails at its first miss.
FAULT_ENV = dict(
    KVBRIDGE_SGLANG_TRANSPORT="tcp", KVBRIDGE_SGLANG_TIMEOUT="5",
    SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="2", SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="1",
)


def _start(peers: list, role: str, port: int, host: str, prefix=(), env=None) -> _Peer:
    """Starts one `link_peer.py` side, appended to `peers` as it starts (the caller stops
    them); returns it once it says it is ready."""
    common = ["--port", str(port), "--bootstrap-host", host, "--timeout", "60"]
    peer = _Peer([*prefix, sys.executable, LINK_PEER, role, *common], env)
    peers.append(peer)
    peer.expect("ready")
    return peer


def _start_pair(peers: list, port: int, host: str, prefill_in=(), decode_in=(), prefill_env=None, decode_env=None):
    """Starts the prefill, then the decode (`_start`)."""
    return (
        _start(peers, "prefill", port, host, prefill_in, prefill_env),
        _start(peers, "decode", port, host, decode_in, decode_env),
    )


def _ask(prefill: _Peer, decode: _Peer, r: int) -> None:
    """The decode asks for room `r` and the prefill has its request."""
    prefill.send(f"serve {r}")
    decode.send(f"receive {r}")
    decode.expect(f"asked {r}")
    prefill.expect(f"waiting {r}")


def _room(prefill: _Peer, decode: _Peer, r: int) -> tuple:
    """Room `r` from request to both sides' answers."""
    _ask(prefill, decode, r)
    prefill.send(f"send {r}")
    return prefill.expect(f"room {r}:"), decode.expect(f"room {r}:")


@pytest.mark.parametrize("fault", ["blackhole", "carrier"])
def test_a_silent_link_fails_the_room_in_flight_by_its_deadline_and_the_link_heals(fault):
    """Prefill and decode managers in two namespaces; the link goes silent after the decode
    asked for a room and before the prefill sends it (`blackhole`: blackhole routes both ways;
    `carrier`: the prefill's veth end down, so the decode's loses its carrier): both sides fail
    that room within their deadlines (the prefill's write by KVBRIDGE_SGLANG_TIMEOUT, the
    decode by SGLang's heartbeat), with causes that name the other side; no byte lands in the
    failed room's pages after the link heals; the next room over the healed link succeeds with
    no process restarted."""
    env = dict(os.environ, **FAULT_ENV)
    with _veth_pair() as ((ns_a, ip_a, veth_a), (ns_b, ip_b, _)):
        port = harness.free_port()
        peers = []
        try:
            prefill, decode = _start_pair(
                peers, port, ip_a,
                prefill_in=["ip", "netns", "exec", ns_a], decode_in=["ip", "netns", "exec", ns_b],
                prefill_env=dict(env, SGLANG_HOST_IP=ip_a), decode_env=dict(env, SGLANG_HOST_IP=ip_b),
            )
            assert _room(prefill, decode, 1) == ("room 1: success", "room 1: verified")

            def silence(on: bool):
                if fault == "carrier":
                    commands = [["-n", ns_a, "link", "set", veth_a, "down" if on else "up"]]
                else:
                    op = "add" if on else "del"
                    commands = [["-n", ns, "route", op, "blackhole", f"{peer}/32"]
                                for ns, peer in ((ns_a, ip_b), (ns_b, ip_a))]
                for c in commands:
                    subprocess.run(["ip", *c], check=True, capture_output=True, timeout=10)

            _ask(prefill, decode, 2)
            silence(True)
            try:
                prefill.send("send 2")
                sent, got = prefill.expect("room 2:"), decode.expect("room 2:")
            finally:
                silence(False)
            print(f"{fault}: prefill {sent!r}; decode {got!r}")  # the fault table's row (-s)
            assert sent.startswith("room 2: failed"), sent
            assert ip_b in sent, f"the prefill's cause names no decode address: {sent}"
            assert _seconds(sent) < 5 + 10, sent  # the write's deadline, and its grace
            assert got.startswith("room 2: failed"), got
            assert f"Lost connection with prefill instance (bootstrap_addr: {ip_a}:{port})" in got, got
            assert _seconds(got) < 20, got  # a heartbeat every 2 s, one miss, each 2 + 3 s at most
            time.sleep(2.0)  # whatever was still in flight would land now
            decode.send("check 2")
            assert decode.expect("canary 2:") == "canary 2: intact"

            assert _room(prefill, decode, 3) == ("room 3: success", "room 3: verified")
        finally:
            for p in peers:
                p.stop()


def test_a_frozen_prefill_lands_no_byte_in_a_room_the_decode_failed():
    """The prefill process is frozen (SIGSTOP) after the decode asked for room 2, for longer
    than the decode's heartbeat allows: the decode fails the room. Resumed, the prefill sends
    room 2; none of its bytes may land in the pages the decode gave up (a canary), and the
    prefill's room must fail. Then room 3 goes through with no restart."""
    import signal

    env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1", **FAULT_ENV)
    peers = []
    try:
        prefill, decode = _start_pair(peers, harness.free_port(), "127.0.0.1", prefill_env=env, decode_env=env)
        _ask(prefill, decode, 2)
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        try:
            got = decode.expect("room 2:")
        finally:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        assert got.startswith("room 2: failed") and "Lost connection with prefill" in got, got
        prefill.send("send 2")
        sent = prefill.expect("room 2:")
        time.sleep(1.0)
        decode.send("check 2")
        assert decode.expect("canary 2:") == "canary 2: intact", f"the resumed prefill wrote the failed room: {sent}"
        assert sent.startswith("room 2: failed"), sent
        # The decode registers with the prefill again, under fresh ids: the next room works.
        assert _room(prefill, decode, 3) == ("room 3: success", "room 3: verified")
    finally:
        for p in peers:
            p.stop()


def test_a_prefill_restarted_at_the_same_address_serves_the_decode_that_saw_it_die():
    """Prefill and decode managers in two namespaces; after room 1 the prefill process is
    killed, the decode's heartbeat notices, and a new prefill starts at the same address and
    port: room 2 goes through, every byte verified, with the decode never restarted (it asks
    the new bootstrap server and registers with the new prefill by itself)."""
    env = dict(os.environ, **FAULT_ENV)
    with _veth_pair() as ((ns_a, ip_a, _), (ns_b, ip_b, _)):
        port = harness.free_port()
        peers = []
        prefill_in = ["ip", "netns", "exec", ns_a]
        prefill_env = dict(env, SGLANG_HOST_IP=ip_a)
        try:
            prefill, decode = _start_pair(
                peers, port, ip_a, prefill_in=prefill_in, decode_in=["ip", "netns", "exec", ns_b],
                prefill_env=prefill_env, decode_env=dict(env, SGLANG_HOST_IP=ip_b),
            )
            assert _room(prefill, decode, 1) == ("room 1: success", "room 1: verified")
            prefill.stop()
            # SGLang's heartbeat: one miss (2 s apart, each at most 2 + 3 s) marks it down.
            decode.expect_text(f"Lost connection with prefill instance (bootstrap_addr: {ip_a}:{port})", 20)
            prefill = _start(peers, "prefill", port, ip_a, prefill_in, prefill_env)
            assert _room(prefill, decode, 2) == ("room 2: success", "room 2: verified")
        finally:
            for p in peers:
                p.stop()


@contextlib.contextmanager
def _veth_pair():
    """Two network namespaces joined by a veth pair on 10.213.2.0/24, as (namespace, address,
    veth end) per side, both removed on exit; skips, saying why, where namespaces cannot be made (not root, no iproute2)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = f"kvs{os.getpid() % 100000}"
    sides = [(f"{tag}a", f"{tag}va", "10.213.2.1"), (f"{tag}b", f"{tag}vb", "10.213.2.2")]

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)

    made = []
    try:
        try:
            for ns, _, _ in sides:
                ip("netns", "add", ns)
                made.append(ns)
            (a, va, _), (b, vb, _) = sides
            ip("link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b)
            for ns, dev, addr in sides:
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot make network namespaces here: {' '.join(e.cmd)}: {e.stderr.strip()}")
        yield [(ns, addr, dev) for ns, dev, addr in sides]
    finally:
        for ns in made:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _two_processes(env, decode_env=None, prefill_in=(), decode_in=(), bootstrap_host="127.0.0.1"):
    port = harness.free_port()
    cmd = [sys.executable, "-m", "kvbridge_sglang.example"]
    common = ["--port", str(port), "--timeout", str(harness.DEADLINE_S), "--bootstrap-host", bootstrap_host]
    prefill = subprocess.Popen(
        [*prefill_in, *cmd, "prefill", *common], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        decode = subprocess.run(
            [*decode_in, *cmd, "decode", *common], env=decode_env or env, capture_output=True, text=True,
            timeout=2 * harness.DEADLINE_S,
        )
        out, _ = prefill.communicate(timeout=2 * harness.DEADLINE_S)
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()
    assert decode.returncode == 0, decode.stdout + decode.stderr
    assert "decode: room 1: every byte verified" in decode.stdout
    assert prefill.returncode == 0, out
    assert "prefill: room 1: 5 pages of 4 layers sent" in out


def test_a_dead_prefill_fails_the_decodes_room_by_the_deadline():
    """The prefill process is killed while the decode waits: SGLang's heartbeat notices and
    the room fails (not a hang)."""
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvbridge_sglang.example import classes

    port = harness.free_port()
    env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1")
    prefill = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_sglang.example", "prefill", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        args = harness.publish("decode", port)
        cls = classes()
        pool = harness.Pool(2, 4, 16 * 64)
        manager = cls["MANAGER"](pool.kv_args(16), DisaggregationMode.DECODE, args, True)
        addr = f"127.0.0.1:{port}"
        harness.wait_for(lambda: manager.try_ensure_parallel_info(addr), "the prefill's parallel info")
        # A room the prefill never sends: only its death can end it.
        receiver = cls["RECEIVER"](manager, addr, 99)
        receiver.init(0)
        receiver.send_metadata(np.asarray([1, 2], dtype=np.int32), aux_index=0)
        assert receiver.poll() != KVPoll.Failed
    finally:
        prefill.kill()
        prefill.wait()
    assert harness.poll_until(receiver, {KVPoll.Failed}, "the decode's room") == KVPoll.Failed
    with pytest.raises(KVTransferError):
        receiver.failure_exception()
    assert not any(b.any() for b in pool.kv)


def test_prefill_dcp2_to_decode_dcp4_between_two_processes_every_byte():
    """A prefill of DCP 2 (two ranks) in a child process, a decode of DCP 4 (four ranks) here:
    every decode rank reads from the prefill rank owning its rows, every byte checked."""
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_parallel

    from kvbridge_sglang.example import classes

    a, b, room = 2, 4, 7
    port = harness.free_port()
    env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1")
    script = os.path.join(os.path.dirname(__file__), "reshard_prefill.py")
    prefill = subprocess.Popen(
        [sys.executable, script, str(port), str(a), str(b), str(room)], env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        args = harness.publish("decode", port)
        cls = classes()
        sent, want = harness.reshard_pools(a, b)  # what the child fills, from the same seed
        _, d_pages = harness.reshard_pages(a, b)
        pools = [harness.Pool(2, 10, harness.RESHARD_P * harness.RESHARD_TB) for _ in range(b)]
        receivers = []
        addr = f"127.0.0.1:{port}"
        for r in range(b):
            get_parallel().override_permanently(**harness.ranks(tp=b, rank=r, dcp=b))
            kv_args = pools[r].kv_args(harness.RESHARD_P, engine_rank=r)
            manager = cls["MANAGER"](kv_args, DisaggregationMode.DECODE, args, True)
            harness.wait_for(lambda: manager.try_ensure_parallel_info(addr), "the prefill's parallel info")
            assert manager.prefill_info_table[addr].target_tp_ranks == [r % a]  # the owner rule
            receiver = cls["RECEIVER"](manager, addr, room)
            receiver.init(0)
            receivers.append(receiver)
        get_parallel().override_permanently(**harness.ranks(tp=1, rank=0, dcp=1))
        for receiver in receivers:
            receiver.send_metadata(np.asarray(d_pages, dtype=np.int32), aux_index=3)
        for r, receiver in enumerate(receivers):
            assert harness.poll_until(receiver, {KVPoll.Success}, f"decode rank {r}") == KVPoll.Success
        out, _ = prefill.communicate(input="", timeout=2 * harness.DEADLINE_S)
        assert prefill.returncode == 0 and "prefill: sent" in out, out
        for r in range(b):
            for layer, (w, got) in enumerate(zip(want[r], pools[r].kv)):
                assert np.array_equal(got, w), f"decode rank {r} layer {layer}"
            assert np.array_equal(pools[r].aux[3], sent[0].aux[1])
    finally:
        get_parallel().override_permanently(**harness.ranks(tp=1, rank=0, dcp=1))
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()
