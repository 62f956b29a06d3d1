"""Engine write throughput from Python, against the Rust bench on the same large block.

``python -m kvbridge.bench_engine [--transport shm|tcp|all] [--runs 15] [--mib 256]
[--rust PATH]`` starts a receiver process (this module with ``--role receiver``), which
allocates the destination pool through its ``kvbridge.Engine`` and prints its descriptor; this
process registers a numpy array of random bytes and times ``write(...).wait()`` of the whole
block, the way ``kvbridge-lab bench --pattern large`` times one batch of its 256 MiB block. The
receiver then checks every destination byte. With ``--rust`` (the ``kvbridge-lab`` binary, e.g.
``target/release/kvbridge-lab``) the Rust bench runs in the same invocation, right after, and the
ratio Python / Rust is printed. Figures go to docs/benchmarks.md; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

import kvbridge

SEED = 2024


def pattern(nbytes: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 256, size=nbytes, dtype=np.uint8)


def receiver(transport: str, nbytes: int) -> int:
    with kvbridge.Engine(transport) as engine:
        memory = engine.allocate(nbytes)
        pool = np.asarray(memory)
        print(json.dumps({"descriptor": engine.local_descriptor().hex(), "region": memory.region}), flush=True)
        for line in sys.stdin:
            if line.strip() == "verify":
                ok = bool((pool == pattern(nbytes)).all())
                print(json.dumps({"verified": ok}), flush=True)
            else:
                break
    return 0


def python_gbps(transport: str, nbytes: int, runs: int) -> tuple[float, bool]:
    peer_proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.bench_engine", "--role", "receiver", "--transport", transport,
         "--bytes", str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        hello = json.loads(peer_proc.stdout.readline())
        with kvbridge.Engine(transport) as engine:
            src = pattern(nbytes)
            region = engine.register_buffer(src)
            peer = engine.connect(bytes.fromhex(hello["descriptor"]))
            ops = np.array([[region, 0, hello["region"], 0, nbytes]], dtype=np.uint64)
            engine.write(peer, ops, timeout=120.0).wait()  # warm-up: maps the peer's pool
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                engine.write(peer, ops, timeout=120.0).wait()
                times.append(time.perf_counter() - start)
            peer_proc.stdin.write("verify\n")
            peer_proc.stdin.flush()
            verified = json.loads(peer_proc.stdout.readline())["verified"]
        return nbytes / statistics.median(times) / 1e9, verified
    finally:
        try:
            peer_proc.stdin.write("quit\n")
            peer_proc.stdin.close()
        except BrokenPipeError:
            pass
        peer_proc.wait(timeout=120)


def rust_gbps(binary: str, transport: str, runs: int) -> float:
    out = subprocess.run(
        [binary, "bench", "--transport", transport, "--pattern", "large", "--json", "--runs", str(runs)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for line in out.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if row.get("pattern") == "large":
                return float(row["gbps"])
    raise RuntimeError(f"no 'large' row in the Rust bench output:\n{out}")


def lines(runs: int, mib: int, rust: str | None, transport: str = "all") -> list[str]:
    """The table: one row per transport, Python's figure, the Rust bench's, their ratio."""
    nbytes = mib << 20
    out = [f"{'transport':<10}{'block':>10}{'python GB/s':>14}{'rust GB/s':>12}{'ratio':>8}  verified"]
    for t in ["shm", "tcp"] if transport == "all" else [transport]:
        gbps, verified = python_gbps(t, nbytes, runs)
        rust_value = rust_gbps(rust, t, runs) if rust else None
        ratio = f"{gbps / rust_value:8.2f}" if rust_value else f"{'-':>8}"
        rust_text = f"{rust_value:12.2f}" if rust_value else f"{'-':>12}"
        out.append(f"{t:<10}{mib:>7} MiB{gbps:14.2f}{rust_text}{ratio}  {verified}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbridge.bench_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", choices=["shm", "tcp", "all"], default="all")
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--mib", type=int, default=256, help="block size in MiB (the Rust bench's large block is 256)")
    p.add_argument("--rust", help="path of the kvbridge-lab binary, to run its bench in the same invocation")
    p.add_argument("--role", choices=["receiver"], help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "receiver":
        return receiver(args.transport, args.bytes)
    for line in lines(args.runs, args.mib, args.rust, args.transport):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
