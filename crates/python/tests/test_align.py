import pytest

import kvbridge
from kvbridge import sglang


def test_prefix_rounds_to_whole_virtual_pages():
    assert kvbridge.virtual_page_size(16, 4) == 64
    assert kvbridge.align_prefix_down(100, 16, 4) == 64
    assert kvbridge.align_prefix_up(100, 16, 4) == 128
    assert kvbridge.align_prefix_down(128, 16, 4) == kvbridge.align_prefix_up(128, 16, 4) == 128
    assert sglang.align_prefix_down is kvbridge.align_prefix_down


def test_a_prefix_rounded_down_is_what_the_planner_accepts():
    args = dict(physical_page_size=16, dcp_size=4, dcp_rank=0)
    with pytest.raises(ValueError, match=r"virtual DCP page size \(64\), got 100$"):
        sglang.build_dcp_token_transfer_plan([1], [2], decode_prefix_len=100, **args)
    kept = kvbridge.align_prefix_down(100, 16, 4)
    plan = sglang.build_dcp_token_transfer_plan([1], [2], decode_prefix_len=kept, **args)
    assert plan.target_dst_token_indices.tolist() == [32, 33, 34, 35]


@pytest.mark.parametrize("fn", [kvbridge.align_prefix_down, kvbridge.align_prefix_up])
def test_zero_sizes_are_refused_with_the_remedy(fn):
    with pytest.raises(ValueError, match=r"page_size must be positive, got 0.*\(KVB-E021\)"):
        fn(10, 0, 4)
    with pytest.raises(ValueError, match=r"dcp_size must be positive.*use 1"):
        fn(10, 16, 0)


def test_negative_lengths_are_refused():
    with pytest.raises(OverflowError):
        kvbridge.align_prefix_down(-1, 16, 4)


def test_overflow_is_refused_not_wrapped():
    with pytest.raises(ValueError, match="KVB-E033"):
        kvbridge.align_prefix_up(2**64 - 1, 16, 4)
