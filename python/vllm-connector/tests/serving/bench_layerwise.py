"""The concurrent flow's transfer tail, layer by layer against after the forward pass.

    target/vllm-venv/bin/python python/vllm-connector/tests/serving/bench_layerwise.py [--prompts 5]

Starts a prefill and a decode (vLLM on CPU, KvbridgeConnector over TCP) on a seeded tiny Llama
sized so its KV is measurable (24 layers, 4 KV heads of 128: 48 KiB a token), then sends the
same kind of prompt alternately with ``layerwise`` on and off, each request of the concurrent
flow with the decode's metadata in place before the prefill starts. The tail of a request is
from the prefill's last layer computed (its log: ``prompt KV computed t=``) to the decode's
KV complete (its log: ``KV complete t=``); both servers run on this host, so the two clocks
are one. Prints one line per request and the medians; every server is ended by its id.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import VllmServer, concurrent_request, procs, tiny  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 24, 4, 128
MODEL_LEN = 2048


def _set(cmd: list, flag: str, value) -> None:
    cmd[cmd.index(flag) + 1] = str(value)


def _stamp(server: VllmServer, pattern: str) -> float:
    with open(server.log_path, errors="replace") as f:
        found = re.findall(pattern, f.read())
    if not found:
        raise RuntimeError(f"no {pattern!r} in {server.log_path}")
    return float(found[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=5, help="requests per mode (alternated)")
    p.add_argument("--tokens", type=int, default=1536, help="prompt length (one forward pass)")
    args = p.parse_args(argv)
    rng = random.Random("bench-layerwise")
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-") as work:
        path = tiny.make("llama", work, head_dim=HEAD_DIM, layers=LAYERS, kv_heads=KV_HEADS)
        servers = [VllmServer("prefill", path, work, role="kv_producer"), VllmServer("decode", path, work, role="kv_consumer")]
        for s in servers:
            s.cmd.remove("--enable-log-requests")  # each prompt in the log: not what is measured
            _set(s.cmd, "--max-model-len", MODEL_LEN)
            _set(s.cmd, "--max-num-batched-tokens", MODEL_LEN)
        prefill, decode = procs.start_all(servers)
        tails: dict = {True: [], False: []}
        try:
            for i in range(2 * args.prompts + 1):
                layerwise = i % 2 == 1  # the first request only warms both servers up
                room = rng.randrange(2**60)
                prompt = [rng.randrange(5, 300) for _ in range(args.tokens)]
                concurrent_request(prefill, decode, prompt, room, 2, layerwise=layerwise)
                computed = _stamp(prefill, rf"room {room}: prompt KV computed t=(\S+)")
                complete = _stamp(decode, rf"room {room}: KV complete t=(\S+)")
                if i == 0:
                    continue
                tails[layerwise].append(complete - computed)
                print(f"room {room}: layerwise={layerwise!s:5} tail {1e3 * (complete - computed):8.2f} ms", flush=True)
        finally:
            procs.stop_all(servers)
    kv_mb = args.tokens * LAYERS * KV_HEADS * HEAD_DIM * 2 * 2 / 1e6
    on, off = statistics.median(tails[True]), statistics.median(tails[False])
    print(f"{args.tokens} tokens, {kv_mb:.1f} MB of KV a request, {args.prompts} requests each, alternated:")
    print(f"  tail, layer by layer:        median {1e3 * on:8.2f} ms")
    print(f"  tail, after the forward pass: median {1e3 * off:8.2f} ms")
    print(f"  ratio: {on / off:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
