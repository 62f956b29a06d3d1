"""kvbridge's fused plan-to-runs entry point against the drop-ins it replaces."""

import random

import numpy as np
import pytest

from kvbridge import sglang as kvb


def as_runs(src_groups, dst_groups):
    return [[s[0], d[0], len(s)] for s, d in zip(src_groups, dst_groups)]


def test_runs_are_the_groups_of_the_plan_arrays():
    rng = random.Random(17)
    for _ in range(2000):
        page = rng.choice([1, 2, 4, 16, 64])
        dcp = rng.choice([1, 2, 3, 4, 8])
        offset = rng.randrange(4)
        n_src = rng.randrange(0, 9)
        tokens = None if rng.random() < 0.3 else rng.randrange(0, n_src * page + 1)
        n_tok = n_src * page if tokens is None else tokens
        n_dst = -(-(offset * page + n_tok) // (page * dcp)) + rng.randrange(2)
        # Few distinct ids, so consecutive pages (runs across page boundaries) are common.
        src = [rng.randrange(6) for _ in range(n_src)]
        dst = [rng.randrange(4) for _ in range(n_dst)]
        args = dict(
            physical_page_size=page,
            dcp_size=dcp,
            dcp_rank=rng.randrange(dcp),
            src_page_offset=offset,
            decode_prefix_len=page * dcp * rng.randrange(3),
            num_kv_tokens=tokens,
        )
        plan = kvb.build_dcp_token_transfer_plan(src, dst, **args)
        runs = kvb.build_dcp_transfer_runs(src, dst, **args)
        for got, (s, d) in [
            (runs.target_runs, (plan.target_src_token_indices, plan.target_dst_token_indices)),
            (runs.draft_runs, (plan.draft_src_token_indices, plan.draft_dst_token_indices)),
        ]:
            assert got.dtype == np.int64 and got.shape[1:] == (3,)
            assert got.tolist() == as_runs(*kvb.group_concurrent_contiguous(s, d)), args


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(decode_prefix_len=3), r"^PD DCP transfer requires decode_prefix_len .*\(KVB-E040\)$"),
        (dict(dcp_rank=4), r"dcp_rank must be below dcp_size, got dcp_rank=4 .*\(KVB-E022\)"),
        (dict(num_kv_tokens=9), r"num_kv_tokens must fit in the provided source pages.*KVB-E041"),
        (dict(dcp_size=0), r"dcp_size must be positive"),
    ],
)
def test_runs_refuse_bad_input_with_kvbridges_remedies(change, message):
    args = dict(physical_page_size=2, dcp_size=4, dcp_rank=1)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        kvb.build_dcp_transfer_runs([5, 2, 11, 4], [7], **args)


def test_runs_refuse_negative_page_ids():
    with pytest.raises(ValueError, match="src_page_indices must be non-negative"):
        kvb.build_dcp_transfer_runs([-1], [0], physical_page_size=2, dcp_size=1, dcp_rank=0)
