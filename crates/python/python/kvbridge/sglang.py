"""Drop-ins for SGLang 0.5.23's DCP planner (``sglang.srt.disaggregation.common.utils``).

Swap the import and nothing else changes::

    from kvbridge.sglang import build_dcp_token_transfer_plan, group_concurrent_contiguous

Same signatures, same results (``DCPTokenTransferPlan`` with four int64 arrays; groups as lists
of lists of ints), same exception types and texts. Inputs inside the planner's domain
(non-negative integer arguments, 1-D integer index arrays, pages that cover the chunk) are
planned by kvbridge's Rust planner; everything else (too few pages, negative offsets, float
arguments, ...) follows numpy's semantics step by step, so SGLang's numpy errors
(``IndexError: index 3 is out of bounds ...``) and results come out unchanged.

One deliberate difference: ``group_concurrent_contiguous`` also accepts plain sequences (SGLang
needs numpy arrays and raises ``AttributeError`` on a list).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

from kvbridge import _native
from kvbridge._native import (
    align_prefix_down,
    align_prefix_up,
    reshard_sources,
    reshard_targets,
    virtual_page_size,
)

__all__ = [
    "DCPTokenTransferPlan",
    "DCPTransferRuns",
    "build_dcp_token_transfer_plan",
    "build_dcp_transfer_runs",
    "build_reshard_transfer_runs",
    "reshard_sources",
    "reshard_targets",
    "group_concurrent_contiguous",
    "virtual_page_size",
    "align_prefix_down",
    "align_prefix_up",
]

IndexArray = Union[npt.NDArray[np.integer], Sequence[int]]

# SGLang's message, word for word (kvbridge's GeometryError::PrefixMisaligned starts with it).
_PREFIX_MISALIGNED = (
    "PD DCP transfer requires decode_prefix_len to align to the virtual "
    "DCP page size ({}), got {}"
)

_U64_END = 1 << 64


#= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py DCPTokenTransferPlan test: test_the_drop_ins_have_sglangs_signatures
## target_src_token_indices: npt.NDArray[np.int64]
## target_dst_token_indices: npt.NDArray[np.int64]
## draft_src_token_indices: npt.NDArray[np.int64]
## draft_dst_token_indices: npt.NDArray[np.int64]
@dataclasses.dataclass(frozen=True)
class DCPTokenTransferPlan:
    """The token rows of one chunk for one destination DCP rank (SGLang's fields)."""

    target_src_token_indices: npt.NDArray[np.int64]
    target_dst_token_indices: npt.NDArray[np.int64]
    draft_src_token_indices: npt.NDArray[np.int64]
    draft_dst_token_indices: npt.NDArray[np.int64]

    #= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py DCPTokenTransferPlan.empty test: test_plan_matches_sglang_on_random_inputs
    ## self.target_src_token_indices.size == 0
    ## and self.draft_src_token_indices.size == 0
    def empty(self) -> bool:
        return (
            self.target_src_token_indices.size == 0
            and self.draft_src_token_indices.size == 0
        )


def _as_ints(values):
    """The values as Python ints when each is an integer (or ``None``) in ``0..2**64``, else
    ``None``. numpy integers count too (they plan the same, except a zero divisor, which the
    caller routes to numpy, where it is a warning rather than ``ZeroDivisionError``)."""
    out = []
    for v in values:
        if v is None or isinstance(v, int):
            out.append(v)
        elif isinstance(v, np.integer):
            out.append(int(v))
        else:
            return None
        if out[-1] is not None and not 0 <= out[-1] < _U64_END:
            return None
    return out


#= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan test: test_the_drop_ins_have_sglangs_signatures
## *,
## physical_page_size: int,
## dcp_size: int,
## dcp_rank: int,
## src_page_offset: int = 0,
## decode_prefix_len: int = 0,
## num_kv_tokens: Optional[int] = None,
def build_dcp_token_transfer_plan(
    src_page_indices: IndexArray,
    dst_page_indices: IndexArray,
    *,
    physical_page_size: int,
    dcp_size: int,
    dcp_rank: int,
    src_page_offset: int = 0,
    decode_prefix_len: int = 0,
    num_kv_tokens: Optional[int] = None,
) -> DCPTokenTransferPlan:
    """Rows that prefill DCP 1 sends decode rank ``dcp_rank`` of a DCP group of ``dcp_size``.

    ``src_page_indices``: the chunk's prefill pages; ``dst_page_indices``: the decode's virtual
    pages of the whole send range; ``src_page_offset``: pages of the send range sent before
    this chunk; ``decode_prefix_len``: tokens the decode already holds (a multiple of
    ``physical_page_size * dcp_size``); ``num_kv_tokens``: tokens of the chunk (default: every
    slot of its pages). Target rows: the tokens the rank owns (position mod ``dcp_size``), in
    pages of ``physical_page_size``; draft rows: every token, in pages of the virtual size.
    """
    src_pages = np.asarray(src_page_indices, dtype=np.int64)
    dst_pages = np.asarray(dst_page_indices, dtype=np.int64)
    ints = _as_ints(
        (physical_page_size, dcp_size, src_page_offset, decode_prefix_len, num_kv_tokens)
    )
    rank = dcp_rank if isinstance(dcp_rank, (int, np.integer)) else None
    if ints is not None and rank is not None and src_pages.ndim == 1 and dst_pages.ndim == 1:
        page, dcp, page_offset, prefix, tokens = ints
        numpy_scalars = any(
            isinstance(v, np.integer)
            for v in (physical_page_size, dcp_size, dcp_rank, decode_prefix_len)
        )
        if page * dcp != 0 or not numpy_scalars:
            # Python's modulo, as SGLang's arithmetic: any rank names rank `rank % dcp`.
            arrays = _native.dcp_token_plan(
                src_pages.tobytes(),
                dst_pages.tobytes(),
                page,
                dcp,
                int(rank) % dcp if dcp else 0,
                page_offset,
                prefix,
                tokens,
            )
            if arrays is not None:
                buf, nt, nd = arrays
                return DCPTokenTransferPlan(
                    np.frombuffer(buf, dtype=np.int64, count=nt),
                    np.frombuffer(buf, dtype=np.int64, count=nt, offset=8 * nt),
                    np.frombuffer(buf, dtype=np.int64, count=nd, offset=16 * nt),
                    np.frombuffer(buf, dtype=np.int64, count=nd, offset=16 * nt + 8 * nd),
                )
    return _numpy_plan(
        src_pages,
        dst_pages,
        physical_page_size,
        dcp_size,
        dcp_rank,
        src_page_offset,
        decode_prefix_len,
        num_kv_tokens,
    )


def _numpy_plan(
    src_pages, dst_pages, page, dcp, rank, page_offset, prefix, tokens
) -> DCPTokenTransferPlan:
    """The plan in numpy, step for step in SGLang's order, for inputs outside the Rust
    planner's domain: numpy's results and exceptions (index errors, int64 wrap-around,
    negative indices counting from the end) are then SGLang's."""
    vpage = page * dcp
    if prefix % vpage != 0:
        raise ValueError(_PREFIX_MISALIGNED.format(vpage, prefix))
    if tokens is None:
        tokens = src_pages.size * page
    if tokens == 0:
        return DCPTokenTransferPlan(
            *(np.empty((0,), dtype=np.int64) for _ in range(4))
        )
    every = np.arange(tokens, dtype=np.int64)
    every_local = page_offset * page + every
    sent_before = prefix + page_offset * page
    owned = np.arange((rank - sent_before) % dcp, tokens, dcp, dtype=np.int64)
    owned_local = (page_offset * page + owned) // dcp

    #= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan.rows test: test_plan_bad_page_arrays_behave_as_in_sglang
    ## src_pages[offsets // physical_page_size] * physical_page_size
    ## + offsets % physical_page_size,
    ## dst_pages[dst_local // dst_page_size] * dst_page_size
    ## + dst_local % dst_page_size,
    def to_rows(offsets, dst_page, local):
        src_rows = src_pages[offsets // page] * page + offsets % page
        dst_rows = dst_pages[local // dst_page] * dst_page + local % dst_page
        return src_rows, dst_rows

    target_src, target_dst = to_rows(owned, page, owned_local)
    draft_src, draft_dst = to_rows(every, vpage, every_local)
    return DCPTokenTransferPlan(target_src, target_dst, draft_src, draft_dst)


@dataclasses.dataclass(frozen=True)
class DCPTransferRuns:
    """A chunk's rows for one destination rank as coalesced runs: ``(N, 3)`` int64 arrays of
    ``(src_row, dst_row, length)``, row ``src_row + i`` to ``dst_row + i`` for ``i < length``."""

    target_runs: npt.NDArray[np.int64]
    draft_runs: npt.NDArray[np.int64]


def build_dcp_transfer_runs(
    src_page_indices: IndexArray,
    dst_page_indices: IndexArray,
    *,
    physical_page_size: int,
    dcp_size: int,
    dcp_rank: int,
    src_page_offset: int = 0,
    decode_prefix_len: int = 0,
    num_kv_tokens: Optional[int] = None,
) -> DCPTransferRuns:
    """``build_dcp_token_transfer_plan`` followed by ``group_concurrent_contiguous`` on its
    target and its draft arrays, in one call and without either intermediate: run ``k`` of
    ``target_runs`` is group ``k`` of the target arrays (its first source row, first
    destination row, length), likewise for the draft.

    kvbridge's planner validates (``ValueError`` whose message names the fix and the problem
    code, e.g. ``dcp_rank`` must be below ``dcp_size``, the pages must cover the chunk);
    arguments are non-negative integers.
    """
    target, draft = _native.dcp_transfer_runs(
        np.asarray(src_page_indices, dtype=np.int64).tobytes(),
        np.asarray(dst_page_indices, dtype=np.int64).tobytes(),
        physical_page_size,
        dcp_size,
        dcp_rank,
        src_page_offset,
        decode_prefix_len,
        num_kv_tokens,
    )
    return DCPTransferRuns(
        np.frombuffer(target, dtype=np.int64).reshape(-1, 3),
        np.frombuffer(draft, dtype=np.int64).reshape(-1, 3),
    )


def build_reshard_transfer_runs(
    src_page_indices: IndexArray,
    dst_page_indices: IndexArray,
    *,
    src_page_size: int,
    dst_page_size: int,
    src_dcp_size: int,
    src_dcp_rank: int,
    dst_dcp_size: int,
    dst_dcp_rank: int,
    decode_prefix_len: int = 0,
    chunk_start: int = 0,
    num_tokens: int,
) -> npt.NDArray[np.int64]:
    """The rows prefill DCP rank ``src_dcp_rank`` (of ``src_dcp_size``) sends to decode DCP
    rank ``dst_dcp_rank`` (of ``dst_dcp_size``) in one chunk, any sizes on each side (the owner
    rule: position ``p`` lives on rank ``p mod size`` at local row ``p div size``), as an
    ``(N, 3)`` int64 array of coalesced runs ``(src_row, dst_row, length)``.

    ``src_page_indices`` are the prefill's page ids of this chunk (``src_page_size`` rows each
    on every prefill rank); ``dst_page_indices`` the decode's page ids of the whole send range,
    entry 0 at position ``decode_prefix_len``; ``chunk_start`` counts the positions of the send
    range sent before this chunk, ``num_tokens`` those of this chunk. kvbridge's planner
    validates (``ValueError`` naming the fix and the problem code). With ``src_dcp_size=1``
    the runs are ``build_dcp_transfer_runs``'s target runs.
    """
    runs = _native.reshard_transfer_runs(
        np.asarray(src_page_indices, dtype=np.int64).tobytes(),
        np.asarray(dst_page_indices, dtype=np.int64).tobytes(),
        src_page_size,
        dst_page_size,
        src_dcp_size,
        src_dcp_rank,
        dst_dcp_size,
        dst_dcp_rank,
        decode_prefix_len,
        chunk_start,
        num_tokens,
    )
    return np.frombuffer(runs, dtype=np.int64).reshape(-1, 3)


def group_concurrent_contiguous(
    src_indices: IndexArray, dst_indices: IndexArray
) -> Tuple[List[List[int]], List[List[int]]]:
    """Cuts paired indices into groups that are consecutive on both sides.

    A group ends before every position where the source or the destination index is not the
    previous one plus 1. Either side empty: no groups; otherwise both sides must be equally
    long (``ValueError``).
    """
    src = np.asarray(src_indices)
    dst = np.asarray(dst_indices)
    if _plain_index_array(src) and _plain_index_array(dst):
        wide = [a.dtype == np.uint64 for a in (src, dst)]
        groups = None
        if not any(wide):
            groups = _native.group_runs(
                src.astype(np.int64, copy=False).tobytes(),
                dst.astype(np.int64, copy=False).tobytes(),
                True,
            )
        elif all(wide):
            groups = _native.group_runs(src.tobytes(), dst.tobytes(), False)
        if groups is not None:
            return groups
    return _numpy_groups(src, dst)


def _plain_index_array(a) -> bool:
    """A 1-D integer array whose differences cannot wrap around in its own dtype (numpy
    computes them there: for int32, 2**31 - 1 followed by -2**31 is consecutive), so grouping
    its values as 64-bit integers is exact. 64-bit maxima are caught by the native side."""
    if a.ndim != 1 or a.dtype.kind not in "iu":
        return False
    return a.dtype.itemsize == 8 or not (a == np.iinfo(a.dtype).max).any()


def _numpy_groups(src, dst):
    """The grouping in numpy for other dtypes and shapes (floats, objects, mixed signedness),
    so their results and errors are numpy's, as in SGLang."""
    if src.size == 0 or dst.size == 0:
        return [], []
    if src.size != dst.size:
        raise ValueError(
            "group_concurrent_contiguous requires equal-length src/dst index arrays, "
            f"got {src.size} and {dst.size}"
        )
    #= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py group_concurrent_contiguous test: test_group_odd_inputs_behave_as_in_sglang
    ## brk = np.where((np.diff(src_indices) != 1) | (np.diff(dst_indices) != 1))[0] + 1
    ## src_groups = np.split(src_indices, brk)
    ## dst_groups = np.split(dst_indices, brk)
    cuts = np.nonzero((np.diff(src) != 1) | (np.diff(dst) != 1))[0] + 1
    return (
        [g.tolist() for g in np.split(src, cuts)],
        [g.tolist() for g in np.split(dst, cuts)],
    )
