"""``SidecarConnector``: vLLM's KV connector that hands every KV transfer to the node's kvsidecar.

Loaded by vLLM with::

    {"kv_connector": "SidecarConnector", "kv_connector_module_path": "engine_shim.vllm.connector",
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "engine_id": "<stable id>",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"sidecar_socket": "/run/kvsidecar/engine.sock", "transfer_mode": "pull"}}

What it owns (and nothing else: NIXL, handshakes, leases and heartbeats live in the sidecar):

- **Worker role** (one instance per TP/PP rank, in vLLM's worker process): the KV cache's shared
  memory, its registration with the sidecar (``RegisterWorker``), and that rank's events (a
  WatchEvents call on its engine session stream, ``engine_shim.events``; the WatchEvents RPC with
  an older sidecar). Completions are put on a local queue by the stream's reader thread; vLLM's
  per-step calls (``get_transfer_results``, ``get_block_ids_with_load_errors``) only read that queue.
- **Scheduler role** (one instance per engine, in the EngineCore process): request-level calls
  (``SubmitBlocks``, ``Pull``, ``ExpectPush``, ``Release``) issued as gRPC futures, so
  ``schedule()`` never waits on the sidecar, and vLLM's ``kv_transfer_params`` with their usual
  keys and meanings (``remote_host``/``remote_port`` name the producer's *sidecar*).

Threads:
- vLLM's scheduler thread calls every scheduler-role method; gRPC callback threads complete the
  futures and only append to the scheduler roles' deques or set plain flags;
- vLLM's worker thread calls every worker-role method; the ``EventWatcher``'s reader thread (the
  session's ``kvsidecar-session``, or its own on the WatchEvents fallback) puts events on
  ``WorkerSide._inbox``; a supervisor thread re-registers after the
  stream closes (a restarted sidecar) and announces it through the same queue, so all request
  state of the worker is touched by vLLM's worker thread only.

How failures reach vLLM: a request call the sidecar refused (or a sidecar that is down) is
reported by the scheduler to the workers in the next step's metadata; the workers put the
request in ``finished_recving`` *and* ``failed_recving`` (and its blocks in the load-error set when
block ids are unambiguous), so with ``kv_load_failure_policy="recompute"`` vLLM recomputes the
prompt. A closed event stream fails every receive the worker waits for and frees every block it
was holding for a consumer, so vLLM never waits on a dead sidecar.

The parts, one module each in this package: ``config`` (``kv_connector_extra_config``),
``metadata`` (scheduler -> worker, each step), ``scheduler`` (``SchedulerSide``, dispatching to D's
``receive`` and P's ``send``, which share ``link``), ``worker`` (``WorkerSide``), ``kv_memory`` (the
KV cache in shared memory), ``compat`` (versions, ranks, layout, compatibility factors), ``stats``
(vLLM's stat loggers and ``/metrics``). This module is the facade
vLLM loads; ``engine_shim.vllm_connector`` re-exports it for existing ``kv_connector_module_path``
settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.logger import init_logger

from engine_shim.vllm import stats
from engine_shim.vllm.compat import REQUIRED_LAYOUT, check_groups, compat_factors
from engine_shim.vllm.config import ShimConfig
from engine_shim.vllm.engine_spin import cap_busy_loop
from engine_shim.vllm.metadata import SidecarConnectorMetadata
from engine_shim.vllm.scheduler import SchedulerSide
from engine_shim.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.kvsidecar.connector")


class SidecarConnector(KVConnectorBase_V1, SupportsHMA):
    """Delegates to ``SchedulerSide`` or ``WorkerSide`` by role (see the module doc)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        if transfer.engine_id is None:
            raise ValueError("SidecarConnector needs kv_transfer_config.engine_id")
        self.config = ShimConfig.from_vllm(vllm_config)
        check_groups(kv_cache_config)
        cap_busy_loop(self.config.engine_busy_loop)
        if transfer.kv_load_failure_policy != "recompute" and transfer.is_kv_consumer:
            logger.warning(
                "SidecarConnector: kv_load_failure_policy=%r: a failed KV load fails the request; set "
                "'recompute' to have vLLM compute the prompt instead",
                transfer.kv_load_failure_policy,
            )
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(vllm_config, kv_cache_config, self.config)
        else:
            self.worker_side = WorkerSide(vllm_config, kv_cache_config, self.config)
        try:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource

            self._cache_hit_source = CacheHitSource.P2P
        except Exception:
            pass

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Block-contiguous per layer, so one block of one layer is one descriptor (as NIXL asks).
        model = vllm_config.model_config
        if model is None or model.use_mla:
            return None
        return REQUIRED_LAYOUT

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-role method was called on a worker"
        return self.scheduler_side

    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-role method was called on the scheduler"
        return self.worker_side

    # worker role -------------------------------------------------------------------------------

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        return self._worker().get_mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # transfers complete between steps; nothing is loaded layer by layer

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # the sidecar reads the blocks in place; nothing is saved

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self._worker().get_transfer_results()
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker().get_transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # vLLM asks both roles: workers see transfer outcomes, the scheduler multi-turn lookups.
        if self.worker_side is not None:
            return self.worker_side.stats.take()
        return self._scheduler().take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return stats.build(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return stats.SidecarPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()

    # scheduler role ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_push_work()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # Every transfer group is written by the sidecar: vLLM must not zero those blocks.
        return tuple(self._kv_cache_config.transfer_group_ids)


__all__ = ["ShimConfig", "SidecarConnector", "SidecarConnectorMetadata", "compat_factors"]
