"""``KvbridgeConnector``: vLLM's ``KVConnectorBase_V1`` over kvbridge (docs/vllm.md).

Load it with ``--kv-transfer-config '{"kv_connector": "KvbridgeConnector",
"kv_connector_module_path": "kvbridge_vllm.connector", "kv_role": "kv_producer"}'`` on the
prefill and ``"kv_role": "kv_consumer"`` on the decode. The flow is vLLM's usual one: a
request goes to the prefill with ``kv_transfer_params: {"do_remote_decode": true}``; when it
finishes, the prefill holds its blocks (vLLM's delayed free) and answers with the
``kv_transfer_params`` the same request then takes to the decode, whose blocks kvbridge fills;
the prefill frees its blocks once the transfer ended, either way, by kvbridge's deadlines.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvbridge_vllm.scheduler import Scheduled, SchedulerState, Work, traceparent
from kvbridge_vllm.settings import Settings
from kvbridge_vllm.worker import Geometry, Worker, check_context_parallel, head_major_blocks

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclasses.dataclass
class KvbridgeMetadata(KVConnectorMetadata):
    """One step's work, from the scheduler to the workers."""

    work: Work


def _scheduled(out: "SchedulerOutput") -> list:
    """This step's requests as :class:`~kvbridge_vllm.scheduler.Scheduled` (KV cache group 0)."""
    counts = out.num_scheduled_tokens
    steps = [
        Scheduled(r.req_id, tuple(r.block_ids[0]) if r.block_ids else (), True, r.num_computed_tokens + counts.get(r.req_id, 0))
        for r in out.scheduled_new_reqs
    ]
    cached = out.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None) or set()
    for i, req_id in enumerate(cached.req_ids):
        new = cached.new_block_ids[i]
        steps.append(
            Scheduled(req_id, tuple(new[0]) if new else None, req_id in resumed, cached.num_computed_tokens[i] + counts.get(req_id, 0))
        )
    return steps


def _completed(request: "Request") -> bool:
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class KvbridgeConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: Optional["KVCacheConfig"] = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._settings = Settings.from_extra(transfer.kv_connector_extra_config)
        producer, consumer = transfer.is_kv_producer, transfer.is_kv_consumer
        if producer == consumer:
            raise ValueError(
                f"KvbridgeConnector runs as kv_producer (the prefill) or kv_consumer (the "
                f"decode), not kv_role={transfer.kv_role!r}"
            )
        self._producer = producer
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        self._dcp_size = parallel.decode_context_parallel_size
        check_context_parallel(
            self._dcp_size,
            getattr(parallel, "prefill_context_parallel_size", 1),
            getattr(parallel, "cp_kv_cache_interleave_size", 1),
            bool(getattr(vllm_config.model_config, "use_mla", False)),
        )
        # Each rank's physical block; vLLM's scheduler counts blocks of block_size * DCP.
        self._block_size = vllm_config.cache_config.block_size
        self._scheduler: Optional[SchedulerState] = None
        self._worker: Optional[Worker] = None
        #: The step whose work the worker has taken (vLLM 0.32 calls start_load_kv after the
        #: forward pass has begun, so the first of the step's calls takes it).
        self._started: Optional[KvbridgeMetadata] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerState(
                self._settings, self._block_size, self._tp_size, producer, equal_blocks=head_major_blocks(vllm_config)
            )

    # --- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]"):
        from vllm.distributed.parallel_state import get_dcp_group, get_tensor_model_parallel_rank

        model = self._vllm_config.model_config
        tensor = next(iter(kv_caches.values()))
        geometry = Geometry(
            block_size=self._block_size,
            num_blocks=self._kv_cache_config.num_blocks if self._kv_cache_config else tensor.shape[0],
            total_kv_heads=model.get_total_num_kv_heads(),
            head_size=model.get_head_size(),
            tp_size=self._tp_size,
            tp_rank=get_tensor_model_parallel_rank(),
            dtype=str(tensor.dtype).removeprefix("torch."),
            mla=bool(getattr(model, "use_mla", False)),
            dcp_size=self._dcp_size,
            dcp_rank=get_dcp_group().rank_in_group if self._dcp_size > 1 else 0,
        )
        self._worker = Worker(self._settings, self._producer, geometry)
        self._worker.register(kv_caches)

    def _start_step(self) -> None:
        """Hands the worker this step's work, once, from whichever of the step's calls comes
        first: ``start_load_kv`` runs after the forward pass began unless a load is
        synchronous, and ``save_kv_layer`` of the first layer may come before it."""
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvbridgeMetadata) and meta is not self._started:
            self._started = meta
            self._worker.start(meta.work)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._start_step()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # The decode's KV lands before vLLM schedules the request (an asynchronous load).
        return

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        # The concurrent flow's prefill posts this layer's rows of every streamed request.
        if self._worker is not None:
            self._start_step()
            self._worker.layer_computed(layer_name)

    def wait_for_save(self):
        # Whatever this step's streams still owe (every layer, with layerwise off) is posted.
        if self._worker is not None:
            self._start_step()
            self._worker.forward_ended()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict) -> bool:
        # save_kv_layer runs between the layers: a whole-model CUDA graph would skip it.
        return True

    def get_transfer_results(self, finished_req_ids: set) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        sent, received, failed = self._worker.results()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received | failed, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set) -> tuple:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # --- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(
            request.request_id, request.kv_transfer_params, num_computed_tokens, request.num_prompt_tokens
        )

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        assert self._scheduler is not None
        self._scheduler.after_alloc(
            request.request_id,
            request.kv_transfer_params,
            blocks.get_block_ids()[0],
            num_external_tokens,
            request.num_prompt_tokens,
            traceparent(getattr(request, "trace_headers", None)),
        )

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        if self._producer:
            self._scheduler.scheduled(_scheduled(scheduler_output), scheduler_output.preempted_req_ids)
        return KvbridgeMetadata(self._scheduler.take_work())

    def update_connector_output(self, connector_output):
        assert self._scheduler is not None
        self._scheduler.transfers_ended(connector_output.finished_sending, connector_output.finished_recving)

    def request_finished(self, request: "Request", block_ids: list) -> tuple:
        assert self._scheduler is not None
        return self._scheduler.finished(
            request.request_id,
            request.kv_transfer_params,
            _completed(request),
            block_ids,
            request.num_computed_tokens,
            traceparent(getattr(request, "trace_headers", None)),
        )

    def has_pending_push_work(self) -> bool:
        # The prefill writes into the decode: vLLM must keep stepping (the workers poll the
        # rooms) until every held request's transfer ended.
        return self._scheduler is not None and self._scheduler.sends_pending()
