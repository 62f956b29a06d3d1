"""The SGLang drop-ins against SGLang 0.5.23's own functions, on the same inputs.

Every case compares the whole outcome: the arrays (values, dtype, shape) or the groups (values
and element types), or the exception (type and text).
"""

import random

import numpy as np
import pytest

from kvbridge import sglang as kvb

CASES = 4000


def outcome(fn, *args, **kwargs):
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as e:  # the exception itself is what is compared
        return ("raised", type(e), str(e))


def plan_fields(plan):
    return [
        plan.target_src_token_indices,
        plan.target_dst_token_indices,
        plan.draft_src_token_indices,
        plan.draft_dst_token_indices,
    ]


def assert_same_plan(ours, theirs, case):
    assert ours[0] == theirs[0], (case, ours, theirs)
    if ours[0] == "raised":
        assert ours[1:] == theirs[1:], case
        return
    assert type(ours[1]).__name__ == "DCPTokenTransferPlan"
    assert ours[1].empty() == theirs[1].empty(), case
    for a, b in zip(plan_fields(ours[1]), plan_fields(theirs[1])):
        assert a.dtype == b.dtype == np.int64, case
        assert a.shape == b.shape, case
        np.testing.assert_array_equal(a, b, err_msg=str(case))


def pages(rng, n, low=0, high=1000):
    return [rng.randrange(low, high) for _ in range(n)]


def as_input(rng, values):
    """The same page ids as one of the containers SGLang is called with."""
    kind = rng.randrange(5)
    if max(values, default=0) >= 2**31:
        kind = 1
    if kind == 0:
        return np.array(values, dtype=np.int32)
    if kind == 1:
        return np.array(values, dtype=np.int64)
    if kind == 2 and all(v >= 0 for v in values):
        return np.array(values, dtype=np.uint32)
    if kind == 3:
        return list(values)
    return np.array(values, dtype=np.int64)[::-1][::-1]  # a view, not C-contiguous-owned


def random_plan_case(rng):
    """Mostly valid inputs around every boundary, and each way SGLang refuses or wraps."""
    page = rng.choice([1, 2, 3, 4, 8, 16, 64])
    dcp = rng.choice([1, 2, 3, 4, 8])
    vpage = page * dcp
    rank = rng.randrange(dcp) if rng.random() < 0.85 else rng.randrange(-3, dcp + 4)
    offset = rng.randrange(4)
    prefix = vpage * rng.randrange(4)
    n_src = rng.randrange(0, 9)
    tokens = None if rng.random() < 0.3 else rng.randrange(0, n_src * page + 1)
    n_tok = n_src * page if tokens is None else tokens
    need = -(-(offset * page + n_tok) // vpage)
    n_dst = max(0, need + rng.choice([0, 0, 0, 1, 2]))
    kind = rng.randrange(20)
    if kind == 0:  # misaligned prefix (ValueError)
        prefix += rng.randrange(1, vpage) if vpage > 1 else 0
    elif kind == 1:  # zero page size or DCP size (ZeroDivisionError)
        if rng.random() < 0.5:
            page = 0
        else:
            dcp = 0
    elif kind == 2:  # more tokens than the source pages hold (IndexError)
        tokens = n_src * page + rng.randrange(1, 2 * page + 1)
    elif kind == 3:  # too few destination pages (IndexError)
        n_dst = max(0, need - rng.randrange(1, 3))
    elif kind == 4:  # negative page ids (numpy computes with them)
        return dict(
            src=pages(rng, n_src, -50, 50), dst=pages(rng, n_dst, -50, 50),
            page=page, dcp=dcp, rank=rank, offset=offset, prefix=prefix, tokens=tokens,
        )
    elif kind == 5:  # negative offset: numpy counts indices from the end (or IndexError)
        offset = -rng.randrange(1, 3)
    elif kind == 6:  # negative token count
        tokens = -rng.randrange(1, 10)
    elif kind == 7:  # float arguments: numpy refuses float indices (IndexError)
        page = float(page) if rng.random() < 0.5 else page
        tokens = float(n_tok) if tokens is None or rng.random() < 0.5 else tokens
    elif kind == 8:  # numpy integer arguments
        page, dcp = np.int64(page), np.int32(dcp)
        rank, prefix = np.int64(rank), np.int64(prefix)
    elif kind == 9:  # page ids that overflow int64 rows (numpy wraps around)
        return dict(
            src=[2**62 + rng.randrange(3)] * n_src, dst=pages(rng, n_dst),
            page=max(page, 2), dcp=dcp, rank=rank, offset=offset, prefix=prefix,
            tokens=tokens,
        )
    elif kind == 10:  # negative prefix
        prefix = -prefix
    return dict(
        src=pages(rng, n_src), dst=pages(rng, n_dst), page=page, dcp=dcp, rank=rank,
        offset=offset, prefix=prefix, tokens=tokens,
    )


def call(module, case, rng_seed):
    rng = random.Random(rng_seed)
    return outcome(
        module.build_dcp_token_transfer_plan,
        as_input(rng, case["src"]),
        as_input(rng, case["dst"]),
        physical_page_size=case["page"],
        dcp_size=case["dcp"],
        dcp_rank=case["rank"],
        src_page_offset=case["offset"],
        decode_prefix_len=case["prefix"],
        num_kv_tokens=case["tokens"],
    )


def test_plan_matches_sglang_on_random_inputs(sglang_utils, monkeypatch):
    numpy_path = []
    real = kvb._numpy_plan
    monkeypatch.setattr(kvb, "_numpy_plan", lambda *a: numpy_path.append(1) or real(*a))
    rng = random.Random(15)
    kinds = set()
    for _ in range(CASES):
        case = random_plan_case(rng)
        seed = rng.randrange(2**32)
        with np.errstate(all="ignore"):
            ours = call(kvb, case, seed)
            theirs = call(sglang_utils, case, seed)
        assert_same_plan(ours, theirs, case)
        kinds.add(theirs[1].__name__ if theirs[0] == "raised" else "ok")
    # Every way SGLang's planner answers was exercised, most cases by the Rust planner.
    assert kinds == {"ok", "ValueError", "ZeroDivisionError", "IndexError"}, kinds
    assert CASES - len(numpy_path) >= CASES // 2, len(numpy_path)


def test_plan_matches_sglang_on_the_benchmark_chunk(sglang_utils):
    src = np.array([(i * 1031) % 4096 for i in range(2048)], dtype=np.int32)
    dst = np.array([(i * 257 + 3) % 1024 for i in range(256)], dtype=np.int32)
    for rank in range(8):
        args = dict(physical_page_size=64, dcp_size=8, dcp_rank=rank, num_kv_tokens=131072)
        ours = outcome(kvb.build_dcp_token_transfer_plan, src, dst, **args)
        theirs = outcome(sglang_utils.build_dcp_token_transfer_plan, src, dst, **args)
        assert_same_plan(ours, theirs, rank)


@pytest.mark.parametrize(
    "bad",
    [
        ["a", "b"],  # not numbers: ValueError from numpy's conversion
        [[1, 2], [3]],  # ragged: ValueError
        [None, 1],  # TypeError
        np.array([1.7, 2.2]),  # floats: both truncate to int64
        np.array([True, False]),  # bools convert too
        np.zeros((2, 2), dtype=np.int64),  # 2-D: numpy indexes rows
        [-1, -2],  # negative ids
        7,  # a scalar: 0-d
    ],
    ids=repr,
)
def test_plan_bad_page_arrays_behave_as_in_sglang(sglang_utils, bad):
    for src, dst in [(bad, [0, 1, 2]), ([0, 1, 2], bad)]:
        args = dict(physical_page_size=2, dcp_size=2, dcp_rank=1)
        with np.errstate(all="ignore"):
            ours = outcome(kvb.build_dcp_token_transfer_plan, src, dst, **args)
            theirs = outcome(sglang_utils.build_dcp_token_transfer_plan, src, dst, **args)
        assert_same_plan(ours, theirs, (src, dst))


def random_group_case(rng):
    n = rng.randrange(0, 40)
    start_s, start_d = rng.randrange(-20, 1000), rng.randrange(-20, 1000)
    src, dst = [], []
    s, d = start_s, start_d
    for _ in range(n):
        src.append(s)
        dst.append(d)
        # Mostly consecutive, with every kind of break on either side.
        s += 1 if rng.random() < 0.7 else rng.choice([0, -1, 2, 5, -7])
        d += 1 if rng.random() < 0.7 else rng.choice([0, -1, 2, 5, -7])
    kind = rng.randrange(10)
    if kind == 0:  # unequal lengths (ValueError)
        dst = dst + pages(rng, rng.randrange(1, 4))
    elif kind == 1:  # one side empty: no groups, no error
        src = [] if rng.random() < 0.5 else src
        dst = dst if src == [] else []
    dtype_s = rng.choice([np.int32, np.int64, np.int64, np.int16, np.float64])
    dtype_d = dtype_s if rng.random() < 0.8 else rng.choice([np.int32, np.int64, np.float64])
    if min(src + dst, default=0) >= 0 and rng.random() < 0.2:
        dtype_s = dtype_d = rng.choice([np.uint32, np.uint64])
    return np.array(src, dtype=dtype_s), np.array(dst, dtype=dtype_d)


def assert_same_groups(ours, theirs, case):
    assert ours[0] == theirs[0], (case, ours, theirs)
    if ours[0] == "raised":
        assert ours[1:] == theirs[1:], case
        return
    assert ours[1] == theirs[1], case
    flat = lambda groups: [type(x) for side in groups for g in side for x in g]  # noqa: E731
    assert flat(ours[1]) == flat(theirs[1]), case


def test_group_matches_sglang_on_random_inputs(sglang_utils, monkeypatch):
    numpy_path = []
    real = kvb._numpy_groups
    monkeypatch.setattr(kvb, "_numpy_groups", lambda *a: numpy_path.append(1) or real(*a))
    rng = random.Random(16)
    kinds = set()
    for _ in range(CASES):
        src, dst = random_group_case(rng)
        ours = outcome(kvb.group_concurrent_contiguous, src, dst)
        theirs = outcome(sglang_utils.group_concurrent_contiguous, src, dst)
        assert_same_groups(ours, theirs, (src, dst))
        kinds.add(theirs[1] if theirs[0] == "raised" else "ok")
        # Sequences are accepted too (SGLang needs arrays) and group the same.
        if src.dtype.kind in "iu" and dst.dtype.kind in "iu":
            assert_same_groups(
                outcome(kvb.group_concurrent_contiguous, src.tolist(), dst.tolist()),
                theirs,
                (src, dst),
            )
    assert kinds == {"ok", ValueError}, kinds
    assert CASES - len(numpy_path) >= CASES // 2, len(numpy_path)


@pytest.mark.parametrize(
    "src,dst",
    [
        (np.array([True, False]), np.array([True, True])),  # bool subtraction: TypeError
        (np.array([1, 2], dtype=object), np.array([3, 4], dtype=object)),
        (np.array(3), np.array(4)),  # 0-d: numpy's diff refuses
        (np.arange(6).reshape(2, 3), np.arange(6).reshape(2, 3)),
        (np.array([2**63 - 1], dtype=np.int64), np.array([0], dtype=np.int64)),
        # numpy's differences wrap around in the array's dtype: these count as consecutive.
        (np.array([2**63 - 1, -(2**63)]), np.array([4, 5])),
        (np.array([2**31 - 1, -(2**31)], dtype=np.int32), np.array([4, 5], dtype=np.int32)),
        (np.array([255, 0], dtype=np.uint8), np.array([4, 5], dtype=np.uint8)),
        (np.array([2**64 - 1, 0], dtype=np.uint64), np.array([5, 6], dtype=np.uint64)),
        (np.array([1, 2], dtype=np.uint64), np.array([-1, 0], dtype=np.int64)),
    ],
    ids=repr,
)
def test_group_odd_inputs_behave_as_in_sglang(sglang_utils, src, dst):
    with np.errstate(all="ignore"):
        assert_same_groups(
            outcome(kvb.group_concurrent_contiguous, src, dst),
            outcome(sglang_utils.group_concurrent_contiguous, src, dst),
            (src, dst),
        )


def test_the_drop_ins_have_sglangs_signatures(sglang_utils):
    import inspect

    for name in ["build_dcp_token_transfer_plan", "group_concurrent_contiguous"]:
        ours = inspect.signature(getattr(kvb, name))
        theirs = inspect.signature(getattr(sglang_utils, name))
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.default) for p in theirs.parameters.values()
        ]
    fields = lambda cls: [f.name for f in __import__("dataclasses").fields(cls)]  # noqa: E731
    assert fields(kvb.DCPTokenTransferPlan) == fields(sglang_utils.DCPTokenTransferPlan)


def test_plan_arrays_are_writable_like_numpys():
    plan = kvb.build_dcp_token_transfer_plan(
        np.array([5, 2, 11, 4]), np.array([7]), physical_page_size=2, dcp_size=4, dcp_rank=1
    )
    plan.target_src_token_indices[0] += 1
    assert plan.target_src_token_indices.tolist() == [12, 23]
    assert plan.target_dst_token_indices.tolist() == [14, 15]
