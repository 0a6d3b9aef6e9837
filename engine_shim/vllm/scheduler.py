"""The scheduler role: request-level decisions of one engine (one instance, in the EngineCore process).

Request calls (``SubmitBlocks``, ``Pull``, ``ExpectPush``, ``KeepAlive``, ``Release``) are issued as
gRPC futures, so ``schedule()`` does not wait on the sidecar, with one exception: an inline load's
``Pull`` (``_loads_inline``), whose answer must reach the workers in the same step's metadata, on
an engine that has nothing else to compute. vLLM's ``kv_transfer_params`` keep their usual keys and
meanings (``remote_host``/``remote_port`` name the producer's *sidecar*).

Threads: vLLM's scheduler thread calls every method and owns every dict and set here. gRPC
callback threads complete the futures and only append to the deques ``_failures`` and
``_lost_news`` or set plain flags (``_down``, ``_address``); the scheduler thread drains the deques.
Whichever thread puts on the EngineCore's input queue (vLLM's input thread) also sends the workers'
wake-ups through ``_input_waker`` (``input_wake``), which holds no state of this class.

How failures reach vLLM: a request call the sidecar refused (or a sidecar that is down) is
reported to the workers in the next step's metadata (``SidecarConnectorMetadata.recv_failed`` /
``send_abandoned``), see ``engine_shim.vllm.worker``.

Why ~520 lines: one state machine over vLLM's scheduler hooks (its helpers for kv_transfer_params
are already in ``params``); multi-turn decisions (pull a held prefix or recompute, hold a finished
turn) are in ``multiturn.py`` next to it, called from small marked hooks here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from vllm.logger import init_logger

from engine_shim.client import Future, SidecarClient, remote
from engine_shim.vllm import multiturn
from engine_shim.vllm.compat import data_parallel_rank
from engine_shim.vllm.config import MODES, BlockIds, ShimConfig
from engine_shim.vllm.input_wake import InputWaker, engine_input_queue, socket_name, wake_workers_on_input
from engine_shim.vllm.metadata import SidecarConnectorMetadata
from engine_shim.vllm.params import flat, grouped, peer_address, split_address, voucher_of
from engine_shim.vllm.stats import SidecarKVConnectorStats
from kvsidecar import voucher
from kvsidecar.voucher import PARAM_VOUCHED_UNTIL_MS, PARAM_VOUCHER

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.kvsidecar.scheduler")


# An inline load's Pull bound (pull_timeout, if lower): the sidecar ends the Pull by then, so the
# step's forward, with the rest of the engine, waits about that long at most. A failed or late load
# is recomputed.
INLINE_PULL_TIMEOUT = 2.0

# Status codes with which the sidecar refused a request call before starting anything: the request
# can fail at once. Any other error (a deadline, a cancelled call) leaves it unknown whether the
# sidecar accepted the call, so the shim first asks it to release the request (see SchedulerSide).
_REFUSED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)


class _FutureLike(Protocol):
    """A gRPC future, or a plain future standing for a call issued later (see _after_keep_alive)."""

    def add_done_callback(self, fn: Callable[[Any], object]) -> None: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...

    def result(self, timeout: float | None = None) -> Any: ...

    def done(self) -> bool: ...


def _copy_outcome(source: Future[Any], target: concurrent.futures.Future[Any]) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def _ignore(future: _FutureLike) -> None:
    """Done-callback of a best-effort call: consume its outcome (gRPC logs unretrieved errors)."""
    future.exception()


def _inline_possible(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ShimConfig) -> bool:
    """Whether this engine may load inline at all (``SchedulerSide._loads_inline``)."""
    if config.inline_load_max_tokens <= 0:
        return False
    if len(kv_cache_config.kv_cache_groups) != 1:
        return False  # vLLM maps a failed synchronous load back to requests by block id only then
    if getattr(getattr(vllm_config, "parallel_config", None), "decode_context_parallel_size", 1) > 1:
        return False  # a block spans block_size x DCP tokens there: the block list would be wrong
    if getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False):
        # The next step is scheduled before this one's outcome: a failed load's request would
        # already have its next token scheduled over the KV it lacks.
        logger.warning("SidecarConnector: inline_load_max_tokens ignored: vLLM schedules asynchronously")
        return False
    return True


def _rpc_error(exc: BaseException) -> tuple[grpc.StatusCode | None, str]:
    if isinstance(exc, grpc.RpcError):
        code = exc.code()
        return code, f"{code.name}: {exc.details()}"
    return None, repr(exc)


@dataclass
class _Receive:
    """A consumer request whose KV the sidecar is fetching."""

    request_id: str
    transfer_id: str
    blocks: list[int]
    future: _FutureLike
    aborted: bool = False


class SchedulerSide:
    """Request-level decisions; runs on vLLM's scheduler thread (see module doc)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ShimConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None and transfer.engine_id is not None
        self.engine_id: str = transfer.engine_id
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self._kv_cache_config = kv_cache_config
        self._transfer_groups = tuple(kv_cache_config.transfer_group_ids)
        self._all_groups = len(self._transfer_groups) == len(kv_cache_config.kv_cache_groups)
        self._inline_possible = _inline_possible(vllm_config, kv_cache_config, config)
        self._last_step_idle = True  # the last step computed nothing (build_connector_meta)
        # This step's inline load, chosen in get_num_new_matched_tokens: request id -> its local
        # prefix hit (tokens, block-aligned); cleared at the end of the step.
        self._inline: dict[str, int] = {}
        self._new_inline: dict[str, float] = {}  # for the metadata: request id -> workers' wait bound
        self.client = SidecarClient(config.sidecar_socket, timeout=config.rpc_timeout)
        self._input_waker = self._wake_idle_workers_on_input(data_parallel_rank(vllm_config))
        # This sidecar's PeerService address, returned to routers as remote_host/remote_port.
        self._address: str | None = None
        self._address_future: Future[Any] | None = None
        self._down = False  # the channel is in TRANSIENT_FAILURE / SHUTDOWN
        self._receives: dict[str, _Receive] = {}
        # Consumer requests whose producer lease the sidecar keeps alive until they are scheduled,
        # and those whose producer already said it no longer holds the KV (recompute them).
        self._arrived: dict[str, Request] = {}
        self._kept_alive: dict[str, Future[Any]] = {}
        self._producer_lost: set[str] = set()
        # Filled by gRPC callback threads: request ids whose KeepAlive said the producer no longer
        # holds the KV; moved into _producer_lost on the scheduler thread (_take_lost_news).
        self._lost_news: collections.deque[str] = collections.deque()
        self._sends: set[str] = set()  # producer requests whose blocks the sidecar holds
        # Pull vouchers (kvsidecar.voucher): the key and terms from the sidecar's last SubmitBlocks
        # answer (set by gRPC callback threads; b"" until the first answer, or when vouchers are off),
        # and until when (monotonic) each vouched request's blocks must stay held even if its
        # submission fails: a consumer may read them without asking the sidecar.
        self._voucher_terms: tuple[bytes, float, float] = (b"", 0.0, 0.0)  # key, seconds, skew
        self._vouched_until: dict[str, float] = {}
        self._held_failures: list[tuple[str, str]] = []  # (request id, reason) of vouched sends that failed
        self._push_sends: set[str] = set()  # the subset a consumer's registration makes us WRITE
        # Announced to the workers in the next metadata, with the time.monotonic() of the request
        # call (CLOCK_MONOTONIC is node-wide, so workers compare it with their stream losses).
        self._new_receives: dict[str, tuple[float, list[int]]] = {}
        self._new_sends: dict[str, float] = {}
        # Filled by gRPC callback threads: ("recv" | "send", request id, reason).
        self._failures: collections.deque[tuple[str, str, str]] = collections.deque()
        # Tokens this engine was told to load from outside, per request (bounded; for observability).
        self.external_tokens: collections.OrderedDict[str, int] = collections.OrderedDict()
        # --- multi-turn hook (engine_shim.vllm.multiturn): P loads earlier turns from D's holds; a
        # decode engine (kv_consumer / kv_both) holds its finished requests for the next turn.
        turns = multiturn.MultiTurnConfig.from_extra(transfer.kv_connector_extra_config or {})
        prefix_caching = bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))
        self.multiturn = (
            multiturn.MultiTurn(turns, self.client, self.engine_id, self.block_size, prefix_caching=prefix_caching)
            if turns.enabled
            else None
        )
        self._holds_turns = self.multiturn is not None and transfer.kv_role in ("kv_consumer", "kv_both")
        # A kv_producer's sidecar refuses its Pull: looking up holds would only delay its prompts.
        self._loads_turns = self.multiturn is not None and transfer.kv_role != "kv_producer"
        if self.multiturn is not None and not self._loads_turns:
            logger.warning(
                "SidecarConnector: multi_turn on a kv_producer engine: it cannot load earlier turns (its sidecar "
                "refuses a producer's Pull), so it does not look for them; give the prefill engine kv_role kv_both"
            )
        self.client.subscribe_connectivity(self._on_connectivity)
        try:
            self._address = self.client.status_async().result(timeout=min(5.0, config.rpc_timeout)).sidecar.address
        except Exception as exc:
            logger.warning("SidecarConnector: sidecar at %s not reachable yet (%s)", config.sidecar_socket, exc)

    def shutdown(self) -> None:
        try:
            self.client.unsubscribe_connectivity(self._on_connectivity)
        except Exception:
            pass
        self.client.close()
        if self._input_waker is not None:
            self._input_waker.close()

    def _wake_idle_workers_on_input(self, dp_rank: int) -> InputWaker | None:
        """Have everything that reaches this EngineCore end its workers' idle waits (input_wake)."""
        if self.config.idle_wait <= 0:
            return None
        input_queue = engine_input_queue()
        if input_queue is None:
            logger.info("SidecarConnector: no EngineCore input queue found; idle steps end at idle_wait")
            return None
        names = [
            socket_name(self.engine_id, dp_rank, tp, pp) for pp in range(self.pp_size) for tp in range(self.tp_size)
        ]
        waker = InputWaker(names)
        try:
            wake_workers_on_input(input_queue, waker)
        except TypeError as exc:
            waker.close()
            logger.warning("SidecarConnector: idle steps end only at idle_wait (%s)", exc)
            return None
        logger.info("SidecarConnector: input to the EngineCore wakes %d idle worker(s)", len(waker.names))
        return waker

    @property
    def offers_kv(self) -> bool:
        """Whether a finished prefill is offered to consumers now: the sidecar's channel is up and
        its peer address known (after a sidecar restart, once the channel reconnects)."""
        return self._address is not None and not self._down

    # gRPC threads ------------------------------------------------------------------------------

    def _on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        down = state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)
        if self._down and state == grpc.ChannelConnectivity.READY:
            self._address_future = None  # a restarted sidecar may listen elsewhere: ask again
            self._refresh_address()
        self._down = down

    def _refresh_address(self) -> None:
        if self._address_future is not None and not self._address_future.done():
            return
        future = self.client.status_async()
        self._address_future = future

        def done(f: Future[Any]) -> None:
            if f.exception() is None:
                self._address = f.result().sidecar.address

        future.add_done_callback(done)

    def _on_receive_call_done(self, request_id: str, transfer_id: str, what: str, future: _FutureLike) -> None:
        exc = future.exception()
        if exc is None:
            return  # accepted (or refused with a LOAD_FAILED event, which the workers get)
        code, text = _rpc_error(exc)
        reason = f"{what} failed: {text}"
        if code is None or code in _REFUSED:  # refused, or never sent (code None)
            self._failures.append(("recv", request_id, reason))
            return
        # Unknown whether the sidecar started fetching into our blocks: ask it to stop. If it knows
        # the request, its terminal event follows once nothing is in flight; otherwise fail here.
        logger.warning("SidecarConnector: %s for %s; releasing it on the sidecar", reason, request_id)
        release = self.client.release_async(self.engine_id, request_id, transfer_id, reason=reason[:200])

        def released(f: Future[Any]) -> None:
            if f.exception() is not None or not f.result().found:
                self._failures.append(("recv", request_id, reason))

        release.add_done_callback(released)

    def _on_submit_done(self, request_id: str, future: Future[Any], what: str = "SubmitBlocks") -> None:
        exc = future.exception()
        if exc is not None:
            _, text = _rpc_error(exc)
            # The blocks were never offered (or the sidecar is gone): vLLM may free them (a vouched
            # request's only once its voucher ran out, see build_connector_meta).
            self._failures.append(("send", request_id, f"{what} failed: {text}"))
        elif what == "SubmitBlocks":
            response = future.result()
            self._voucher_terms = (response.voucher_key, response.voucher_seconds, response.voucher_clock_skew_seconds)

    # vLLM scheduler thread ---------------------------------------------------------------------

    def _mode(self, params: Mapping[str, Any]) -> str:
        mode = params.get("transfer_mode")
        return mode if mode in MODES else self.config.transfer_mode

    def _transfer_blocks(self, block_ids: Sequence[Sequence[int]]) -> BlockIds:
        if self._all_groups:
            return tuple(list(group) for group in block_ids)
        return tuple(list(block_ids[group]) for group in self._transfer_groups)

    def on_new_request(self, request: Request) -> None:
        # A consumer request may wait here a while before it is scheduled; the producer's lease
        # must not run out meanwhile (vLLM's decode engines heartbeat from arrival). Requests still
        # waiting at the end of this step get a KeepAlive (see build_connector_meta).
        params = request.kv_transfer_params
        if (
            params
            and params.get("do_remote_prefill")
            and (params.get("remote_request_id") or params.get("transfer_id"))
        ):
            self._arrived[request.request_id] = request
        elif self._loads_turns and params and params.get("do_remote_decode") and not self._down:
            assert self.multiturn is not None
            self.multiturn.prefetch(request)  # multi-turn hook: ask for a hold while it waits

    def _keep_alive(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        address, engine = peer_address(params), params.get("remote_engine_id")
        if address is None or not engine or self._down:
            return
        request_id = request.request_id
        target = remote(
            address, str(engine), str(params.get("remote_request_id") or ""), tp_size=int(params.get("tp_size") or 0)
        )
        future = self.client.keep_alive_async(
            self.engine_id, request_id, target, transfer_id=str(params.get("transfer_id") or "")
        )
        self._kept_alive[request_id] = future

        def done(f: Future[Any]) -> None:
            # Errors (an older sidecar without KeepAlive, a sidecar that is down) change nothing:
            # the request call that follows reports its own failure.
            if f.exception() is None and not f.result().producer_holds:
                self._lost_news.append(request_id)

        future.add_done_callback(done)

    def _after_keep_alive(self, request_id: str, call: Callable[[], Future[Any]]) -> _FutureLike:
        """Issue ``call`` once the request's KeepAlive (if any) is answered, so the call that ends
        the keep-alive on the sidecar cannot overtake it and leave it running."""
        kept = self._kept_alive.pop(request_id, None)
        if kept is None or kept.done():
            return call()
        proxy: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def issue(_: Future[Any]) -> None:
            try:
                real = call()
            except Exception as exc:
                proxy.set_exception(exc)
                return
            real.add_done_callback(lambda f: _copy_outcome(f, proxy))

        kept.add_done_callback(issue)
        return proxy

    def _take_lost_news(self) -> None:
        """Move what KeepAlive callbacks reported into ``_producer_lost`` (scheduler thread). Only
        requests still kept alive count: for the others the request call has been issued already."""
        news = self._lost_news
        while news:
            request_id = news.popleft()
            if request_id in self._kept_alive:
                self._producer_lost.add(request_id)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        # --- multi-turn hook: a prefill leg may load earlier turns from a remote hold (None: ask again).
        if self._loads_turns and params and params.get("do_remote_decode") and not self._down:
            assert self.multiturn is not None
            return self.multiturn.matched_tokens(request, num_computed_tokens)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if not params.get("remote_engine_id") or peer_address(params) is None:
            logger.warning(
                "SidecarConnector: %s has incomplete kv_transfer_params %s; recomputing",
                request.request_id,
                params,
            )
            return 0, False
        self._take_lost_news()
        if self._down or request.request_id in self._producer_lost:
            # Our sidecar is down, or the producer no longer holds the KV: recompute now instead
            # of waiting for a failure.
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        if self._loads_inline(params, count):
            self._inline[request.request_id] = num_computed_tokens
            # The last prompt token is computed in the step, as after an asynchronous load.
            return count - 1, False
        return count, True

    def _loads_inline(self, params: Mapping[str, Any], count: int) -> bool:
        """Whether this request's KV loads inside the step that computes its first token (vLLM's
        synchronous load) instead of in steps of its own before it (asynchronous).

        An asynchronous load ends in a step that reports it; only the step after that computes
        the first token: one engine step (~3 ms with vLLM on the CPU) after the KV is in place. A
        synchronous load saves it, but the step's forward waits for the transfer, and with it every
        other request of the batch. So only on an engine that computed nothing in its last step,
        one request per step, up to ``inline_load_max_tokens`` (beyond, the transfer dwarfs a step,
        and it would hold the engine longer), and pull only: a pull's producer has finished (the
        router asked it first), so its READ starts at once, where a push may wait for a prefill."""
        return (
            self._inline_possible
            and self._last_step_idle
            and not (self._inline or self._new_inline)
            and 1 < count <= self.config.inline_load_max_tokens
            and self._mode(params) == "pull"
        )

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # --- multi-turn hook: pull the matched prefix of a remote hold into the new blocks.
        if self.multiturn is not None:
            held = self.multiturn.take_load(request, num_external_tokens)
            if held is not None:
                local = self._transfer_blocks(blocks.get_unhashed_block_ids_all_groups())
                pulling = self.client.pull_async(
                    self.engine_id, request.request_id, local, held, "", self.config.pull_timeout
                )
                self._track_receive(request.request_id, "", local, pulling, "Pull", num_external_tokens)
                return
        inline_prefix = self._inline.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        # One transfer per request, also when the request is rescheduled (vLLM's re-entry guard).
        params["do_remote_prefill"] = False
        self._arrived.pop(request.request_id, None)
        self._producer_lost.discard(request.request_id)
        address = peer_address(params)
        engine = params.get("remote_engine_id")
        if address is None or not engine:
            return
        mode = self._mode(params)
        request_id = request.request_id
        transfer_id = str(params.get("transfer_id") or "")
        if num_external_tokens <= 0:
            # Nothing to load (a full local prefix hit, or a recompute decision).
            self._fetch_nothing(request_id, params, "nothing to load")
            return
        if inline_prefix is None:
            # Blocks of an asynchronous load are cached only once it ends: the unhashed ones.
            local = self._transfer_blocks(blocks.get_unhashed_block_ids_all_groups())
        else:
            # A synchronous load's blocks are cached at allocation: those of the prompt but the
            # local prefix hit (not one allocated ahead for the first output token).
            skip, end = inline_prefix // self.block_size, -(-len(request.prompt_token_ids or ()) // self.block_size)
            local = self._transfer_blocks(tuple(group[skip:end] for group in blocks.get_block_ids()))
        pass_voucher, until_ms = voucher_of(params) if mode == "pull" else (b"", 0)
        target = remote(
            address,
            str(engine),
            str(params.get("remote_request_id") or ""),
            grouped(params.get("remote_block_ids")) if mode == "pull" else None,
            int(params.get("tp_size") or 0),
            int(params.get("remote_num_tokens") or 0),
            pass_voucher,
            until_ms,
        )
        # The Pull / ExpectPush also ends the sidecar's keep-alive of the request.
        client = self.client
        call: Callable[[], Future[Any]]
        pull_timeout = self.config.pull_timeout
        if inline_prefix is not None:
            pull_timeout = min(pull_timeout or INLINE_PULL_TIMEOUT, INLINE_PULL_TIMEOUT)
        if mode == "pull":
            call = partial(client.pull_async, self.engine_id, request_id, local, target, transfer_id, pull_timeout)
        else:
            call = partial(
                client.expect_push_async,
                self.engine_id,
                request_id,
                local,
                target,
                transfer_id,
                self.config.push_timeout,
            )
        future = self._after_keep_alive(request_id, call)
        what = "Pull" if mode == "pull" else "ExpectPush"
        inline = inline_prefix is not None
        self._track_receive(request_id, transfer_id, local, future, what, num_external_tokens, inline)
        if inline:
            self._await_inline_call(request_id, transfer_id, future)

    def _await_inline_call(self, request_id: str, transfer_id: str, future: _FutureLike) -> None:
        """Wait for an inline load's Pull to be answered, so that a refusal reaches the workers in
        this step's metadata (they wait for the load before the forward); it overlaps the READ,
        which the sidecar starts before it answers.

        The workers wait for the sidecar's outcome, which it sends by the Pull's bound, or for the
        end of their event stream (the sidecar died: nothing can write into the blocks any more).
        Not for less: a sidecar that is frozen (SIGSTOP, a hung host) may still complete a READ
        into the blocks when it resumes, and the forward would have used them. So a frozen
        sidecar holds the step until it resumes, or until ``recv_watchdog``, the last resort of
        asynchronous loads too."""
        self._new_inline[request_id] = self.config.recv_watchdog
        # The call (and a KeepAlive before it) carries the rpc_timeout deadline: an outcome comes.
        rpc_timeout = self.config.rpc_timeout
        try:
            exc = future.exception(timeout=2 * rpc_timeout + 1.0)
        except concurrent.futures.TimeoutError:
            # Not even sent yet (the RPC threads are backed up): fail it in this step, and have
            # the sidecar release it once the call ends, should it start the Pull after all.
            self._release_after(self._receives[request_id], "the inline load's Pull was not answered in time")
            self._failures.append(("recv", request_id, "Pull failed: not answered in time"))
            return
        except concurrent.futures.CancelledError as cancelled:  # the client is closing: never sent
            exc = cancelled
        if exc is None:
            return
        # As _on_receive_call_done (which inline loads skip), but decided within this step.
        code, text = _rpc_error(exc)
        if code is not None and code not in _REFUSED:
            # Unknown whether the sidecar started: ask it to stop. If it knew the request, its
            # terminal event reaches the workers; else no event comes, so fail it here.
            try:
                release = self.client.release_async(self.engine_id, request_id, transfer_id, reason=text[:200])
                if release.result(timeout=rpc_timeout + 1.0).found:
                    return
            except Exception:
                pass
        self._failures.append(("recv", request_id, f"Pull failed: {text}"))

    def _track_receive(
        self,
        request_id: str,
        transfer_id: str,
        local: BlockIds,
        future: _FutureLike,
        what: str,
        num_external: int,
        inline: bool = False,
    ) -> None:
        """A receive's request call was issued: its workers hear of it in the next metadata, and a
        failed call reaches them as a failed receive (an inline load's: ``_await_inline_call``)."""
        flat_blocks = flat(local)
        self._receives[request_id] = _Receive(request_id, transfer_id, flat_blocks, future)
        self._new_receives[request_id] = (time.monotonic(), flat_blocks)
        if not inline:
            future.add_done_callback(lambda f: self._on_receive_call_done(request_id, transfer_id, what, f))
        self.external_tokens[request_id] = num_external
        while len(self.external_tokens) > 4096:
            self.external_tokens.popitem(last=False)

    def _fetch_nothing(self, request_id: str, params: Mapping[str, Any], reason: str) -> None:
        """This consumer request will fetch nothing: the producer may free its blocks (pull mode),
        and the sidecar stops keeping the producer's lease alive."""
        if self._notify_only(request_id, params) or request_id not in self._kept_alive:
            return
        transfer_id = str(params.get("transfer_id") or "")
        release = partial(self.client.release_async, self.engine_id, request_id, transfer_id, reason)
        self._after_keep_alive(request_id, release).add_done_callback(_ignore)

    def _notify_only(self, request_id: str, params: Mapping[str, Any]) -> bool:
        """Tell the producer's sidecar that this consumer fetches nothing, so it frees its blocks:
        an empty Pull (pull mode) or an empty ExpectPush (push mode, also before the producer
        submitted: its blocks then go back as soon as it does), the sidecar's full prefix hit path.
        Otherwise the producer would hold them until its lease ran out."""
        address = peer_address(params)
        engine = params.get("remote_engine_id")
        if address is None or not engine or self._down:
            return False
        remote_request_id = str(params.get("remote_request_id") or "")
        tp_size = int(params.get("tp_size") or 0)
        transfer_id = str(params.get("transfer_id") or "")
        call: Callable[[], Future[Any]]
        if self._mode(params) == "pull":
            remote_blocks = grouped(params.get("remote_block_ids"))
            if not remote_blocks:
                return False
            target = remote(address, str(engine), remote_request_id, remote_blocks, tp_size)
            empty: BlockIds = tuple([] for _ in remote_blocks)
            call = partial(self.client.pull_async, self.engine_id, request_id, empty, target, transfer_id)
        else:
            target = remote(address, str(engine), remote_request_id, None, tp_size)
            empty = tuple([] for _ in self._transfer_groups)
            push_timeout = self.config.push_timeout
            call = partial(
                self.client.expect_push_async, self.engine_id, request_id, empty, target, transfer_id, push_timeout
            )
        # Best effort: the producer's lease frees the blocks otherwise.
        self._after_keep_alive(request_id, call).add_done_callback(_ignore)
        return True

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        request_id = request.request_id
        self._producer_lost.discard(request_id)
        self._arrived.pop(request_id, None)
        if self.multiturn is not None:
            self.multiturn.forget(request_id)  # multi-turn hook: a lookup not taken
        if params.get("do_remote_prefill"):
            # Finished (aborted) before blocks were allocated: nothing was fetched. The producer may
            # free its blocks (pull), and the sidecar stops keeping its lease alive.
            params["do_remote_prefill"] = False
            self._fetch_nothing(request_id, params, "aborted before its KV was requested")
            return False, None
        receive = self._receives.get(request_id)
        if receive is not None:
            # Finished while its KV is still on the way (an abort): vLLM keeps the blocks until the
            # workers report the request, so it stays tracked (a failed request call must still
            # reach them); the sidecar is asked to end it now rather than at its timeout.
            if not receive.aborted:
                receive.aborted = True
                self._release_after(receive, "the consumer request was aborted")
            return False, None
        if not params.get("do_remote_decode"):
            if self._holds_turns:  # multi-turn hook: a decode engine keeps the turn for the next one
                return self._hold_for_next_turn(request, block_ids)
            return False, None
        # Producer: keep the blocks for the consumer only after a normal finish.
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            transfer_id = str(params.get("transfer_id") or "")
            if transfer_id and not self._down:
                # A router that dispatched both legs at once has a consumer waiting for this
                # prefill: ask the sidecar to release the transfer everywhere it exists.
                self.client.release_async(
                    self.engine_id, request_id, transfer_id, reason=f"prefill ended with {request.status.name}"
                ).add_done_callback(_ignore)
            return False, None
        blocks = self._transfer_blocks(block_ids)
        if not any(blocks):
            return False, None
        if self._address is None or self._down:
            self._refresh_address()
            # No sidecar to hold them: free now; without params the router sends the decode leg
            # as a plain request and the consumer computes the prompt itself.
            logger.warning("SidecarConnector: sidecar unavailable; %s is not offered to a consumer", request_id)
            return False, None
        mode = self._mode(params)
        transfer_id = str(params.get("transfer_id") or "")
        key, seconds, skew = self._voucher_terms
        until_ms = int((time.time() + seconds) * 1000) if key else 0
        future = self.client.submit_blocks_async(
            self.engine_id,
            request_id,
            blocks,
            transfer_id=transfer_id,
            num_tokens=request.num_computed_tokens,
            lease_seconds=self.config.lease_seconds,
            mode=MODES[mode],
            vouched_until_ms=until_ms,
        )
        future.add_done_callback(lambda f: self._on_submit_done(request_id, f))
        self._sends.add(request_id)
        if mode == "push":
            self._push_sends.add(request_id)
        self._new_sends[request_id] = time.monotonic()
        host, port = split_address(self._address)
        result: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(group) for group in blocks],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "dcp_size": 1,
            "remote_num_tokens": request.num_computed_tokens,
            "transfer_mode": mode,
        }
        if transfer_id:
            result["transfer_id"] = transfer_id
        if until_ms:
            # Consumers may read these blocks without asking our sidecar until then (kvsidecar.voucher).
            result[PARAM_VOUCHER] = voucher.sign(key, self.engine_id, request_id, blocks, until_ms).hex()
            result[PARAM_VOUCHED_UNTIL_MS] = until_ms
            self._vouched_until[request_id] = time.monotonic() + seconds + skew
        if params.get("conversation_id"):  # multi-turn hook: D's hold is indexed by it
            result["conversation_id"] = params["conversation_id"]
        return True, result

    def _hold_for_next_turn(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Multi-turn hook (engine_shim.vllm.multiturn): keep a finished decode request's blocks on
        the sidecar until a prefill engine reads them for the next turn, their TTL ends, or the hold
        cap releases them; vLLM frees them at the FINISHED_SENDING / LEASE_EXPIRED that follows."""
        from vllm.v1.request import RequestStatus

        assert self.multiturn is not None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        blocks = self._transfer_blocks(block_ids)
        if not any(blocks) or self._address is None or self._down:
            return False, None
        request_id = request.request_id
        host, port = split_address(self._address)
        future, result = self.multiturn.hold(request, blocks, host, port, self.tp_size, self.pp_size)
        future.add_done_callback(lambda f: self._on_submit_done(request_id, f, "HoldBlocks"))
        self._sends.add(request_id)
        self._new_sends[request_id] = time.monotonic()
        return True, result

    def _release_after(self, receive: _Receive, reason: str) -> None:
        def release(_: Future[Any]) -> None:
            future = self.client.release_async(self.engine_id, receive.request_id, receive.transfer_id, reason=reason)
            # If the sidecar did not know it (or is gone), its request call failed and was reported.
            future.add_done_callback(_ignore)

        # After the request call, so the release cannot overtake it on the way to the sidecar.
        receive.future.add_done_callback(release)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SidecarConnectorMetadata:
        if self._arrived:
            # Consumer requests that arrived but were not scheduled in this step wait for blocks.
            for request in self._arrived.values():
                self._keep_alive(request)
            self._arrived = {}
        meta = SidecarConnectorMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._last_step_idle = meta.idle
        self._inline.clear()  # chosen but not allocated (no room): decided afresh next step
        if self._new_receives:
            meta.recv_started, self._new_receives = self._new_receives, {}
        if self._new_sends:
            meta.send_started, self._new_sends = self._new_sends, {}
        failures = self._failures
        now = time.monotonic()
        held, self._held_failures = self._held_failures, []
        for request_id, reason in held:
            failures.append(("send", request_id, reason))
        while failures:
            kind, request_id, reason = failures.popleft()
            if kind == "send" and self._vouched_until.get(request_id, 0.0) > now:
                # A consumer may still read these blocks on the strength of our voucher: keep them
                # until it ran out (its submission failed, so our sidecar cannot hold them for us).
                self._held_failures.append((request_id, reason))
                continue
            if kind == "recv":
                if self._receives.pop(request_id, None) is not None:
                    meta.recv_failed[request_id] = reason
                    logger.warning(
                        "SidecarConnector: receive of %s failed (%s); vLLM recomputes it", request_id, reason
                    )
            elif request_id in self._sends:
                self._sends.discard(request_id)
                self._push_sends.discard(request_id)
                self._vouched_until.pop(request_id, None)
                meta.send_abandoned[request_id] = reason
                logger.warning("SidecarConnector: %s; freeing the blocks of %s", reason, request_id)
        if self._new_inline:
            # The workers end these loads within this step and vLLM hears of no finished receive.
            meta.recv_inline, self._new_inline = self._new_inline, {}
            for request_id in meta.recv_inline:
                self._receives.pop(request_id, None)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.finished_recving:
            for request_id in connector_output.finished_recving:
                self._receives.pop(request_id, None)
                if self.multiturn is not None:
                    self.multiturn.loaded(request_id)  # multi-turn hook: what the load cost
        if connector_output.finished_sending:
            for request_id in connector_output.finished_sending:
                self._sends.discard(request_id)
                self._push_sends.discard(request_id)
                self._vouched_until.pop(request_id, None)

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
        return bool(self._failures or self._held_failures or self._push_sends)
