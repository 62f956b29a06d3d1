#!/usr/bin/env python3
"""Time SGLang 0.5.23's numpy DCP planner on the inputs of crates/geometry/benches/planner.rs.

Usage (nothing of SGLang is vendored; it is imported from a downloaded wheel):

    pip download --no-deps sglang==0.5.23 -d /tmp/sgl
    cd /tmp/sgl && unzip -q -o sglang-0.5.23-*.whl 'sglang/srt/disaggregation/*' -d ex
    pip install numpy
    python3 scripts/sglang_planner_bench.py /tmp/sgl/ex

Page size 64, DCP 8, one 131072-token chunk (2048 source pages), every rank per iteration:
(a) build_dcp_token_transfer_plan; (b) the plan plus group_concurrent_contiguous on the
target arrays. Prints the median and fastest of the repeats, per iteration and per rank.
"""

import importlib.util
import statistics
import sys
import time
import types

PAGE_SIZE, DCP, TOKENS = 64, 8, 131072


def load_utils(root):
    # utils.py imports only numpy and a tracing helper; stub the helper.
    trace = types.ModuleType("sglang.srt.observability.trace")
    trace.TraceNullContext = type("TraceNullContext", (), {})
    trace.TraceReqContext = type("TraceReqContext", (), {})
    sys.modules["sglang.srt.observability.trace"] = trace
    path = f"{root}/sglang/srt/disaggregation/common/utils.py"
    spec = importlib.util.spec_from_file_location("sglang_dcp_utils", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timeit(fn, repeats):
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), min(samples)


def main():
    import numpy as np

    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/sgl/ex"
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    u = load_utils(root)
    src = np.array([(i * 1031) % 4096 for i in range(TOKENS // PAGE_SIZE)], dtype=np.int32)
    dst = np.array([(i * 257 + 3) % 1024 for i in range(TOKENS // (PAGE_SIZE * DCP))], dtype=np.int32)

    def plan(rank):
        return u.build_dcp_token_transfer_plan(
            src, dst, physical_page_size=PAGE_SIZE, dcp_size=DCP, dcp_rank=rank,
            src_page_offset=0, decode_prefix_len=0, num_kv_tokens=TOKENS,
        )

    def a():
        for rank in range(DCP):
            plan(rank)

    def b():
        for rank in range(DCP):
            p = plan(rank)
            u.group_concurrent_contiguous(p.target_src_token_indices, p.target_dst_token_indices)

    print(f"numpy {np.__version__}, python {sys.version.split()[0]}, repeats {repeats}")
    for name, fn in [("a_build_dcp_token_transfer_plan_all_ranks", a), ("b_plan_plus_group_all_ranks", b)]:
        med, best = timeit(fn, repeats)
        print(f"{name}: median {med * 1e3:.3f} ms ({med / DCP * 1e3:.3f} ms/rank), "
              f"fastest {best * 1e3:.3f} ms ({best / DCP * 1e3:.3f} ms/rank)")


if __name__ == "__main__":
    main()
