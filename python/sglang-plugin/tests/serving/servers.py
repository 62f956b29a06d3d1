"""Real SGLang 0.5.23 servers on this CPU (``python -m sglang.launch_server``), and the router.

Each server runs in a process group of its own, its output in a log file; start-up waits are
bounded and a server that does not come up raises an error naming its log and quoting its
tail; ``stop`` ends the group by its id (SIGTERM, a bounded wait, then SIGKILL). ``Router``
does what SGLang's router does for a prefill + decode pair: it posts the same request, with
``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``, to both servers at once.

The CPU recipe (docs/sglang.md, "Serving a model"): ``SGLANG_USE_CPU_ENGINE=1``, ``--device
cpu --attention-backend torch_native --disable-overlap-schedule``, a small static memory
fraction and token budget, ``--disaggregation-decode-retraction-backup none`` on a decode, and
``site/`` on ``PYTHONPATH`` (the ``sgl_kernel`` stand-in and the tests' entry point). That
directory is test infrastructure; the plugin needs none of it.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.join(HERE, "site")

# Bounded waits. Generous: each server starts in 60-90 s on a quiet 2-core machine, and the
# tests start several at once.
START_S = float(os.environ.get("KVBRIDGE_SERVING_START_S", "420"))
REQUEST_S = float(os.environ.get("KVBRIDGE_SERVING_REQUEST_S", "180"))
STOP_S = 30.0

# What `python -m sglang.launch_server` imports beyond SGLang's 81 pins
# (tests/serving/requirements-serving.txt), plus the backend itself.
_MODULES = ("sglang", "fastapi", "uvicorn", "uvloop", "xgrammar", "kvbridge", "kvbridge_sglang")


def unavailable() -> Optional[str]:
    """Why real servers cannot run here, or None."""
    missing = [m for m in _MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return (
            f"SGLang serving is not installed ({', '.join(missing)} missing): install "
            "python/sglang-plugin/requirements-sglang-0.5.23-cpu.txt (--no-deps), then "
            "tests/serving/requirements-serving.txt (docs/sglang.md, \"Serving a model\")"
        )
    return None


def _ports():
    """Ports below the kernel's ephemeral range, from a random start: a port picked by binding
    port 0 comes from that range, which the servers' own sockets (and kvbridge's agents) draw
    from too, so it could be taken before the server that was given it binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1024, low - 12000)
    span = low - first
    start = random.Random(os.getpid() ^ time.time_ns()).randrange(span)
    for i in itertools.count():
        yield first + (start + i) % span


_free_ports = _ports()


def free_port() -> int:
    """A port no socket holds now, below the ephemeral range; each call gives another."""
    for _ in range(4096):
        port = next(_free_ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port below the ephemeral range")


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(could not read {path}: {e})"


def _http(method: str, url: str, payload=None, timeout: float = REQUEST_S):
    """(status, parsed JSON body or text); connection errors raise ``OSError``."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode(errors="replace")
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


class Server:
    """One ``python -m sglang.launch_server`` (mode ``single``, ``prefill`` or ``decode``)."""

    def __init__(
        self,
        name: str,
        model: str,
        log_dir: str,
        mode: str = "single",
        backend: str = "kvbridge",
        args: tuple = (),
        env: Optional[dict] = None,
    ):
        self.name, self.model, self.mode, self.backend = name, model, mode, backend
        self.port = free_port()
        self.bootstrap_port = free_port() if mode == "prefill" else None
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.url = f"http://127.0.0.1:{self.port}"
        self.shm_files: set = set()
        self.cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--device", "cpu", "--attention-backend", "torch_native",
            "--disable-overlap-schedule",
            # On CPU SGLang sizes the pool from the machine's free memory and refuses to start
            # if that shrank by more than this fraction while it loaded the weights: servers
            # starting side by side take memory from one another, hence more than the 0.05 a
            # lone server needs. --max-total-tokens bounds the pool itself.
            "--mem-fraction-static", "0.3",
            "--max-total-tokens", "4096",
            "--page-size", "16",
            "--random-seed", "0",
            "--skip-server-warmup",
        ]
        if mode != "single":
            self.cmd += [
                "--disaggregation-mode", mode,
                "--disaggregation-transfer-backend", backend,
            ]
        if mode == "prefill":
            self.cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if mode == "decode":
            # The default backup builds a HiCache host pool, which calls torch.cuda.cudart().
            self.cmd += ["--disaggregation-decode-retraction-backup", "none"]
        self.cmd += list(args)
        self.env = dict(os.environ)
        self.env.update(
            SGLANG_USE_CPU_ENGINE="1",
            SGLANG_HOST_IP="127.0.0.1",
            PYTHONPATH=os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p),
        )
        self.env.update(env or {})
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "Server":
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        log = open(self.log_path, "w")
        log.write("$ " + " ".join(self.cmd) + "\n")
        log.flush()
        try:
            # A process group of its own: stop() ends SGLang's schedulers and detokenizer too.
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        finally:
            log.close()
        return self

    def wait_ready(self, deadline_s: float = START_S) -> "Server":
        """Polls ``/health`` (200 once the server is up) until the deadline; raises with the
        log's path and tail if the process exits or the deadline passes."""
        end = time.monotonic() + deadline_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"SGLang server {self.name} exited with {code} before it came up; log "
                    f"{self.log_path}, last lines:\n{_tail(self.log_path)}"
                )
            try:
                status, _ = _http("GET", self.url + "/health", timeout=5)
                if status == 200:
                    return self
            except OSError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(
                    f"SGLang server {self.name} did not answer /health with 200 within "
                    f"{deadline_s:.0f} s (KVBRIDGE_SERVING_START_S); log {self.log_path}, last "
                    f"lines:\n{_tail(self.log_path)}"
                )
            time.sleep(1.0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def note_shm(self) -> None:
        """Records which files under /dev/shm the server's processes have open or mapped now,
        to remove those SGLang leaves behind once the server is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.shm_files |= _shm_files_of_group(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM to the server's process group, a bounded wait, then SIGKILL; then removes the
        files SGLang left under /dev/shm (its `sglang_*` load tables and multiprocessing's
        `sem.mp-*` semaphores) that the group had open."""
        if self.proc is None:
            return
        self.note_shm()
        try:
            self._stop_group()
        finally:
            if not _group_alive(self.proc.pid):
                _remove_left_shm(self.shm_files)

    def _stop_group(self) -> None:
        pgid = self.proc.pid  # start_new_session: the group's id is the leader's pid
        for sig, wait_s in ((signal.SIGTERM, STOP_S), (signal.SIGKILL, STOP_S)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; its children may not be: the group gets the same signal
            # until nothing of it is left (bounded).
            end = time.monotonic() + wait_s
            while time.monotonic() < end and _group_alive(pgid):
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        self.proc.wait(timeout=STOP_S)

    def generate(self, payload: dict, timeout: float = REQUEST_S) -> dict:
        status, body = _http("POST", self.url + "/generate", payload, timeout)
        if status != 200:
            raise RequestError(self.name, status, body)
        return body

    def abort(self, rid: str) -> None:
        _http("POST", self.url + "/abort_request", {"rid": rid}, timeout=30)

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)


# What SGLang's processes leave under /dev/shm when they are ended by a signal.
LEFT_SHM_PREFIXES = ("sglang_", "sem.mp-")


def _shm_files_of_group(pgid: int) -> set:
    """The inodes of the /dev/shm files that the processes of group `pgid` have open or
    mapped. Inodes, not names: glibc's `sem_open` maps a temporary file and then links it
    under the semaphore's name, so a process's maps show the temporary name."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                # Field 5 is the process group; the command (field 2) may hold spaces.
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.split(None, 5)  # address perms offset dev inode path
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        found.add(int(fields[4]))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                    found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except (OSError, ValueError, IndexError):
            continue  # the process ended meanwhile, or is not ours to read
    return found


def left_shm() -> set:
    """The names under /dev/shm that look like SGLang's leftovers."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(LEFT_SHM_PREFIXES)}


def _remove_left_shm(inodes: set) -> None:
    """Removes the files under /dev/shm named as SGLang's leftovers whose inode is one of
    `inodes` (files the server's processes had open)."""
    for name in os.listdir("/dev/shm"):
        if not name.startswith(LEFT_SHM_PREFIXES):
            continue
        path = os.path.join("/dev/shm", name)
        try:
            if os.stat(path).st_ino in inodes:
                os.unlink(path)
        except FileNotFoundError:
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class RequestError(Exception):
    def __init__(self, server: str, status: int, body, endpoint: str = "/generate"):
        super().__init__(f"{server}: {endpoint} answered HTTP {status}: {body}")
        self.status, self.body = status, body


def start_all(servers: list) -> list:
    """Starts every server at once, then waits for each; on any failure stops them all."""
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: list) -> None:
    # Every group gets SIGTERM first, so that they shut down side by side; then each is
    # waited for (and killed if need be) by stop().
    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            s.note_shm()
            try:
                os.killpg(s.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    errors = []
    for s in servers:
        try:
            s.stop()
        except Exception as e:  # keep stopping the others
            errors.append(f"{s.name}: {e}")
    if errors:
        raise RuntimeError("could not stop every server: " + "; ".join(errors))


def sampling(max_new_tokens: int) -> dict:
    # Greedy, and no early stop: the tiny models' output is compared token for token.
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


def output_ids(body: dict) -> list:
    return list(body["output_ids"])


_rooms = itertools.count(int(time.time()) % 1_000_000 * 1000 + 1)


def next_room() -> int:
    return next(_rooms)


class Router:
    """SGLang's router for one prefill and one decode: the same request to both at once."""

    def __init__(self, prefill: Server, decode: Server):
        self.prefill, self.decode = prefill, decode
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)

    def payload(self, input_ids: list, max_new_tokens: int, room: int, rid: Optional[str] = None) -> dict:
        p = {
            "input_ids": list(input_ids),
            "sampling_params": sampling(max_new_tokens),
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.prefill.bootstrap_port,
            "bootstrap_room": room,
        }
        if rid is not None:
            p["rid"] = rid
        return p

    def submit(self, input_ids: list, max_new_tokens: int = 16, room: Optional[int] = None, rid: Optional[str] = None):
        """Posts to both servers; returns (prefill future, decode future) of their bodies."""
        payload = self.payload(input_ids, max_new_tokens, next_room() if room is None else room, rid)
        return (
            self._pool.submit(self.prefill.generate, dict(payload)),
            self._pool.submit(self.decode.generate, dict(payload)),
        )

    def generate(self, input_ids: list, max_new_tokens: int = 16, room: Optional[int] = None) -> list:
        """The decode's output ids of one request (the prefill's answer checked too)."""
        pf, df = self.submit(input_ids, max_new_tokens, room)
        decoded = df.result(timeout=REQUEST_S + 10)
        pf.result(timeout=REQUEST_S + 10)
        return output_ids(decoded)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
