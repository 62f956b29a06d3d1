"""The same request through SGLang's transfer backends, in the same run (docs/sglang.md,
"Benchmark").

    python -m kvbridge_sglang.bench                       # kvbridge and mooncake, TCP on loopback
    python -m kvbridge_sglang.bench --backends kvbridge --tokens 256 --requests 2

For each backend, one prefill process (SGLang's bootstrap server and prefill manager) and one
decode process (a decode manager) move ``--requests`` requests of ``--tokens`` tokens of an
MLA pool (``--layers`` buffers, ``--token-bytes`` per token, pages of ``--page-size``) through
SGLang 0.5.23's own classes, as ``get_kv_class`` returns them: ``kvbridge`` (this plugin,
``KVBRIDGE_SGLANG_TRANSPORT=tcp``) and ``mooncake`` (SGLang's Mooncake backend with
``MC_FORCE_TCP=1``, Mooncake's TCP transport). Every byte of every request is checked on the
decode. Reported per backend: the prefill's time from ``send`` to ``Success`` (all KV and the
aux row written, the decode told), the decode's from ``send_metadata`` to ``Success`` (the
whole request as the decode sees it), and the throughput of the first (KV bytes / time). The
pools are numpy arrays: no GPU and no model.

``mooncake`` needs ``pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`` (and
libibverbs, which its engine links against); where it cannot be imported it is skipped with
the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from kvbridge_sglang.example import Pool, classes, publish

BACKENDS = ("kvbridge", "mooncake")
MOONCAKE_PIN = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# Seconds each step may take (the machine may be loaded: nothing here is an assertion).
STEP_TIMEOUT = 300.0


def backend_env(backend: str, batch_pages: int) -> dict:
    """The environment of one backend's two processes: every socket on loopback, TCP, and the
    same SGLang settings for both backends."""
    env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1")
    # Pages per engine call in SGLang's page path. Mooncake's TCP transport refuses a batch of
    # more than a few thousand slices ("TCP lane queue-full"), one per page and layer, so the
    # request goes in batches (0: one batch).
    env["SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"] = str(batch_pages)
    if backend == "mooncake":
        env.update(MC_FORCE_TCP="1", MOONCAKE_PROTOCOL="tcp")
    else:
        env["KVBRIDGE_SGLANG_TRANSPORT"] = "tcp"
    return env


def unavailable(backend: str):
    """Why ``backend`` cannot run here, or ``None``."""
    if backend != "mooncake":
        return None
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        return f"mooncake cannot be imported ({e}); pip install {MOONCAKE_PIN}"
    return None


def _pages(args) -> tuple:
    """The request's prefill and decode page ids: two different permutations, so every page
    lands somewhere else than where it came from."""
    n = -(-args.tokens // args.page_size)
    rng = np.random.default_rng(3)
    return rng.permutation(n + 1)[:n].astype(np.int32), rng.permutation(n + 1)[:n].astype(np.int32), n + 1


def _manager(args, mode: str, pool: Pool, server_args):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if args.backend == "mooncake":
        # What SGLang's scheduler does for --disaggregation-transfer-backend mooncake.
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    cls = classes(args.backend)
    mode_enum = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    return cls, cls["MANAGER"](pool.kv_args(args.page_size), mode_enum, server_args, True)


def _pool(args, pages: int) -> Pool:
    return Pool(args.layers, pages, args.page_size * args.token_bytes, aux_rows=2)


def run_prefill(args) -> dict:
    src, _, pages = _pages(args)
    pool = _pool(args, pages).fill(11)
    server_args = publish("prefill", args.port, backend=args.backend)
    server = classes(args.backend)["BOOTSTRAP_SERVER"]("127.0.0.1", args.port)
    cls, manager = _manager(args, "prefill", pool, server_args)
    rooms = range(1, args.warmup + args.requests + 1)
    # Every sender first: a decode's request may arrive before its room's turn.
    senders = {room: cls["SENDER"](manager, f"127.0.0.1:{args.port}", room) for room in rooms}
    times = []
    for room in rooms:
        sender = senders[room]
        sender.init(len(src), aux_index=0)
        _spin(sender, _poll().WaitingForInput, f"prefill: room {room}'s request")
        start = time.perf_counter()
        sender.send(src, num_kv_tokens=args.tokens)
        _spin(sender, _poll().Success, f"prefill: room {room}")
        times.append(time.perf_counter() - start)
    sys.stdin.read()  # the decode has read every status: the parent closes stdin
    server.close()
    return {"send_to_success_s": times[args.warmup :]}


def run_decode(args) -> dict:
    src, dst, pages = _pages(args)
    pool = _pool(args, pages)
    want = _pool(args, pages).fill(11)
    cls, manager = _manager(args, "decode", pool, publish("decode", args.port, backend=args.backend))
    addr = f"127.0.0.1:{args.port}"
    end = time.monotonic() + STEP_TIMEOUT
    while not manager.try_ensure_parallel_info(addr):
        if time.monotonic() > end:
            raise TimeoutError(f"decode: no prefill registered at {addr} after {STEP_TIMEOUT} s")
        time.sleep(0.05)
    times = []
    for room in range(1, args.warmup + args.requests + 1):
        for buf in pool.kv:
            buf[dst] = 0
        pool.aux[1] = 0
        receiver = cls["RECEIVER"](manager, addr, room)
        receiver.init(0)
        start = time.perf_counter()
        receiver.send_metadata(dst, aux_index=1)
        _spin(receiver, _poll().Success, f"decode: room {room}")
        times.append(time.perf_counter() - start)
        for layer, (got, sent) in enumerate(zip(pool.kv, want.kv)):
            if not np.array_equal(got[dst], sent[src]):
                raise SystemExit(f"decode: room {room}: layer {layer} differs from what was sent")
        if not np.array_equal(pool.aux[1], want.aux[0]):
            raise SystemExit(f"decode: room {room}: the aux row differs from what was sent")
    return {"metadata_to_success_s": times[args.warmup :], "verified": True}


def _poll():
    from sglang.srt.disaggregation.base import KVPoll

    return KVPoll


def _spin(obj, want, what: str) -> None:
    """Polls until ``want`` (0.2 ms apart, so a timed step ends within that of its state);
    raises SGLang's KVTransferError on Failed."""
    end = time.monotonic() + STEP_TIMEOUT
    while True:
        state = obj.poll()
        if state == want:
            return
        if state == _poll().Failed:
            obj.failure_exception()
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: still {_poll()(state).name} after {STEP_TIMEOUT} s")
        time.sleep(0.0002)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_args(args, backend: str, port: int) -> list:
    return [
        "--backend", backend, "--port", str(port), "--tokens", str(args.tokens),
        "--layers", str(args.layers), "--page-size", str(args.page_size),
        "--token-bytes", str(args.token_bytes), "--requests", str(args.requests),
        "--warmup", str(args.warmup),
    ]


def _last_json(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no result in the child's output:\n{text[-4000:]}")


def bench_backend(args, backend: str) -> dict:
    """One backend's prefill and decode processes; their figures."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kvbridge_sglang.bench"]
    env = backend_env(backend, args.batch_pages)
    child = _child_args(args, backend, port)
    prefill = subprocess.Popen(
        cmd + ["_prefill"] + child, env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        decode = subprocess.run(
            cmd + ["_decode"] + child, env=env, capture_output=True, text=True,
            timeout=4 * STEP_TIMEOUT,
        )
        if decode.returncode != 0:
            prefill.kill()
        p_out, p_err = prefill.communicate(input="", timeout=STEP_TIMEOUT)
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()
    if decode.returncode != 0:
        raise RuntimeError(
            f"{backend}: the decode failed:\n{decode.stderr[-3000:]}\nthe prefill's output:\n{p_err[-3000:]}"
        )
    if prefill.returncode != 0:
        raise RuntimeError(f"{backend}: the prefill failed:\n{p_err[-4000:]}")
    result = {**_last_json(p_out), **_last_json(decode.stdout)}
    kv_bytes = args.tokens * args.token_bytes * args.layers
    send = result["send_to_success_s"]
    result.update(
        backend=backend,
        kv_bytes=kv_bytes,
        prefill_p50_ms=1e3 * statistics.median(send),
        decode_p50_ms=1e3 * statistics.median(result["metadata_to_success_s"]),
        gib_per_s=kv_bytes / statistics.median(send) / 2**30,
    )
    return result


def report(results: list, skipped: dict, args) -> str:
    size = args.tokens * args.token_bytes * args.layers
    lines = [
        f"one request: {args.tokens} tokens x {args.layers} layers x {args.token_bytes} B "
        f"= {size / 2**20:.1f} MiB, pages of {args.page_size}; {args.requests} requests "
        f"after {args.warmup} warm-up; {args.batch_pages or 'all'} pages per engine call; TCP on 127.0.0.1",
        f"{'backend':<10} {'send->Success p50':>18} {'min':>9} {'GiB/s':>7} {'decode p50':>11}",
    ]
    for r in results:
        lines.append(
            f"{r['backend']:<10} {r['prefill_p50_ms']:>15.1f} ms {1e3 * min(r['send_to_success_s']):>6.1f} ms "
            f"{r['gib_per_s']:>7.2f} {r['decode_p50_ms']:>8.1f} ms"
        )
    for backend, why in skipped.items():
        lines.append(f"{backend:<10} skipped: {why}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge_sglang.bench", description=__doc__.split("\n")[0])
    parser.add_argument("role", nargs="?", default="run", choices=["run", "_prefill", "_decode"], help=argparse.SUPPRESS)
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--backend", default="kvbridge", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the request (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=61, help="KV buffers, one per layer (default: %(default)s)")
    parser.add_argument("--token-bytes", type=int, default=1152, help="bytes per token per layer (default: %(default)s, MLA 576 x bf16)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page (default: %(default)s)")
    parser.add_argument("--batch-pages", type=int, default=32, help="SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES for both backends: pages per engine call (default: %(default)s; 0: the whole request at once, which Mooncake's TCP transport refuses above a few thousand page x layer slices)")
    parser.add_argument("--requests", type=int, default=5, help="timed requests per backend (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests first (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = parser.parse_args(argv)
    if args.role == "_prefill":
        print(json.dumps(run_prefill(args)), flush=True)
        return 0
    if args.role == "_decode":
        print(json.dumps(run_decode(args)), flush=True)
        return 0
    results, skipped = [], {}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if backend not in BACKENDS:
            parser.error(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        why = unavailable(backend)
        if why is not None:
            skipped[backend] = why
            continue
        results.append(bench_backend(args, backend))
    print(report(results, skipped, args), flush=True)
    if args.json:
        print(json.dumps({"results": results, "skipped": skipped}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
