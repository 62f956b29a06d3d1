"""Test infrastructure only: an ``sglang.srt.plugins`` entry point that the real-server tests
put on ``PYTHONPATH`` (next to the ``sgl_kernel`` stand-in and this directory's
``kvbridge_serving_tests-0.dist-info``, which is how ``importlib.metadata`` finds the entry
point without installing anything). SGLang runs it in each of its processes. The plugin
``kvbridge_sglang`` needs none of it.

What it does:

- **MLA on CPU** (always): registers ``torch_native`` in SGLang's DeepSeek attention
  dispatch (``AttentionBackendRegistry``) with SGLang's own MLA chooser. Unregistered,
  ``torch_native`` falls back to the triton handler, which picks the MHA prefill and fails
  with a shape error for an MLA model on CPU.
- **The damaged-KV control** (``KVBRIDGE_SERVING_DAMAGE_ROOMS=<first room>``, prefill only):
  for a room in ``[first room, first room + ROOMS_PER_MARK)``, the layer-0 KV (K and V, or the
  latent vector for MLA) of the pages about to be sent is zeroed in the prefill's pool just
  before the sender hands them to the transfer backend. For a prompt of one prefill chunk (the
  tests' control) the prefill has computed its first token by then, from intact KV; the decode
  receives layer 0 damaged, so its tokens must differ if the comparison means anything. (A
  later chunk of a longer prompt would read the zeroed pages too.) Other rooms are untouched.
- **A slow sender** (``KVBRIDGE_SERVING_SLOW_ROOMS=<first room>:<seconds>``, prefill only): a
  room in such a range from that value waits that long after each chunk is handed over (and
  says so in the log), so that an abort sent after the first such line lands while the
  request's transfer is under way.
- **Mooncake on CPU** (``KVBRIDGE_SERVING_MOONCAKE_HOST_INDICES=0``): SGLang's
  ``MooncakeKVSender`` declares ``supports_host_tensor_indices = True``, which sends SGLang's
  prefill down a pinned-memory + CUDA-event path that cannot run without a GPU. Turned off here
  so that the latency comparison can run SGLang's Mooncake backend on this CPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

logger = logging.getLogger(__name__)

DAMAGE_ENV = "KVBRIDGE_SERVING_DAMAGE_ROOMS"
SLOW_ENV = "KVBRIDGE_SERVING_SLOW_ROOMS"
MOONCAKE_ENV = "KVBRIDGE_SERVING_MOONCAKE_HOST_INDICES"
# Each mark covers the rooms [first room, first room + ROOMS_PER_MARK).
ROOMS_PER_MARK = 2**59

_installed = False


def register() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    _register_mla_dispatch()
    if os.environ.get(MOONCAKE_ENV) == "0":
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

        MooncakeKVSender.supports_host_tensor_indices = False
    if os.environ.get(DAMAGE_ENV) or os.environ.get(SLOW_ENV):
        _wrap_kvbridge_send()


def _register_mla_dispatch() -> None:
    from sglang.srt.models.deepseek_common import attention_backend_handler as handler

    handler.AttentionBackendRegistry.register("torch_native", handler._dispatch_mla_subtype)


def _layer0_entries(kv_args, is_mla: bool) -> list[int]:
    """Indices into ``kv_data_ptrs`` of layer 0: its latent buffer (MLA), or its K and V
    buffers (SGLang lists every layer's K, then every layer's V)."""
    n = len(kv_args.kv_data_ptrs) - (kv_args.num_draft_entries or 0)
    return [0] if is_mla else [0, n // 2]


def _zero_pages(kv_args, entries: list[int], pages) -> None:
    for e in entries:
        base, item = int(kv_args.kv_data_ptrs[e]), int(kv_args.kv_item_lens[e])
        for p in pages:
            ctypes.memset(base + int(p) * item, 0, item)


def _marked(room: int, first) -> bool:
    return first is not None and first <= room < first + ROOMS_PER_MARK


def _wrap_kvbridge_send() -> None:
    from kvbridge_sglang.conn import KvbridgeKVSender

    damage_from = int(os.environ.get(DAMAGE_ENV) or 0) or None
    slow = os.environ.get(SLOW_ENV)
    slow_from, slow_s = (int(slow.split(":")[0]), float(slow.split(":")[1])) if slow else (None, 0.0)
    send = KvbridgeKVSender.send

    def send_for_tests(self, kv_indices, *args, **kwargs):
        room = int(self.bootstrap_room)
        slow_room = _marked(room, slow_from)
        if _marked(room, damage_from):
            mgr = self.kv_mgr
            pages = [int(p) for p in kv_indices]
            _zero_pages(mgr.kv_args, _layer0_entries(mgr.kv_args, mgr.is_mla_backend), pages)
            logger.warning("kvbridge_serving_tests: room %d: layer 0 of %d pages zeroed", room, len(pages))
        result = send(self, kv_indices, *args, **kwargs)
        if slow_room:
            # The test waits for this line, then aborts: the later chunks are still to come.
            logger.warning("kvbridge_serving_tests: room %d: a chunk of %d pages handed over", room, len(kv_indices))
            time.sleep(slow_s)
        return result

    KvbridgeKVSender.send = send_for_tests
