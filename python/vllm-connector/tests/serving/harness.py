"""Real vLLM servers on this CPU (``python -m vllm.entrypoints.openai.api_server``) with
KvbridgeConnector, the package's proxy, and tiny seeded models.

The process handling (a process group per server, its output in a log, bounded start-up
waits that raise with the log's tail, stop by the group's id) and the tiny models are the
SGLang backend's test harness (``python/sglang-plugin/tests/serving``), loaded by path; this
module builds vLLM's command lines on it. vLLM's CPU recipe: docs/vllm.md, "Serving on a CPU".
``site/`` goes on the servers' ``PYTHONPATH`` (the damaged-KV control, the AMX request): test
infrastructure, the connector needs none of it.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.join(HERE, "site")
SGLANG_SERVING = os.path.join(HERE, "..", "..", "..", "sglang-plugin", "tests", "serving")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"kvbridge_vllm_harness_{name}", os.path.join(SGLANG_SERVING, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


procs = _load("servers")
tiny = _load("tiny_models")

# vLLM's CPU attention refuses head size 16 (the SGLang tests' Llama); 32 works.
HEAD_DIM = 32
MAX_MODEL_LEN = 512
# Chunked prefill in steps of this many tokens: a longer prompt is prefilled in several steps.
CHUNK = 256
CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    # kvbridge's own warnings (a transport handshake refused, and why) in the server's log.
    "KVBRIDGE_LOG": "warn",
}

# A decode at TP 2 on a two-CPU host spins while a request waits for its KV (vLLM's engine steps
# without pause, and its shared-memory readers call sched_yield for a second after each read):
# other processes, its prefill's among them, then got no CPU for 13 to 65 s at a time, and a
# room failed as its prefill "did not answer 2 consecutive heartbeats" (docs/vllm.md,
# "Liveness"). The TP 2 tests' servers allow a pause that long wherever one side waits for the
# other: a silent peer, a batch, a control message, the bootstrap answer.
PAUSED_PEERS = {"peer_timeout": 120.0, "transfer_timeout": 120.0, "control_timeout": 60.0, "bootstrap_timeout": 120.0}


def unavailable():
    missing = [m for m in ("vllm", "kvbridge", "kvbridge_vllm", "aiohttp", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return f"vLLM serving is not installed ({', '.join(missing)} missing): docs/vllm.md, \"Install\""
    return None


class VllmServer(procs.Server):
    """One vLLM OpenAI server: ``role`` None (a single server), ``kv_producer`` (a prefill)
    or ``kv_consumer`` (a decode), with KvbridgeConnector over ``transport``."""

    def __init__(self, name: str, model: str, log_dir: str, role=None, transport: str = "tcp", extra=None, cli=()):
        self.name, self.model, self.mode, self.backend = name, model, role or "single", "kvbridge"
        self.port = procs.free_port()
        self.bootstrap_port = procs.free_port() if role == "kv_producer" else None
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.url = f"http://127.0.0.1:{self.port}"
        self.shm_files = set()
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--enforce-eager", "--seed", "0",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4",
            "--max-num-batched-tokens", str(CHUNK),
            # When each request arrived and reached the engine, for a slow or failed one.
            "--enable-log-requests", *cli,
        ]
        if role is not None:
            config = {"transport": transport, **(extra or {})}
            if self.bootstrap_port is not None:
                config["bootstrap_port"] = self.bootstrap_port
            self.cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KvbridgeConnector",
                "kv_connector_module_path": "kvbridge_vllm.connector",
                "kv_role": role,
                "kv_connector_extra_config": config,
            })]
        self.env = dict(os.environ)
        self.env.update(CPU_ENV)
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)
        self.proc = None

    def complete(self, prompt: list, max_tokens: int, timeout: float = procs.REQUEST_S, **extra) -> dict:
        return post(self.url, prompt, max_tokens, timeout, **extra)

    def metric(self, name: str, **labels) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def post(url: str, prompt: list, max_tokens: int, timeout: float = procs.REQUEST_S, **extra) -> dict:
    payload = {"prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
               "return_token_ids": True, **extra}
    status, body = procs._http("POST", url + "/v1/completions", payload, timeout)
    if status != 200:
        raise procs.RequestError(url, status, body, "/v1/completions")
    return body


def serving_log_dir(sub: str = "") -> str:
    """Where the servers' logs go: ``KVBRIDGE_VLLM_SERVING_LOG_DIR`` (``.ci/run`` sets it) or a
    new temporary folder, plus ``sub`` for a test module's own servers."""
    root = os.environ.get("KVBRIDGE_VLLM_SERVING_LOG_DIR") or tempfile.mkdtemp(prefix="kvbridge-vllm-logs-")
    path = os.path.join(root, sub)
    os.makedirs(path, exist_ok=True)
    return path


def transferred(decode: VllmServer) -> float:
    """vLLM's own count of the decode's prompt tokens that came from a KV transfer."""
    return decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def assert_loaded(decode: VllmServer, before: float, length: int) -> None:
    """Every one of a request's ``length`` prompt tokens came over kvbridge (vLLM counts a
    request's tokens as it processes its outputs, which may trail the response a little)."""
    end = time.monotonic() + 10
    while transferred(decode) - before < length and time.monotonic() < end:
        time.sleep(0.2)
    assert transferred(decode) - before == length


def output_ids(body: dict) -> list:
    return list(body["choices"][0]["token_ids"])


def concurrent_request(prefill: VllmServer, decode: VllmServer, prompt: list, room: int, max_tokens: int, **field) -> list:
    """One request of the concurrent flow sent by hand: the decode first, the prefill once the
    decode's log says it is loading the room (so its metadata is there before the prefill's
    first layer is computed); ``field`` goes into the prefill's ``kvbridge`` field. Returns the
    decode's token ids."""
    from kvbridge_vllm.params import concurrent_params

    to_prefill, to_decode = concurrent_params(room, f"127.0.0.1:{prefill.bootstrap_port}")
    to_prefill["kvbridge"].update(field)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        decoded = pool.submit(decode.complete, prompt, max_tokens, kv_transfer_params=to_decode)
        end = time.monotonic() + 30
        while f"of room {room} from" not in decode.log_tail(200):
            if time.monotonic() > end:
                raise RuntimeError(f"the decode did not start loading room {room}: {decode.log_path}")
            time.sleep(0.05)
        prefill.complete(prompt, 1, kv_transfer_params=to_prefill)
        return output_ids(decoded.result(timeout=procs.REQUEST_S))


class Proxy:
    """``python -m kvbridge_vllm.proxy`` in a process group of its own."""

    def __init__(self, prefill: VllmServer, decode: VllmServer, log_dir: str, name: str = "proxy", sequential: bool = False):
        self.servers = (prefill, decode)
        self.port = procs.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.cmd = [sys.executable, "-m", "kvbridge_vllm.proxy", "--prefill", prefill.url, "--decode", decode.url,
                    "--prefill-bootstrap", f"127.0.0.1:{prefill.bootstrap_port}", "--port", str(self.port)]
        if sequential:
            self.cmd.append("--sequential")
        self.proc = None

    def start(self) -> "Proxy":
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the proxy exited with {self.proc.returncode}; log {self.log_path}:\n{procs._tail(self.log_path)}")
            try:
                if procs._http("GET", self.url + "/health", timeout=5)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the proxy did not come up within 60 s; log {self.log_path}:\n{procs._tail(self.log_path)}")

    def complete(self, prompt: list, max_tokens: int, timeout: float = procs.REQUEST_S, **extra) -> dict:
        """The decode's answer; a failed request raises with the three logs' tails (what
        kvbridge and vLLM said of it), for CI's output."""
        try:
            return post(self.url, prompt, max_tokens, timeout, **extra)
        except procs.RequestError as e:
            e.args = (f"{e}{self._tails()}",)
            raise
        except OSError as e:
            raise RuntimeError(f"{self.url}/v1/completions: {e}{self._tails()}") from e

    def _tails(self) -> str:
        return "".join(
            f"\n--- {log} (last lines) ---\n{procs._tail(log, 60)}"
            for log in (self.log_path, *(s.log_path for s in self.servers))
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            procs.Server._stop_group(self)
