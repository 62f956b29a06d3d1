"""SGLang's real managers on numpy-backed KV pools, in one process (or one per process).

What SGLang's scheduler does around a transfer (prefill.py / decode.py of SGLang 0.5.23),
cut to the calls that matter: build ``KVArgs`` from the pools, make a manager per rank,
a sender per prefill request and a receiver per decode request, then poll.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

import numpy as np

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")

# Generous: the CI machine is loaded; nothing here is a timed assertion.
DEADLINE_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def publish(mode: str, port: int, **parallel) -> object:
    """Publishes a ServerArgs for this process, as SGLang's scheduler does at start."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel, publish as sglang_publish
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    args = ServerArgs(
        model_path="dummy",
        device="cpu",
        disaggregation_mode=mode,
        disaggregation_transfer_backend="kvbridge",
        disaggregation_bootstrap_port=port,
    )
    sglang_publish(args, role="test")
    ranks = dict(tp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, dp_rank=0, pp_rank=0)
    ranks.update(parallel)
    get_parallel().override_permanently(pp_group=None, **ranks)
    return args


@dataclass
class Pool:
    """One rank's KV pool (one buffer per layer, pages of ``page_bytes``) and aux rows."""

    layers: int
    pages: int
    page_bytes: int
    aux_rows: int = 8
    aux_bytes: int = 64
    kv: list = field(default_factory=list)
    aux: np.ndarray = None

    def __post_init__(self):
        self.kv = [np.zeros((self.pages, self.page_bytes), dtype=np.uint8) for _ in range(self.layers)]
        self.aux = np.zeros((self.aux_rows, self.aux_bytes), dtype=np.uint8)

    def fill(self, seed: int) -> "Pool":
        rng = np.random.default_rng(seed)
        for buf in self.kv:
            buf[:] = rng.integers(0, 256, buf.shape, dtype=np.uint8)
        self.aux[:] = rng.integers(0, 256, self.aux.shape, dtype=np.uint8)
        return self

    def kv_args(self, page_size: int, engine_rank: int = 0, mla: bool = True, heads: int = 1):
        from sglang.srt.disaggregation.base import KVArgs

        a = KVArgs()
        a.engine_rank = engine_rank
        a.pp_rank = 0
        a.system_dp_rank = 0
        a.rust_http_port = None
        a.kv_cache_dtype_str = "auto"
        a.kv_layout = None
        a.prefill_start_layer = 0
        a.prefill_end_layer = self.layers
        a.kv_data_ptrs = [b.ctypes.data for b in self.kv]
        a.kv_data_lens = [b.nbytes for b in self.kv]
        a.kv_item_lens = [self.page_bytes] * self.layers
        a.num_draft_entries = 0
        a.kv_layer_ids = list(range(self.layers)) if mla else list(range(self.layers // 2)) * 2
        if not mla:
            a.kv_head_num = heads
            a.total_kv_head_num = heads
        a.page_size = page_size
        a.aux_data_ptrs = [self.aux.ctypes.data]
        a.aux_data_lens = [self.aux.nbytes]
        a.aux_item_lens = [self.aux_bytes]
        a.ib_device = None
        a.gpu_id = 0
        a.state_types = []
        a.state_data_ptrs = []
        a.state_data_lens = []
        a.state_item_lens = []
        a.state_dim_per_tensor = []
        a.state_slice_outer_counts = []
        a.state_layer_ids = []
        a.is_hybrid_mla_backend = False
        a.state_conv_shard_groups = []
        a.swa_kv_cache_layout = None
        a.mla_compression_ratios = None
        return a


def wait_for(predicate, what: str, deadline: float = DEADLINE_S):
    end = time.monotonic() + deadline
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            what = what() if callable(what) else what
            raise AssertionError(f"timed out after {deadline} s waiting for {what}")
        time.sleep(0.02)


def poll_until(obj, states, what: str, deadline: float = DEADLINE_S):
    """Polls a sender or receiver until its state is one of ``states``; returns it."""
    from sglang.srt.disaggregation.base import KVPoll

    seen = []

    def done():
        state = obj.poll()
        if not seen or seen[-1] != state:
            seen.append(state)
        if state in states:
            return (state,)  # KVPoll.Failed is 0: wrapped so that it counts as found
        if state == KVPoll.Failed and KVPoll.Failed not in states:
            try:
                obj.failure_exception()
            except Exception as e:  # the cause, for the assertion message
                raise AssertionError(f"{what}: Failed ({e}); states {seen}") from e
            raise AssertionError(f"{what}: Failed; states {seen}")
        return None

    return wait_for(done, lambda: f"{what} (states so far {seen})", deadline)[0]
