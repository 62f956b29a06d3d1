"""One request between two SGLang managers, one process each (docs/sglang.md).

    python -m kvbridge_sglang.example prefill --port 8998 &
    python -m kvbridge_sglang.example decode --port 8998

On two hosts, each process names its own address in ``SGLANG_HOST_IP`` (where its engine and
SGLang's sockets listen) and both name the prefill's in ``--bootstrap-host``:

    SGLANG_HOST_IP=10.0.0.1 python -m kvbridge_sglang.example prefill --bootstrap-host 10.0.0.1
    SGLANG_HOST_IP=10.0.0.2 python -m kvbridge_sglang.example decode --bootstrap-host 10.0.0.1

The prefill process runs SGLang's bootstrap server and a prefill manager over a pool filled
from a seed; the decode process runs a decode manager, asks for the request and checks every
byte it received against the same seed. Both use SGLang 0.5.23's own classes through
``get_kv_class(TransferBackend("kvbridge"), ...)``, as SGLang's scheduler does. The pools
are numpy arrays, so no GPU and no model are needed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

# Every socket SGLang opens stays on this host unless SGLANG_HOST_IP names another address.
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")

LAYERS, PAGE_SIZE, TOKEN_BYTES, PAGES = 4, 16, 576, 32
SRC_PAGES = [3, 17, 8, 0, 30]
DST_PAGES = [9, 2, 31, 14, 5]
ROOM, SEED, SRC_AUX, DST_AUX = 1, 7, 2, 4


def publish(mode: str, port: int, backend: str = "kvbridge", host: str = "127.0.0.1", **parallel) -> object:
    """Loads the plugins and publishes this process's ServerArgs, as SGLang's scheduler does
    (``host`` is the server's ``--host``: a prefill registers at the bootstrap server there)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.runtime_context import publish as sglang_publish
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    args = ServerArgs(
        model_path="dummy",
        host=host,
        device="cpu",
        disaggregation_mode=mode,
        disaggregation_transfer_backend=backend,
        disaggregation_bootstrap_port=port,
    )
    sglang_publish(args, role="test")
    # One rank of one process: SGLang's scheduler states these when it builds its groups.
    ranks = dict(tp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, dp_rank=0, pp_rank=0)
    ranks.update(parallel)
    get_parallel().override_permanently(pp_group=None, **ranks)
    return args


def classes(backend: str = "kvbridge"):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    return {t.name: get_kv_class(TransferBackend(backend), t) for t in KVClassType}


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

    def kv_args(self, page_size: int, engine_rank: int = 0):
        """SGLang's ``KVArgs`` for an MLA pool in these buffers (what the scheduler builds)."""
        from sglang.srt.disaggregation.base import KVArgs

        a = KVArgs()
        a.engine_rank, a.pp_rank, a.system_dp_rank, a.rust_http_port = engine_rank, 0, 0, None
        a.kv_cache_dtype_str, a.kv_layout = "auto", None
        a.prefill_start_layer, a.prefill_end_layer = 0, self.layers
        a.kv_data_ptrs = [b.ctypes.data for b in self.kv]
        a.kv_data_lens = [b.nbytes for b in self.kv]
        a.kv_item_lens = [self.page_bytes] * self.layers
        a.num_draft_entries = 0
        a.kv_layer_ids = list(range(self.layers))
        a.page_size = page_size
        a.aux_data_ptrs = [self.aux.ctypes.data]
        a.aux_data_lens = [self.aux.nbytes]
        a.aux_item_lens = [self.aux_bytes]
        a.ib_device, a.gpu_id = None, 0
        # No state pools (Mamba, SWA, DSA): what setup_state_kv_args writes for plain KV.
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        a.state_dim_per_tensor, a.state_slice_outer_counts, a.state_layer_ids = [], [], []
        a.is_hybrid_mla_backend, a.state_conv_shard_groups = False, []
        a.swa_kv_cache_layout, a.mla_compression_ratios = None, None
        return a


def wait_state(obj, want, what: str, timeout: float):
    """Polls a sender or receiver until ``want``; raises SGLang's KVTransferError on Failed."""
    from sglang.srt.disaggregation.base import KVPoll

    end = time.monotonic() + timeout
    while True:
        state = obj.poll()
        if state == want:
            return
        if state == KVPoll.Failed:
            obj.failure_exception()
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: still {KVPoll(state).name} after {timeout} s")
        time.sleep(0.01)


def run_prefill(port: int, timeout: float, host: str = "127.0.0.1") -> None:
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    args = publish("prefill", port, host=host)
    cls = classes()
    server = cls["BOOTSTRAP_SERVER"](host, port)
    pool = Pool(LAYERS, PAGES, PAGE_SIZE * TOKEN_BYTES).fill(SEED)
    manager = cls["MANAGER"](pool.kv_args(PAGE_SIZE), DisaggregationMode.PREFILL, args, True)
    sender = cls["SENDER"](manager, f"{host}:{port}", ROOM)
    sender.init(len(SRC_PAGES), aux_index=SRC_AUX)
    wait_state(sender, KVPoll.WaitingForInput, "prefill: the decode's request", timeout)
    sender.send(np.asarray(SRC_PAGES, dtype=np.int32))
    wait_state(sender, KVPoll.Success, "prefill: the transfer", timeout)
    print(f"prefill: room {ROOM}: {len(SRC_PAGES)} pages of {LAYERS} layers sent", flush=True)
    # The decode reads its Success from this process's status message; give it time to.
    time.sleep(1.0)
    server.close()


def run_decode(port: int, timeout: float, host: str = "127.0.0.1") -> None:
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    args = publish("decode", port)
    cls = classes()
    pool = Pool(LAYERS, PAGES, PAGE_SIZE * TOKEN_BYTES)
    manager = cls["MANAGER"](pool.kv_args(PAGE_SIZE), DisaggregationMode.DECODE, args, True)
    addr = f"{host}:{port}"
    end = time.monotonic() + timeout
    while not manager.try_ensure_parallel_info(addr):  # the prefill registered itself
        if time.monotonic() > end:
            raise TimeoutError(f"decode: no prefill registered at {addr} after {timeout} s")
        time.sleep(0.1)
    receiver = cls["RECEIVER"](manager, addr, ROOM)
    receiver.init(0)
    receiver.send_metadata(np.asarray(DST_PAGES, dtype=np.int32), aux_index=DST_AUX)
    wait_state(receiver, KVPoll.Success, "decode: the transfer", timeout)
    want = Pool(LAYERS, PAGES, PAGE_SIZE * TOKEN_BYTES)
    src = Pool(LAYERS, PAGES, PAGE_SIZE * TOKEN_BYTES).fill(SEED)
    for w, s in zip(want.kv, src.kv):
        w[DST_PAGES] = s[SRC_PAGES]
    want.aux[DST_AUX] = src.aux[SRC_AUX]
    for layer, (w, got) in enumerate(zip(want.kv, pool.kv)):
        if not np.array_equal(w, got):
            raise SystemExit(f"decode: layer {layer} differs from what the prefill sent")
    if not np.array_equal(want.aux, pool.aux):
        raise SystemExit("decode: the aux rows differ from what the prefill sent")
    print(f"decode: room {ROOM}: every byte verified", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge_sglang.example", description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--port", type=int, default=8998, help="SGLang's bootstrap port (both sides)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each step")
    parser.add_argument(
        "--bootstrap-host", default="127.0.0.1",
        help="the prefill's address: where its bootstrap server listens and the decode asks (both sides)",
    )
    a = parser.parse_args(argv)
    (run_prefill if a.role == "prefill" else run_decode)(a.port, a.timeout, a.bootstrap_host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
