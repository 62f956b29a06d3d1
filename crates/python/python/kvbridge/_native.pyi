"""Type stubs of the native module ``kvbridge._native`` (public names are re-exported by
``kvbridge`` and ``kvbridge.sglang``; the underscore-free functions here are building blocks
of those wrappers)."""

from typing import List, Optional, Tuple

__version__: str

def dcp_token_plan(
    src_pages: bytes,
    dst_pages: bytes,
    page_size: int,
    dcp_size: int,
    dcp_rank: int,
    src_page_offset: int,
    decode_prefix_len: int,
    num_kv_tokens: Optional[int],
) -> Optional[Tuple[bytearray, int, int]]: ...
def dcp_transfer_runs(
    src_pages: bytes,
    dst_pages: bytes,
    page_size: int,
    dcp_size: int,
    dcp_rank: int,
    src_page_offset: int,
    decode_prefix_len: int,
    num_kv_tokens: Optional[int],
) -> Tuple[bytearray, bytearray]: ...
def group_runs(
    src: bytes, dst: bytes, signed: bool
) -> Optional[Tuple[List[List[int]], List[List[int]]]]: ...
def virtual_page_size(physical_page_size: int, dcp_size: int) -> int:
    """``physical_page_size * dcp_size``; ``ValueError`` when either is zero."""

def align_prefix_down(prefix_len: int, physical_page_size: int, dcp_size: int) -> int:
    """The largest multiple of the virtual page ``<= prefix_len``: what a decode prefix cache
    may keep (the fix for SGLang's misaligned ``decode_prefix_len``)."""

def align_prefix_up(length: int, physical_page_size: int, dcp_size: int) -> int:
    """The smallest multiple of the virtual page ``>= length``: space (pages, padding), never a
    prefix."""
def descriptor_json(text: str, which: str) -> str: ...
def check_json(prefill: str, decode: str, compat: str, all_cp_ranks: bool = False) -> str: ...
def explain_json(code: str) -> str: ...
def problem_codes() -> List[str]: ...
