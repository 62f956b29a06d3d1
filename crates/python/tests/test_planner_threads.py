"""The planner from several Python threads at once, and the interpreter state it touches."""

import gc
import threading

import numpy as np

from kvbridge import sglang as kvb


def test_plans_from_many_threads_agree_with_one_thread():
    src = np.array([(i * 1031) % 4096 for i in range(256)], dtype=np.int32)
    dst = np.array([(i * 257 + 3) % 1024 for i in range(64)], dtype=np.int32)
    args = [dict(physical_page_size=16, dcp_size=4, dcp_rank=r) for r in range(4)]

    def answer(a):
        p = kvb.build_dcp_token_transfer_plan(src, dst, **a)
        groups = kvb.group_concurrent_contiguous(
            p.draft_src_token_indices, p.draft_dst_token_indices
        )
        runs = kvb.build_dcp_transfer_runs(src, dst, **a).target_runs.tolist()
        return p.target_src_token_indices.tolist(), p.draft_dst_token_indices.tolist(), groups, runs

    expected = [answer(a) for a in args]
    failures = []

    def worker(k):
        for i in range(20):
            r = (k + i) % 4
            if answer(args[r]) != expected[r]:
                failures.append((k, i))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


def test_grouping_leaves_the_garbage_collector_as_it_found_it():
    src, dst = np.arange(0, 64, 2), np.arange(32)
    assert gc.isenabled()
    kvb.group_concurrent_contiguous(src, dst)
    assert gc.isenabled()
    gc.disable()
    try:
        kvb.group_concurrent_contiguous(src, dst)
        assert not gc.isenabled()
    finally:
        gc.enable()
    # A refused input leaves it enabled too.
    try:
        kvb.group_concurrent_contiguous(src, dst[:-1])
    except ValueError:
        pass
    assert gc.isenabled()
