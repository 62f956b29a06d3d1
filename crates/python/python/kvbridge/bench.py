"""Benchmarks of the Python package, each against its baseline in the same run.

    python -m kvbridge.bench planner [--repeats 30] [--sglang DIR]
    python -m kvbridge.bench engine [--repeats 30] [--rust target/release/kvbridge-lab]

``planner``: the SGLang drop-ins and kvbridge's fused ``build_dcp_transfer_runs`` against
SGLang 0.5.23's own numpy planner (fetched with ``kvbridge.reference`` unless ``--sglang``
names an unpacked copy) on the same inputs: page size 64, DCP 8, one 131072-token chunk
(2048 scattered source pages, 256 destination virtual pages), all 8 destination ranks per
iteration. Prints the median and the fastest of the repeats per rank, and the speed-ups of the
medians. Results are checked equal before anything is timed.

``engine``: ``kvbridge.Engine`` write throughput from Python on one 256 MiB block over shm and
TCP, every byte verified, and with ``--rust`` the Rust bench's large block (``kvbridge-lab bench
--pattern large``) in the same run (``kvbridge.bench_engine``). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import numpy as np

from kvbridge import bench_engine

PAGE_SIZE, DCP, TOKENS = 64, 8, 131072


def timeit(fn: Callable[[], object], repeats: int) -> Tuple[float, float]:
    """(median, fastest) seconds of `repeats` calls after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), min(samples)


def planner_inputs():
    """The chunk of crates/geometry/benches/planner.rs: scattered source and destination ids."""
    src = np.array([(i * 1031) % 4096 for i in range(TOKENS // PAGE_SIZE)], dtype=np.int32)
    dst = np.array(
        [(i * 257 + 3) % 1024 for i in range(TOKENS // (PAGE_SIZE * DCP))], dtype=np.int32
    )
    return src, dst


def planner(repeats: int, sglang_dir: str | None) -> List[str]:
    from kvbridge import reference
    from kvbridge import sglang as kvb

    theirs = reference.load_sglang_utils(reference.fetch_sglang(sglang_dir or reference.DEFAULT_DEST))
    src, dst = planner_inputs()
    args = [
        dict(physical_page_size=PAGE_SIZE, dcp_size=DCP, dcp_rank=r, num_kv_tokens=TOKENS)
        for r in range(DCP)
    ]

    # Each rank's result is dropped before the next is planned, as a transfer worker does.
    def plans(module):
        def run():
            for a in args:
                module.build_dcp_token_transfer_plan(src, dst, **a)

        return run

    def plans_and_groups(module):
        def run():
            for a in args:
                p = module.build_dcp_token_transfer_plan(src, dst, **a)
                module.group_concurrent_contiguous(
                    p.target_src_token_indices, p.target_dst_token_indices
                )

        return run

    def fused():
        for a in args:
            kvb.build_dcp_transfer_runs(src, dst, **a)

    # Same answers first.
    for a in args:
        ours = kvb.build_dcp_token_transfer_plan(src, dst, **a)
        ref = theirs.build_dcp_token_transfer_plan(src, dst, **a)
        for f in ("target_src", "target_dst", "draft_src", "draft_dst"):
            name = f"{f}_token_indices"
            assert np.array_equal(getattr(ours, name), getattr(ref, name)), (a, name)
        groups = theirs.group_concurrent_contiguous(
            ref.target_src_token_indices, ref.target_dst_token_indices
        )
        assert kvb.group_concurrent_contiguous(
            ours.target_src_token_indices, ours.target_dst_token_indices
        ) == groups
        runs = kvb.build_dcp_transfer_runs(src, dst, **a).target_runs
        assert runs.tolist() == [[s[0], d[0], len(s)] for s, d in zip(*groups)]

    # What SGLang's return type costs by itself: the target rows of every rank, each row its
    # own one-element list on both sides, built by CPython from ready ints.
    target_rows = [
        (p.target_src_token_indices.tolist(), p.target_dst_token_indices.tolist())
        for p in (kvb.build_dcp_token_transfer_plan(src, dst, **a) for a in args)
    ]

    def lists_only():
        for s, d in target_rows:
            [[x] for x in s], [[x] for x in d]

    rows = [
        ("plan: SGLang build_dcp_token_transfer_plan", plans(theirs)),
        ("plan: kvbridge.sglang drop-in", plans(kvb)),
        ("plan + group: SGLang", plans_and_groups(theirs)),
        ("plan + group: kvbridge.sglang drop-ins (same lists)", plans_and_groups(kvb)),
        ("plan + group: kvbridge build_dcp_transfer_runs (fused, arrays)", fused),
        ("floor of the list return type: the same one-element lists built by CPython", lists_only),
    ]
    timed: Dict[str, Tuple[float, float]] = {}
    lines = [
        f"planner: page size {PAGE_SIZE}, DCP {DCP}, {TOKENS} tokens, all ranks per iteration, "
        f"{repeats} repeats; python {sys.version.split()[0]}, numpy {np.__version__}"
    ]
    for name, fn in rows:
        med, best = timeit(fn, repeats)
        timed[name] = (med, best)
        lines.append(
            f"  {name}: median {med / DCP * 1e3:.3f} ms/rank, fastest {best / DCP * 1e3:.3f} ms/rank"
        )
    plan_ref = timed[rows[0][0]][0]
    group_ref = timed[rows[2][0]][0]
    lines.append(f"  speed-up, plan (drop-in): {plan_ref / timed[rows[1][0]][0]:.1f}x")
    lines.append(f"  speed-up, plan + group (drop-ins): {group_ref / timed[rows[3][0]][0]:.1f}x")
    lines.append(
        f"  speed-up, plan + group (fused runs, target >= 50x): {group_ref / timed[rows[4][0]][0]:.1f}x"
    )
    return lines


BENCHES: Dict[str, Callable[[argparse.Namespace], List[str]]] = {
    "planner": lambda a: planner(a.repeats, a.sglang),
    # Engine write throughput on one 256 MiB block, shm and TCP (kvbridge.bench_engine).
    "engine": lambda a: bench_engine.lines(a.repeats, 256, a.rust),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "which", nargs="*", default=[], help=f"benchmarks to run: {', '.join(BENCHES)} (default: all)"
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed repeats per row (median reported)")
    parser.add_argument("--sglang", default=None, help="an unpacked SGLang 0.5.23 (default: fetch it)")
    parser.add_argument("--rust", default=None, help="the kvbridge-lab binary, to run its engine bench alongside")
    args = parser.parse_args(argv)
    unknown = [w for w in args.which if w not in BENCHES]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHES)}")
    for name in args.which or list(BENCHES):
        for line in BENCHES[name](args):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
