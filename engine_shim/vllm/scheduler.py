"""The scheduler role: request-level decisions of one engine (one instance, in the EngineCore process).

``SchedulerSide`` is what ``SidecarConnector`` (``engine_shim.vllm.connector``) calls on vLLM's
scheduler hooks: a small dispatcher over the two roles an engine plays, each in its own module
with its own state:

- **receive** (``engine_shim.vllm.receive``, D): ``KeepAlive`` while a consumer request waits,
  ``get_num_new_matched_tokens``, ``update_state_after_alloc`` (``Pull`` / ``ExpectPush``), load
  outcomes; a prefill engine's loads of earlier turns (multi-turn) too;
- **send** (``engine_shim.vllm.send``, P): ``request_finished`` of a producer request
  (``SubmitBlocks``, pull vouchers), a decode engine's holds for the next turn (multi-turn);

over what both share, this class's base ``SidecarLink`` (``engine_shim.vllm.link``: the client,
the sidecar's address and whether it is down). Request calls are issued as gRPC futures, so
``schedule()`` does not wait on the sidecar, with one exception: an inline load's ``Pull``, whose
answer must reach the workers in the same step's metadata. vLLM's ``kv_transfer_params`` keep their
usual keys and meanings (``remote_host``/``remote_port`` name the producer's *sidecar*).

Threads: vLLM's scheduler thread calls every method here. gRPC callback threads complete the
futures and only append to the roles' deques or set plain flags (see each module). Whichever thread
puts on the EngineCore's input queue (vLLM's input thread) also sends the workers' wake-ups
(``input_wake``), which holds no state of this class.

How failures reach vLLM: a request call the sidecar refused (or a sidecar that is down) is
reported to the workers in the next step's metadata (``SidecarConnectorMetadata.recv_failed`` /
``send_abandoned``), see ``engine_shim.vllm.worker``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from engine_shim.vllm import multiturn
from engine_shim.vllm.compat import data_parallel_rank
from engine_shim.vllm.config import ShimConfig
from engine_shim.vllm.link import SidecarLink
from engine_shim.vllm.metadata import SidecarConnectorMetadata
from engine_shim.vllm.receive import Receiver, inline_possible
from engine_shim.vllm.send import Sender
from engine_shim.vllm.stats import SidecarKVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.kvsidecar.scheduler")


class SchedulerSide(SidecarLink):
    """Request-level decisions; runs on vLLM's scheduler thread (see module doc)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ShimConfig) -> None:
        super().__init__(vllm_config, kv_cache_config, config, data_parallel_rank(vllm_config))
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        # --- multi-turn hook (engine_shim.vllm.multiturn): P loads earlier turns from D's holds; a
        # decode engine (kv_consumer / kv_both) holds its finished requests for the next turn.
        turns = multiturn.MultiTurnConfig.from_extra(transfer.kv_connector_extra_config or {})
        prefix_caching = bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))
        self.multiturn = (
            multiturn.MultiTurn(turns, self.client, self.engine_id, self.block_size, prefix_caching=prefix_caching)
            if turns.enabled
            else None
        )
        holds_turns = self.multiturn is not None and transfer.kv_role in ("kv_consumer", "kv_both")
        # A kv_producer's sidecar refuses its Pull: looking up holds would only delay its prompts.
        loads_turns = self.multiturn is not None and transfer.kv_role != "kv_producer"
        if self.multiturn is not None and not loads_turns:
            logger.warning(
                "SidecarConnector: multi_turn on a kv_producer engine: it cannot load earlier turns (its sidecar "
                "refuses a producer's Pull), so it does not look for them; give the prefill engine kv_role kv_both"
            )
        inline = inline_possible(vllm_config, kv_cache_config, config)
        self.receiver = Receiver(self, self.multiturn, loads_turns, inline)
        self.sender = Sender(self, self.multiturn, holds_turns)
        # Tokens this engine was told to load from outside, per request (bounded; for observability).
        self.external_tokens = self.receiver.external_tokens
        self._connect()

    # vLLM scheduler thread: D's hooks ------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self.receiver.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.receiver.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.receiver.update_state_after_alloc(request, blocks, num_external_tokens)

    # vLLM scheduler thread: both roles -----------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A consumer request's end is D's (vLLM frees its blocks now); any other is P's: offer the
        blocks to a consumer or hold them for the next turn (True, params), or free them."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if self.receiver.request_finished(request, params):
            return False, None
        return self.sender.request_finished(request, params, block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SidecarConnectorMetadata:
        meta = SidecarConnectorMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        self.receiver.build_meta(meta)
        self.sender.build_meta(meta)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.finished_recving:
            self.receiver.finished_recving(connector_output.finished_recving)
        if connector_output.finished_sending:
            self.sender.finished_sending(connector_output.finished_sending)

    def take_stats(self) -> SidecarKVConnectorStats | None:
        """This interval's multi-turn lookup outcomes for vLLM's stat loggers (None: nothing new)."""
        if self.multiturn is None:
            return None
        outcomes, tokens_loaded, waits = self.multiturn.take_stats()
        if not outcomes and not tokens_loaded:
            return None
        taken = SidecarKVConnectorStats()
        taken.record_lookups(outcomes, tokens_loaded, waits)
        return taken

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping while failures wait for delivery or pushed blocks wait for their
        # WRITEs (vLLM's push semantics); pulled blocks are freed at the next step, as in vLLM.
        return self.receiver.has_pending_work() or self.sender.has_pending_work()
