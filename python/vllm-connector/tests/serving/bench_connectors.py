"""kvbridge's connector against vLLM's own NixlConnector: the same model, prompts and machine,
requests alternated.

    target/vllm-venv/bin/python python/vllm-connector/tests/serving/bench_connectors.py [--prompts 5]

Needs vLLM's NIXL beside the set-up (``pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1``).
Starts a kvbridge pair (TCP) and a NixlConnector pair (``kv_buffer_device: cpu``, UCX on this
host), vLLM 0.32 on CPU, on a seeded tiny Llama sized for a measurable KV (24 layers, 4 KV
heads of 128: 48 KiB a token), and sends each pair the same kind of prompt in vLLM's sequential
flow (the prefill with one token, then the decode with the prefill's ``kv_transfer_params``),
plus kvbridge's concurrent flow. Per request:

- TTFT: from the request to the prefill (concurrent: to both) to the decode's answer of one
  token, as a client sees it.
- Transfer GB/s: KV bytes over transfer time. NixlConnector's by vLLM's own metrics on its
  decode (``vllm:nixl_bytes_transferred`` over ``vllm:nixl_xfer_time_seconds``: from the READ
  posted to it done). kvbridge's by its decode agent (``DecodeAgent.transfer_time``, in the
  decode's log): from the room's metadata sent to the prefill to the prefill's Success, which
  also holds a control message each way and the prefill's wait for its next step to post, with
  the bytes the prompt's tokens hold (NIXL counts whole blocks): both lean towards NIXL. The
  wider window, from the load asked (before the room is even resolved on the prefill) to the KV
  complete, is printed beside it. In the concurrent flow the decode asks before the prefill
  computes, so only its TTFT is shown (its transfer tail: ``bench_layerwise.py``).

Every server is ended by its id; the first request of each pair only warms it up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import VllmServer, concurrent_request, procs, serving_log_dir, tiny  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 24, 4, 128
TOKEN_BYTES = LAYERS * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
MODEL_LEN = 2048


def _set(cmd: list, flag: str, value) -> None:
    cmd[cmd.index(flag) + 1] = str(value)


def _servers(path: str, work: str) -> list:
    kb_p = VllmServer("kvbridge-prefill", path, work, role="kv_producer")
    kb_d = VllmServer("kvbridge-decode", path, work, role="kv_consumer")
    nx_p = VllmServer("nixl-prefill", path, work)
    nx_d = VllmServer("nixl-decode", path, work)
    for s in (nx_p, nx_d):
        s.cmd += ["--kv-transfer-config", json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})]
        s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(procs.free_port())
        s.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    servers = [kb_p, kb_d, nx_p, nx_d]
    for s in servers:
        s.cmd.remove("--enable-log-requests")  # each prompt in the log: not what is measured
        _set(s.cmd, "--max-model-len", MODEL_LEN)
        _set(s.cmd, "--max-num-batched-tokens", MODEL_LEN)
    return servers


def _sequential(prefill: VllmServer, decode: VllmServer, prompt: list) -> float:
    started = time.monotonic()
    answer = prefill.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    decode.complete(prompt, 1, kv_transfer_params=answer["kv_transfer_params"])
    return time.monotonic() - started


def _kvbridge_transfer(decode: VllmServer, room: int) -> tuple:
    """(metadata to Success, load asked to KV complete) in seconds, from the decode's log."""
    with open(decode.log_path, errors="replace") as f:
        log = f.read()
    asked = re.findall(rf"of room {room} from \S+ t=(\S+)", log)
    done = re.findall(rf"room {room}: KV complete t=(\S+) \(\d+ blocks, (\S+) ms from its metadata", log)
    if not asked or not done:
        raise RuntimeError(f"room {room} has no load and completion in {decode.log_path}")
    return float(done[-1][1]) / 1e3, float(done[-1][0]) - float(asked[-1])


def _nixl_totals(decode: VllmServer) -> tuple:
    return decode.metric("vllm:nixl_bytes_transferred_sum"), decode.metric("vllm:nixl_xfer_time_seconds_sum")


def _one(name: str, servers: list, prompt: list, rng: random.Random) -> tuple:
    """(TTFT, bytes moved, transfer seconds, the wider window) of one request of a row."""
    kb_p, kb_d, nx_p, nx_d = servers
    if name == "NixlConnector sequential":
        before = _nixl_totals(nx_d)
        ttft = _sequential(nx_p, nx_d, prompt)
        time.sleep(1.5)  # vLLM publishes connector stats with its periodic log
        after = _nixl_totals(nx_d)
        return ttft, after[0] - before[0], after[1] - before[1], None
    started = time.monotonic()
    if name == "kvbridge concurrent":
        room = rng.randrange(2**60)
        concurrent_request(kb_p, kb_d, prompt, room, 1)
    else:
        answer = kb_p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
        room = answer["kv_transfer_params"]["kvbridge"]["room"]
        kb_d.complete(prompt, 1, kv_transfer_params=answer["kv_transfer_params"])
    ttft = time.monotonic() - started
    took, wide = _kvbridge_transfer(kb_d, room)
    return ttft, len(prompt) * TOKEN_BYTES, took, wide


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=5, help="requests per row (alternated)")
    p.add_argument("--tokens", type=int, default=1536, help="prompt length")
    args = p.parse_args(argv)
    rng = random.Random("bench-connectors")
    rows: dict = {"kvbridge sequential": [], "kvbridge concurrent": [], "NixlConnector sequential": []}
    failed: dict = {name: 0 for name in rows}
    logs = serving_log_dir("bench-connectors")
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-") as work:
        path = tiny.make("llama", work, head_dim=HEAD_DIM, layers=LAYERS, kv_heads=KV_HEADS)
        servers = procs.start_all(_servers(path, logs))
        try:
            for i in range(args.prompts + 1):
                for name in rows:
                    prompt = [rng.randrange(5, 300) for _ in range(args.tokens)]
                    try:
                        ttft, moved, took, wide = _one(name, servers, prompt, rng)
                    except procs.RequestError as e:  # counted and shown, the run goes on
                        failed[name] += 1
                        print(f"{name:26} FAILED: {e}", flush=True)
                        continue
                    if i == 0:
                        continue
                    gbps = moved / took / 1e9 if took > 0 else float("nan")
                    rows[name].append((ttft, gbps))
                    transfer = "" if name == "kvbridge concurrent" else (
                        f"  transfer {moved / 1e6:6.1f} MB in {1e3 * took:7.1f} ms = {gbps:6.2f} GB/s"
                        + (f" (asked to complete: {1e3 * wide:7.1f} ms)" if wide is not None else "")
                    )
                    print(f"{name:26} TTFT {1e3 * ttft:8.1f} ms{transfer}", flush=True)
        finally:
            procs.stop_all(servers)
    print(f"{args.tokens} tokens ({args.tokens * TOKEN_BYTES / 1e6:.1f} MB of KV) a request, {args.prompts} requests a row, alternated; medians:")
    for name, values in rows.items():
        if not values:
            print(f"  {name:26} no request succeeded ({failed[name]} failed)")
            continue
        transfer = "" if name == "kvbridge concurrent" else f"   transfer {statistics.median(v[1] for v in values):6.2f} GB/s"
        failures = f"   ({failed[name]} failed)" if failed[name] else ""
        print(f"  {name:26} TTFT {1e3 * statistics.median(v[0] for v in values):8.1f} ms{transfer}{failures}")
    if rows["kvbridge sequential"] and rows["NixlConnector sequential"]:
        kb = statistics.median(v[1] for v in rows["kvbridge sequential"])
        nx = statistics.median(v[1] for v in rows["NixlConnector sequential"])
        print(f"  kvbridge / NixlConnector transfer GB/s: {kb / nx:.2f}x")
    print(f"servers' logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
