"""Time to first token of a long prompt through real SGLang servers: a prefill + decode pair
with ``--disaggregation-transfer-backend kvbridge`` and one with SGLang's ``mooncake`` backend
(Mooncake's TCP transport: ``MC_FORCE_TCP=1``), in the same run, plus a single server for
reference (no transfer at all).

    python tests/serving/ttft.py [--tokens 2048] [--rounds 15] [--model llama]

Each round posts a fresh prompt (so no prefix cache helps) to every setup in turn, the order
rotating from round to round; the time to first token is from posting the request (to both
servers of a pair, as the router does) to the first streamed token of the decode (or of the
single server). One warm-up request per setup first. Prints the median and minimum per setup
and the pair figures side by side. Needs the serving packages (requirements-serving.txt) and,
for Mooncake, ``pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1`` and
``libibverbs1`` (apt); without Mooncake the script says why and measures the others.

Mooncake on CPU: SGLang's ``MooncakeKVSender`` sends its prefill down a pinned-memory + CUDA
event path (``supports_host_tensor_indices = True``) that cannot run without a GPU; the tests'
entry point (site/kvbridge_serving_tests.py, ``KVBRIDGE_SERVING_MOONCAKE_HOST_INDICES=0``)
turns it off for these servers. That is test infrastructure: it changes nothing of what moves
the KV.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import servers  # noqa: E402
import tiny_models  # noqa: E402


def _mooncake_missing():
    import importlib.util

    if importlib.util.find_spec("mooncake") is None:
        return "mooncake is not installed (pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1)"
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as e:  # e.g. libibverbs.so.1 missing
        return f"mooncake cannot be imported ({e}); apt-get install libibverbs1"
    return None


def _first_token_s(url: str, payload: dict, start: float, timeout: float) -> float:
    """Seconds from ``start`` to the first streamed chunk carrying an output token; reads the
    stream to its end (the request must finish)."""
    body = json.dumps({**payload, "stream": True}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    first = None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk}")
            if first is None and chunk.get("output_ids"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{url}: the stream ended without a token")
    return first


class Setup:
    def __init__(self, name: str, single=None, prefill=None, decode=None):
        self.name, self.single, self.prefill, self.decode = name, single, prefill, decode
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)

    def servers(self) -> list:
        return [s for s in (self.single, self.prefill, self.decode) if s is not None]

    def ttft(self, ids: list, new_tokens: int) -> float:
        sampling = servers.sampling(new_tokens)
        if self.single is not None:
            return _first_token_s(self.single.url, {"input_ids": ids, "sampling_params": sampling}, time.perf_counter(), servers.REQUEST_S)
        payload = servers.Router(self.prefill, self.decode).payload(ids, new_tokens, servers.next_room())
        start = time.perf_counter()
        pf = self.pool.submit(self.prefill.generate, dict(payload))
        t = _first_token_s(self.decode.url, payload, start, servers.REQUEST_S)
        pf.result(timeout=servers.REQUEST_S)
        return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    ap.add_argument("--new-tokens", type=int, default=4, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=15, help="timed requests per setup (default 15)")
    ap.add_argument("--model", default="llama", choices=tiny_models.MODELS)
    ap.add_argument("--log-dir", help="server logs (default: a temporary directory)")
    args = ap.parse_args(argv)
    why = servers.unavailable()
    if why:
        print(why, file=sys.stderr)
        return 2
    if args.tokens + args.new_tokens > tiny_models.MAX_POSITIONS:
        ap.error(f"--tokens + --new-tokens must fit the model's {tiny_models.MAX_POSITIONS} positions")

    work = tempfile.mkdtemp(prefix="kvbridge-ttft-")
    log_dir = args.log_dir or os.path.join(work, "logs")
    path = tiny_models.make(args.model, work)
    # Room for one long request at a time on every server (prompt + output, in pages).
    budget = ("--max-total-tokens", str(max(4096, 2 * (args.tokens + args.new_tokens))))
    setups = [Setup("single", single=servers.Server("single", path, log_dir, args=budget))]
    for backend in ("kvbridge", "mooncake"):
        if backend == "mooncake" and (missing := _mooncake_missing()):
            print(f"mooncake: skipped: {missing}")
            continue
        env = {"MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp", "KVBRIDGE_SERVING_MOONCAKE_HOST_INDICES": "0"} if backend == "mooncake" else {}
        setups.append(Setup(
            backend,
            prefill=servers.Server(f"{backend}-prefill", path, log_dir, "prefill", backend, budget, env),
            decode=servers.Server(f"{backend}-decode", path, log_dir, "decode", backend, budget, env),
        ))
    every = [s for setup in setups for s in setup.servers()]
    print(f"starting {len(every)} servers (logs in {log_dir}) ...", flush=True)
    servers.start_all(every)
    try:
        rng = random.Random(args.tokens)
        prompt = lambda: [rng.randrange(3, 380) for _ in range(args.tokens)]  # noqa: E731
        for setup in setups:
            setup.ttft(prompt(), args.new_tokens)  # warm-up
        times = {s.name: [] for s in setups}
        load = [os.getloadavg()[0]]
        for r in range(args.rounds):
            order = setups[r % len(setups):] + setups[: r % len(setups)]
            for setup in order:
                times[setup.name].append(setup.ttft(prompt(), args.new_tokens))
        load.append(os.getloadavg()[0])
    finally:
        for setup in setups:
            setup.pool.shutdown(wait=False)
        servers.stop_all(every)

    print(f"\ntime to first token, {args.model}, {args.tokens}-token prompt, {args.rounds} rounds "
          f"(fresh prompt each), page 16, SGLang 0.5.23 on CPU, TCP on 127.0.0.1; "
          f"load average {load[0]:.1f} before, {load[1]:.1f} after, {os.cpu_count()} CPUs")
    print(f"{'setup':<28} {'median':>10} {'min':>10}")
    label = {"single": "single server (no transfer)", "kvbridge": "prefill+decode, kvbridge", "mooncake": "prefill+decode, mooncake"}
    for name, ts in times.items():
        print(f"{label[name]:<28} {statistics.median(ts) * 1e3:>8.0f} ms {min(ts) * 1e3:>7.0f} ms")
    if "kvbridge" in times and "mooncake" in times:
        ratio = statistics.median(times["mooncake"]) / statistics.median(times["kvbridge"])
        print(f"mooncake / kvbridge (medians): {ratio:.2f}")
    print("raw (ms): " + json.dumps({k: [round(t * 1e3) for t in v] for k, v in times.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
