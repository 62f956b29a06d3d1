"""Prefill DCP a -> decode DCP b from Python: kvbridge's owner-rule planner, checked against a
position-by-position reference."""

import random

import numpy as np
import pytest

from kvbridge import sglang as kvb


def reference_pairs(src, dst, p1, p2, a, ar, b, br, prefix, chunk_start, n):
    """Position p lives on prefill rank p mod a at local row p div a (prefill page table ``src``
    starting at the page of the chunk's first local row) and on decode rank p mod b at local
    row (p - prefix) div b (``dst`` covering the send range)."""
    start = prefix + chunk_start
    base = (start // a) // p1 * p1
    pairs = []
    for p in range(start, start + n):
        if p % a != ar or p % b != br:
            continue
        y = p // a - base
        x = (p - prefix) // b
        pairs.append((src[y // p1] * p1 + y % p1, dst[x // p2] * p2 + x % p2))
    return pairs


def expand(runs):
    return [(int(s) + i, int(d) + i) for s, d, n in runs for i in range(int(n))]


def test_runs_move_exactly_the_owner_rules_rows():
    rng = random.Random(23)
    for _ in range(1500):
        a, b = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3, 4, 8])
        p1, p2 = rng.choice([1, 2, 4, 16]), rng.choice([1, 2, 4, 16])
        prefix = p2 * b * rng.randrange(3)
        chunk_start = rng.randrange(0, 3 * p1 * a + 1)
        n = rng.randrange(0, 5 * p1 * a)
        start = prefix + chunk_start
        n_src = ((start + n) // a - (start // a) // p1 * p1) // p1 + 1
        n_dst = -(-(chunk_start + n) // (p2 * b)) + 1
        src = [rng.randrange(8) for _ in range(n_src)]
        dst = [rng.randrange(6) for _ in range(n_dst)]
        ar, br = rng.randrange(a), rng.randrange(b)
        runs = kvb.build_reshard_transfer_runs(
            src, dst, src_page_size=p1, dst_page_size=p2, src_dcp_size=a, src_dcp_rank=ar,
            dst_dcp_size=b, dst_dcp_rank=br, decode_prefix_len=prefix, chunk_start=chunk_start,
            num_tokens=n,
        )
        assert runs.dtype == np.int64 and runs.shape[1:] == (3,)
        want = reference_pairs(src, dst, p1, p2, a, ar, b, br, prefix, chunk_start, n)
        assert expand(runs) == want, (a, ar, b, br, p1, p2, prefix, chunk_start, n)


def test_prefill_dcp1_matches_the_dcp_plans_target_runs():
    args = dict(physical_page_size=4, dcp_size=4, dcp_rank=3, src_page_offset=2, num_kv_tokens=21)
    src, dst = [5, 2, 11, 4, 9, 0], [7, 1, 3]
    dcp = kvb.build_dcp_transfer_runs(src, dst, **args)
    runs = kvb.build_reshard_transfer_runs(
        src, dst, src_page_size=4, dst_page_size=4, src_dcp_size=1, src_dcp_rank=0,
        dst_dcp_size=4, dst_dcp_rank=3, chunk_start=8, num_tokens=21,
    )
    assert runs.tolist() == dcp.target_runs.tolist()


def test_sources_and_targets_are_the_owner_rules_pairs():
    for a in range(1, 9):
        for b in range(1, 9):
            for br in range(b):
                want = [ar for ar in range(a) if any(p % a == ar and p % b == br for p in range(a * b))]
                assert kvb.reshard_sources(a, b, br) == want
            for ar in range(a):
                want = [br for br in range(b) if any(p % a == ar and p % b == br for p in range(a * b))]
                assert kvb.reshard_targets(a, b, ar) == want
    assert kvb.reshard_sources(2, 4, 3) == [1]


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(src_dcp_rank=2), r"dcp_rank=2.*KVB-E022"),
        (dict(num_tokens=64), r"KVB-E041"),
        (dict(decode_prefix_len=3), r"KVB-E040"),
        (dict(src_page_size=0), r"page_size"),
    ],
)
def test_runs_refuse_bad_input_with_kvbridges_remedies(change, message):
    args = dict(src_page_size=4, dst_page_size=4, src_dcp_size=2, src_dcp_rank=1, dst_dcp_size=4,
                dst_dcp_rank=3, num_tokens=16)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        kvb.build_reshard_transfer_runs([5, 2], [7], **args)


def test_sources_refuse_a_rank_outside_the_group():
    with pytest.raises(ValueError, match="KVB-E022"):
        kvb.reshard_sources(2, 4, 4)
