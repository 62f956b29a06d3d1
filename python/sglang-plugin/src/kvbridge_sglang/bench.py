"""The same request through SGLang's transfer backends and through kvbridge's own end to end,
in the same run (docs/sglang.md, "Benchmark").

    python -m kvbridge_sglang.bench                       # kvbridge, mooncake, e2e; TCP on loopback
    python -m kvbridge_sglang.bench --dcp 4               # MLA prefill DCP 1 -> decode DCP 4
    python -m kvbridge_sglang.bench --backends kvbridge --tokens 256 --requests 2

For each SGLang backend, one prefill process (SGLang's bootstrap server and prefill manager)
and one decode process per decode DCP rank (a decode manager each) move ``--requests`` requests of
``--tokens`` tokens of an MLA pool (``--layers`` buffers, ``--token-bytes`` per token, pages of
``--page-size``) through SGLang 0.5.23's own classes, as ``get_kv_class`` returns them:
``kvbridge`` (this plugin, ``KVBRIDGE_SGLANG_TRANSPORT=tcp``) and ``mooncake`` (SGLang's
Mooncake backend with ``MC_FORCE_TCP=1``, Mooncake's TCP transport). Every byte of every
request is checked on the decode (with ``--dcp`` > 1, each decode rank against the owner
rule). Reported per backend: the prefill's time from ``send`` to ``Success`` (all KV and the
aux row written, the decode told), the decode's from ``send_metadata`` to ``Success`` (the
whole request as the decode sees it), and the throughput of the first (KV bytes / time).
The pools are numpy arrays: no GPU and no model.

``e2e`` is kvbridge's own end to end for the same geometry (``kvbridge-lab bench --e2e
--transport tcp --prefill-dcp 1 --dcp D``: kvbridge's agents, control channels, bootstrap,
planner and TCP transport, no SGLang), run with kvbridge's lab binary (``--kvbridge-lab``,
default ``target/release/kvbridge-lab`` under the current directory, then ``kvbridge-lab`` on
``PATH``; ``cargo build --release -p kvbridge-lab`` builds it). Its geometry is fixed at 61
layers of 1,152 bytes per token and up to 8,192 tokens; another geometry skips it with the
reason.

``mooncake`` needs ``pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`` (and
libibverbs, which its engine links against); where it cannot be imported it is skipped with
the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from kvbridge_sglang.example import Pool, classes, publish

BACKENDS = ("kvbridge", "mooncake", "demo", "e2e", "engine")
# The geometry ``kvbridge-lab bench --e2e`` moves (crates/lab/src/bench/e2e.rs).
E2E_LAYERS, E2E_TOKEN_BYTES, E2E_MAX_TOKENS = 61, 1152, 8192
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


def unavailable(backend: str, args=None):
    """Why ``backend`` cannot run here, or ``None``."""
    if backend == "e2e":
        return _e2e_unavailable(args)
    if backend == "demo":
        return _demo_unavailable(args)
    if backend == "engine":
        return None if args is None or args.dcp == 1 else "the engine row measures the page path only (--dcp 1)"
    if backend != "mooncake":
        return None
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        return f"mooncake cannot be imported ({e}); pip install {MOONCAKE_PIN}"
    return None


def _pages(args) -> tuple:
    """The request's prefill pages and the decode's (virtual) pages, pages of ``page_size *
    dcp`` tokens: two different permutations, so every page lands somewhere else than where it
    came from; and the pool sizes, in pages, of each side."""
    n = -(-args.tokens // args.page_size)
    nv = -(-args.tokens // (args.page_size * args.dcp))
    rng = np.random.default_rng(3)
    src = rng.permutation(n + 1)[:n].astype(np.int32)
    dst = rng.permutation(nv + 1)[:nv].astype(np.int32)
    return src, dst, n + 1, nv + 1


def _owner_rows(args, src, dst, rank: int) -> tuple:
    """Decode DCP rank ``rank``'s rows and the prefill rows they hold (the owner rule: position
    p on rank p mod dcp at local row p div dcp; docs/planning.md)."""
    page, dcp = args.page_size, args.dcp
    p = np.arange(rank, args.tokens, dcp, dtype=np.int64)
    x = p // dcp
    return src[p // page].astype(np.int64) * page + p % page, dst[x // page].astype(np.int64) * page + x % page


def _ranks(rank: int, dcp: int) -> dict:
    """Parallel state of decode attention-TP rank ``rank`` of ``dcp`` (DCP nested in TP)."""
    return dict(
        tp_size=dcp, attn_tp_size=dcp, moe_tp_size=dcp, tp_rank=rank, attn_tp_rank=rank,
        moe_tp_rank=rank, attn_dcp_size=dcp, attn_dcp_rank=rank,
    )


def _manager(args, mode: str, pool: Pool, server_args, rank: int = 0):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if args.backend == "mooncake":
        # What SGLang's scheduler does for --disaggregation-transfer-backend mooncake.
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    cls = classes(args.backend)
    mode_enum = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    return cls, cls["MANAGER"](pool.kv_args(args.page_size, engine_rank=rank), mode_enum, server_args, True)


def _pool(args, pages: int) -> Pool:
    return Pool(args.layers, pages, args.page_size * args.token_bytes, aux_rows=2)


def run_prefill(args) -> dict:
    src, _, pages, _ = _pages(args)
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


# How often a decode rank polls its receiver. With DCP 4, four decode processes polling every
# 0.2 ms took CPU the transfer needs on a two-CPU host; their time is reported to within this,
# the prefill's (the figure compared) to within 0.2 ms.
DECODE_POLL_S = 0.001


def run_decode(args) -> dict:
    """Decode DCP rank ``args.rank`` (one process per rank, as a server runs them: Mooncake's
    engine is one per process, and SGLang tells decode ranks apart by their engines)."""
    from sglang.srt.runtime_context import get_parallel

    src, dst, pages, dst_pages = _pages(args)
    want = _pool(args, pages).fill(11)
    server_args = publish("decode", args.port, backend=args.backend)
    if args.dcp > 1:
        get_parallel().override_permanently(**_ranks(args.rank, args.dcp))
    pool = _pool(args, dst_pages)
    cls, manager = _manager(args, "decode", pool, server_args, args.rank)
    addr = f"127.0.0.1:{args.port}"
    end = time.monotonic() + STEP_TIMEOUT
    while not manager.try_ensure_parallel_info(addr):
        if time.monotonic() > end:
            raise TimeoutError(f"decode: no prefill registered at {addr} after {STEP_TIMEOUT} s")
        time.sleep(0.05)
    rows = _owner_rows(args, src, dst, args.rank)
    times = []
    for room in range(1, args.warmup + args.requests + 1):
        for buf in pool.kv:
            buf[:] = 0
        pool.aux[1] = 0
        receiver = cls["RECEIVER"](manager, addr, room)
        receiver.init(0)
        start = time.perf_counter()
        receiver.send_metadata(dst, aux_index=1)
        _spin(receiver, _poll().Success, f"decode: room {room}, DCP rank {args.rank}", DECODE_POLL_S)
        times.append(time.perf_counter() - start)
        _verify(args, room, args.rank, pool, want, src, dst, rows)
    return {"metadata_to_success_s": times[args.warmup :], "verified": True}


def _verify(args, room, rank, pool, want, src, dst, rows) -> None:
    """Decode DCP rank ``rank``'s pool after a request: with DCP 1 every page the page path
    moves whole (the last one padded), with DCP > 1 exactly the rank's rows (owner rule);
    nothing anywhere else; the aux row."""
    for layer, (got, sent) in enumerate(zip(pool.kv, want.kv)):
        where = f"decode: room {room}: DCP rank {rank}, layer {layer}"
        if args.dcp == 1:
            moved, expected = got[dst], sent[src]
        else:
            got, sent = got.reshape(-1, args.token_bytes), sent.reshape(-1, args.token_bytes)
            moved, expected = got[rows[1]], sent[rows[0]]
        if not np.array_equal(moved, expected):
            raise SystemExit(f"{where} differs from what was sent")
        if int(got.sum(dtype=np.uint64)) != int(moved.sum(dtype=np.uint64)):
            raise SystemExit(f"{where} holds bytes outside the request's pages or rows")
    if not np.array_equal(pool.aux[1], want.aux[0]):
        raise SystemExit(f"decode: room {room}: DCP rank {rank}'s aux row differs from what was sent")


def _poll():
    from sglang.srt.disaggregation.base import KVPoll

    return KVPoll


def _spin(obj, want, what: str, every: float = 0.0002) -> None:
    """Polls until ``want`` (0.2 ms apart by default, so the prefill's timed step ends within
    that of its state); raises SGLang's KVTransferError on Failed."""
    end = time.monotonic() + STEP_TIMEOUT
    while True:
        state = obj.poll()
        if state == want:
            return
        if state == _poll().Failed:
            obj.failure_exception()
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: still {_poll()(state).name} after {STEP_TIMEOUT} s")
        time.sleep(every)


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
        "--warmup", str(args.warmup), "--dcp", str(args.dcp),
    ]


def _last_json(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no result in the child's output:\n{text[-4000:]}")


def bench_backend(args, backend: str) -> dict:
    """One backend's prefill and decode processes; their figures."""
    if backend == "e2e":
        return bench_e2e(args)
    if backend == "demo":
        return bench_demo(args)
    if backend == "engine":
        return bench_engine(args)
    port = _free_port()
    cmd = [sys.executable, "-m", "kvbridge_sglang.bench"]
    env = backend_env(backend, args.batch_pages)
    child = _child_args(args, backend, port)
    prefill = subprocess.Popen(
        cmd + ["_prefill"] + child, env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    decodes = [
        subprocess.Popen(
            cmd + ["_decode", "--rank", str(rank)] + child, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(args.dcp)
    ]
    outputs, failed = [], []
    try:
        for rank, decode in enumerate(decodes):
            out, err = decode.communicate(timeout=4 * STEP_TIMEOUT)
            outputs.append(out)
            if decode.returncode != 0:
                failed.append(f"decode DCP rank {rank}:\n{err[-3000:]}")
        if failed:
            prefill.kill()
        p_out, p_err = prefill.communicate(input="", timeout=STEP_TIMEOUT)
    finally:
        for proc in [prefill, *decodes]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failed:
        raise RuntimeError(f"{backend}: " + "\n".join(failed) + f"\nthe prefill's output:\n{p_err[-3000:]}")
    if prefill.returncode != 0:
        raise RuntimeError(f"{backend}: the prefill failed:\n{p_err[-4000:]}")
    ranks = [_last_json(out) for out in outputs]
    # A request is done for the decode when its last rank is.
    result = {
        **_last_json(p_out),
        "metadata_to_success_s": [max(t) for t in zip(*(r["metadata_to_success_s"] for r in ranks))],
        "verified": all(r["verified"] for r in ranks),
    }
    send = result["send_to_success_s"]
    result.update(
        backend=backend,
        kv_bytes=_kv_bytes(args),
        prefill_p50_ms=1e3 * statistics.median(send),
        prefill_min_ms=1e3 * min(send),
        decode_p50_ms=1e3 * statistics.median(result["metadata_to_success_s"]),
        gb_per_s=_kv_bytes(args) / statistics.median(send) / 1e9,
    )
    return result


def _kv_bytes(args) -> int:
    return args.tokens * args.token_bytes * args.layers


def _lab(args):
    """The ``kvbridge-lab`` binary: ``--kvbridge-lab``, else ``target/release/kvbridge-lab``
    under the current directory, else ``kvbridge-lab`` on PATH; ``None`` where there is none."""
    if args.kvbridge_lab:
        return args.kvbridge_lab if os.access(args.kvbridge_lab, os.X_OK) else None
    local = os.path.join("target", "release", "kvbridge-lab")
    if os.access(local, os.X_OK):
        return local
    return shutil.which("kvbridge-lab")


def _e2e_scale(args):
    """``--size-scale`` giving ``kvbridge-lab bench --e2e`` this request's tokens, or ``None``."""
    align = args.page_size * args.dcp
    scale = args.tokens / E2E_MAX_TOKENS
    if not 0 < scale <= 1:
        return None
    return scale if (int(E2E_MAX_TOKENS * scale) // align) * align == args.tokens else None


def _e2e_unavailable(args):
    if args is None:
        return None
    missing = _lab_missing(args)
    if missing:
        return missing
    if args.layers != E2E_LAYERS or args.token_bytes != E2E_TOKEN_BYTES or _e2e_scale(args) is None:
        return (
            f"kvbridge-lab bench --e2e moves {E2E_LAYERS} layers of {E2E_TOKEN_BYTES} B per token and at most "
            f"{E2E_MAX_TOKENS} tokens (a multiple of page size x DCP); this request is {args.tokens} tokens "
            f"x {args.layers} layers x {args.token_bytes} B"
        )
    return None


def bench_e2e(args) -> dict:
    """kvbridge's own end to end on this request's geometry (``kvbridge-lab bench --e2e``, TCP)."""
    cmd = [
        _lab(args), "bench", "--e2e", "--transport", "tcp", "--prefill-dcp", "1",
        "--dcp", str(args.dcp), "--prefill-page-size", str(args.page_size),
        "--page-size", str(args.page_size), "--runs", str(args.requests), "--json",
    ]
    scale = _e2e_scale(args)
    if scale != 1:
        cmd += ["--size-scale", repr(scale)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=8 * STEP_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"e2e: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}{done.stdout[-2000:]}")
    r = _last_json(done.stdout)
    if r["bytes"] != _kv_bytes(args) or not r.get("verified"):
        raise RuntimeError(f"e2e: moved {r['bytes']} bytes (verified: {r.get('verified')}), not this request's {_kv_bytes(args)}")
    return {
        "backend": "e2e",
        "command": " ".join(cmd),
        "kv_bytes": r["bytes"],
        "prefill_p50_ms": r["coordinator_ms"],
        "prefill_min_ms": None,
        "decode_p50_ms": None,
        "gb_per_s": r["coordinator_gbps"],
        "transport_gb_per_s": r["transport_gbps"],
        "verified": r["verified"],
        "e2e": r,
    }


def _lab_missing(args):
    """Why there is no ``kvbridge-lab`` binary to run, or ``None``."""
    if _lab(args) is not None:
        return None
    where = args.kvbridge_lab or "target/release/kvbridge-lab (or kvbridge-lab on PATH)"
    return f"no kvbridge-lab binary at {where}; cargo build --release -p kvbridge-lab, or pass --kvbridge-lab"


def _demo_unavailable(args):
    return None if args is None else _lab_missing(args)


def bench_demo(args) -> dict:
    """kvbridge's own prefill and decode processes on this request's geometry and topology
    (``kvbridge-lab demo``: one prefill process, one decode process per DCP rank, TCP, one
    request at a time, every byte verified), timed as the SGLang rows are: per request, from
    the decode ranks' metadata in to Success on the prefill (the demo's ``transfer_ms``)."""
    cmd = [
        _lab(args), "demo", "--transport", "tcp", "--geometry", "mla",
        "--layers", str(args.layers), "--bytes-per-token-layer", str(args.token_bytes),
        "--tokens", str(args.tokens), "--page-size", str(args.page_size), "--dcp", str(args.dcp),
        "--requests", str(args.warmup + args.requests), "--concurrency", "1", "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=8 * STEP_TIMEOUT)
    r = _last_json(done.stdout) if done.stdout.strip() else {}
    if done.returncode != 0 or not r.get("ok"):
        raise RuntimeError(f"demo: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}{done.stdout[-2000:]}")
    # KV and aux, like the SGLang rows' requests; GB/s counts the KV, as theirs do.
    if r["bytes_moved"] // r["requests"] < _kv_bytes(args):
        raise RuntimeError(f"demo: moved {r['bytes_moved']} bytes in {r['requests']} requests, less than this request's KV each")
    return {
        "backend": "demo",
        "command": " ".join(cmd),
        "kv_bytes": _kv_bytes(args),
        "prefill_p50_ms": r["transfer_ms"]["p50"],
        "prefill_min_ms": None,
        "decode_p50_ms": None,
        "gb_per_s": _kv_bytes(args) / (r["transfer_ms"]["p50"] / 1e3) / 1e9,
        "room_to_success_p50_ms": r["latency_ms"]["p50"],
        "verified": r["verified_bytes"] == r["expected_verified_bytes"],
        "demo": r,
    }


def run_engine_receiver(args) -> int:
    """The ``engine`` row's receiver: the decode's pool, one region per layer; checks every
    page of the request when told ``verify``."""
    import kvbridge

    src, dst, pages, _ = _pages(args)
    pool, want = _pool(args, pages), _pool(args, pages).fill(11)
    with kvbridge.Engine("tcp", bind="127.0.0.1:0") as engine:
        regions = [engine.register_buffer(buf) for buf in pool.kv]
        print(json.dumps({"descriptor": engine.local_descriptor().hex(), "regions": regions}), flush=True)
        for line in sys.stdin:
            if line.strip() != "verify":
                break
            ok = all(np.array_equal(got[dst], sent[src]) for got, sent in zip(pool.kv, want.kv))
            print(json.dumps({"verified": ok}), flush=True)
    return 0


def bench_engine(args) -> dict:
    """The request's page rows (one per page and layer, pools registered one region per layer
    as SGLang's are) posted straight through ``kvbridge.Engine("tcp")`` to another process in
    one write, no SGLang: what the backend's write costs by itself (page path only)."""
    import kvbridge

    src, dst, pages, _ = _pages(args)
    receiver = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_sglang.bench", "_engine"] + _child_args(args, "engine", 0),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        hello = _last_json(receiver.stdout.readline())
        pool = _pool(args, pages).fill(11)
        row = args.page_size * args.token_bytes
        with kvbridge.Engine("tcp", bind="127.0.0.1:0") as engine:
            regions = [engine.register_buffer(buf) for buf in pool.kv]
            peer = engine.connect(bytes.fromhex(hello["descriptor"]))
            ops = np.array(
                [(regions[layer], int(s) * row, hello["regions"][layer], int(d) * row, row)
                 for layer in range(args.layers) for s, d in zip(src, dst)],
                dtype=np.uint64,
            )
            times = []
            for i in range(args.warmup + args.requests):
                start = time.perf_counter()
                engine.write(peer, ops, timeout=STEP_TIMEOUT).wait()
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
        receiver.stdin.write("verify\n")
        receiver.stdin.flush()
        verified = _last_json(receiver.stdout.readline())["verified"]
    finally:
        receiver.stdin.close()
        try:
            receiver.wait(timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            receiver.kill()
            receiver.wait()
    if not verified:
        raise RuntimeError("engine: the receiver's pool differs from what was sent")
    median = statistics.median(times)
    return {
        "backend": "engine", "kv_bytes": _kv_bytes(args), "send_to_success_s": times, "verified": True,
        "prefill_p50_ms": 1e3 * median, "prefill_min_ms": 1e3 * min(times), "decode_p50_ms": None,
        "gb_per_s": _kv_bytes(args) / median / 1e9, "rows": len(ops),
    }


def ratios(results: list) -> dict:
    """kvbridge's backend against kvbridge's own end to end and against Mooncake, by GB/s."""
    by = {r["backend"]: r["gb_per_s"] for r in results}
    out = {}
    if "kvbridge" in by and "demo" in by:
        out["kvbridge_vs_demo"] = by["kvbridge"] / by["demo"]
    if "kvbridge" in by and "e2e" in by:
        out["kvbridge_vs_e2e"] = by["kvbridge"] / by["e2e"]
    if "kvbridge" in by and "engine" in by:
        out["kvbridge_vs_engine"] = by["kvbridge"] / by["engine"]
    if "kvbridge" in by and "mooncake" in by:
        out["kvbridge_vs_mooncake"] = by["kvbridge"] / by["mooncake"]
    return out


def report(results: list, skipped: dict, args) -> str:
    size = _kv_bytes(args)
    path = "page path" if args.dcp == 1 else f"prefill DCP 1 -> decode DCP {args.dcp}"
    lines = [
        f"one request: {args.tokens} tokens x {args.layers} layers x {args.token_bytes} B "
        f"= {size / 1e6:.1f} MB, pages of {args.page_size}, MLA, {path}; {args.requests} requests "
        f"after {args.warmup} warm-up; TCP on 127.0.0.1; load average {_load()}",
        f"{'backend':<10} {'send->Success p50':>18} {'min':>9} {'GB/s':>7} {'decode p50':>11}",
    ]
    ms = lambda v: f"{v:>6.1f} ms" if v is not None else f"{'-':>9}"  # noqa: E731
    for r in results:
        lines.append(
            f"{r['backend']:<10} {r['prefill_p50_ms']:>15.1f} ms {ms(r['prefill_min_ms'])} "
            f"{r['gb_per_s']:>7.2f} {ms(r['decode_p50_ms']):>11}"
        )
    for backend, why in skipped.items():
        lines.append(f"{backend:<10} {why if why.startswith('failed') else 'skipped: ' + why}")
    for r in results:
        if r["backend"] == "demo":
            lines.append(
                f"demo: {r['command']} (its prefill and decode processes, as the SGLang rows: "
                f"metadata in -> Success; room created -> Success p50 {r['room_to_success_p50_ms']:.1f} ms)"
            )
        if r["backend"] == "e2e":
            lines.append(f"e2e: {r['command']} (one process; coordinator; its TCP large blocks: {r['transport_gb_per_s']:.2f} GB/s)")
        if r["backend"] == "mooncake":
            lines.append(f"mooncake: {args.batch_pages or 'all'} pages per engine call (--batch-pages)")
    r = ratios(results)
    if "kvbridge_vs_demo" in r:
        lines.append(f"kvbridge / demo: {r['kvbridge_vs_demo']:.2f}x (the same processes; target >= 0.8x)")
    if "kvbridge_vs_e2e" in r:
        lines.append(f"kvbridge / e2e: {r['kvbridge_vs_e2e']:.2f}x (e2e in one process; target >= 0.8x for --dcp 1)")
    if "kvbridge_vs_engine" in r:
        lines.append(f"kvbridge / engine: {r['kvbridge_vs_engine']:.2f}x (the same rows in one Engine.write, no SGLang)")
    if "kvbridge_vs_mooncake" in r:
        lines.append(f"kvbridge / mooncake: {r['kvbridge_vs_mooncake']:.2f}x (target >= 2x)")
    return "\n".join(lines)


def _why_failed(text: str) -> str:
    """One line for a backend that failed (its processes' output is long)."""
    if "queue-full" in text:
        return (
            "Mooncake's TCP transport refused the batch (\"TCP lane queue-full rejection\" in its "
            "log): SGLang posts a chunk's DCP token rows in one batch, one slice per row and layer"
        )
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line]
    return (errors or lines or ["unknown"])[-1].strip()


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge_sglang.bench", description=__doc__.split("\n")[0])
    parser.add_argument("role", nargs="?", default="run", choices=["run", "_prefill", "_decode", "_engine"], help=argparse.SUPPRESS)
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--backend", default="kvbridge", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the request (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=61, help="KV buffers, one per layer (default: %(default)s)")
    parser.add_argument("--token-bytes", type=int, default=1152, help="bytes per token per layer (default: %(default)s, MLA 576 x bf16)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page (default: %(default)s)")
    parser.add_argument("--dcp", type=int, default=1, help="decode DCP size: one decode manager per rank, prefill DCP 1 (default: %(default)s)")
    parser.add_argument("--batch-pages", type=int, default=32, help="SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES: pages per engine call of Mooncake's (default: %(default)s; 0: the whole request at once, which Mooncake's TCP transport refuses above a few thousand page x layer slices); kvbridge writes each chunk at once whatever it says")
    parser.add_argument("--requests", type=int, default=5, help="timed requests per backend (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests first (default: %(default)s)")
    parser.add_argument("--kvbridge-lab", default=None, help="the kvbridge-lab binary for e2e (default: target/release/kvbridge-lab, then kvbridge-lab on PATH)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = parser.parse_args(argv)
    if args.dcp < 1:
        parser.error(f"--dcp must be at least 1, got {args.dcp}")
    if args.role == "_prefill":
        print(json.dumps(run_prefill(args)), flush=True)
        return 0
    if args.role == "_engine":
        return run_engine_receiver(args)
    if args.role == "_decode":
        print(json.dumps(run_decode(args)), flush=True)
        return 0
    results, skipped = [], {}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if backend not in BACKENDS:
            parser.error(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        why = unavailable(backend, args)
        if why is not None:
            skipped[backend] = why
            continue
        try:
            results.append(bench_backend(args, backend))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            skipped[backend] = "failed: " + _why_failed(str(e))
    print(report(results, skipped, args), flush=True)
    if args.json:
        print(json.dumps({"results": results, "skipped": skipped, "ratios": ratios(results), "load_average": _load()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
