"""D's half of the scheduler role: receiving a request's KV (and P's loads of earlier turns).

From a consumer request's arrival to its load's outcome: ``on_new_request`` (keep the producer's
lease alive while it waits, ``KeepAlive``), ``get_num_new_matched_tokens`` (how many tokens come
from outside, and whether inline), ``update_state_after_alloc`` (the ``Pull`` / ``ExpectPush`` into
the new blocks, or the notice that nothing is fetched), a consumer request's end
(``request_finished``: an abort asks the sidecar to end the receive), and what the workers hear of
it in each step's metadata (started, failed, inline). The multi-turn hooks of this side (a prefill
engine looking up and pulling an earlier turn's hold) call ``engine_shim.vllm.multiturn``.

Threads: vLLM's scheduler thread calls every method and owns every dict and set here. gRPC
callback threads only append to the deques ``_failures`` and ``_lost_news``; the scheduler thread
drains them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from engine_shim.client import Future, remote
from engine_shim.vllm import multiturn
from engine_shim.vllm.config import BlockIds, ShimConfig
from engine_shim.vllm.link import REFUSED, FutureLike, SidecarLink, copy_outcome, ignore, rpc_error
from engine_shim.vllm.metadata import SidecarConnectorMetadata
from engine_shim.vllm.params import blocks_from_params, flat, peer_address, voucher_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.kvsidecar.scheduler")

# An inline load's Pull bound (pull_timeout, if lower): the sidecar ends the Pull by then, so the
# step's forward, with the rest of the engine, waits about that long at most. A failed or late load
# is recomputed.
INLINE_PULL_TIMEOUT = 2.0


def inline_possible(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ShimConfig) -> bool:
    """Whether this engine may load inline at all (``Receiver._loads_inline``)."""
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


@dataclass
class _Receive:
    """A consumer request whose KV the sidecar is fetching."""

    request_id: str
    transfer_id: str
    blocks: list[int]
    future: FutureLike
    aborted: bool = False


class Receiver:
    """D's receive side; runs on vLLM's scheduler thread (see module doc)."""

    def __init__(
        self, link: SidecarLink, turns: multiturn.MultiTurn | None, loads_turns: bool, inline_possible: bool
    ) -> None:
        self.link = link
        self.multiturn = turns
        self._loads_turns = loads_turns  # multi-turn hook: this engine looks up earlier turns' holds
        self._inline_possible = inline_possible
        self._last_step_idle = True  # the last step computed nothing (build_meta)
        # This step's inline load, chosen in get_num_new_matched_tokens: request id -> its local
        # prefix hit (tokens, block-aligned); cleared at the end of the step.
        self._inline: dict[str, int] = {}
        self._new_inline: dict[str, float] = {}  # for the metadata: request id -> workers' wait bound
        self._receives: dict[str, _Receive] = {}
        # Consumer requests whose producer lease the sidecar keeps alive until they are scheduled,
        # and those whose producer already said it no longer holds the KV (recompute them).
        self._arrived: dict[str, Request] = {}
        self._kept_alive: dict[str, Future[Any]] = {}
        self._producer_lost: set[str] = set()
        # Filled by gRPC callback threads: request ids whose KeepAlive said the producer no longer
        # holds the KV; moved into _producer_lost on the scheduler thread (_take_lost_news).
        self._lost_news: collections.deque[str] = collections.deque()
        # Announced to the workers in the next metadata, with the time.monotonic() of the request
        # call (CLOCK_MONOTONIC is node-wide, so workers compare it with their stream losses).
        self._new_receives: dict[str, tuple[float, list[int]]] = {}
        # Filled by gRPC callback threads: (request id, reason) of receives that failed.
        self._failures: collections.deque[tuple[str, str]] = collections.deque()
        # Tokens this engine was told to load from outside, per request (bounded; for observability).
        self.external_tokens: collections.OrderedDict[str, int] = collections.OrderedDict()

    # gRPC threads ------------------------------------------------------------------------------

    def _on_receive_call_done(self, request_id: str, transfer_id: str, what: str, future: FutureLike) -> None:
        exc = future.exception()
        if exc is None:
            return  # accepted (or refused with a LOAD_FAILED event, which the workers get)
        code, text = rpc_error(exc)
        reason = f"{what} failed: {text}"
        if code is None or code in REFUSED:  # refused, or never sent (code None)
            self._failures.append((request_id, reason))
            return
        # Unknown whether the sidecar started fetching into our blocks: ask it to stop. If it knows
        # the request, its terminal event follows once nothing is in flight; otherwise fail here.
        logger.warning("SidecarConnector: %s for %s; releasing it on the sidecar", reason, request_id)
        link = self.link
        release = link.client.release_async(link.engine_id, request_id, transfer_id, reason=reason[:200])

        def released(f: Future[Any]) -> None:
            if f.exception() is not None or not f.result().found:
                self._failures.append((request_id, reason))

        release.add_done_callback(released)

    # vLLM scheduler thread ---------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        # A consumer request may wait here a while before it is scheduled; the producer's lease
        # must not run out meanwhile (vLLM's decode engines heartbeat from arrival). Requests still
        # waiting at the end of this step get a KeepAlive (see build_meta).
        params = request.kv_transfer_params
        if (
            params
            and params.get("do_remote_prefill")
            and (params.get("remote_request_id") or params.get("transfer_id"))
        ):
            self._arrived[request.request_id] = request
        elif self._loads_turns and params and params.get("do_remote_decode") and not self.link.down:
            assert self.multiturn is not None
            self.multiturn.prefetch(request)  # multi-turn hook: ask for a hold while it waits

    def _keep_alive(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        link = self.link
        address, engine = peer_address(params), params.get("remote_engine_id")
        if address is None or not engine or link.down:
            return
        request_id = request.request_id
        target = remote(
            address, str(engine), str(params.get("remote_request_id") or ""), tp_size=int(params.get("tp_size") or 0)
        )
        future = link.client.keep_alive_async(
            link.engine_id, request_id, target, transfer_id=str(params.get("transfer_id") or "")
        )
        self._kept_alive[request_id] = future

        def done(f: Future[Any]) -> None:
            # Errors (an older sidecar without KeepAlive, a sidecar that is down) change nothing:
            # the request call that follows reports its own failure.
            if f.exception() is None and not f.result().producer_holds:
                self._lost_news.append(request_id)

        future.add_done_callback(done)

    def _after_keep_alive(self, request_id: str, call: Callable[[], Future[Any]]) -> FutureLike:
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
            real.add_done_callback(lambda f: copy_outcome(f, proxy))

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
        if self._loads_turns and params and params.get("do_remote_decode") and not self.link.down:
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
        if self.link.down or request.request_id in self._producer_lost:
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
            and 1 < count <= self.link.config.inline_load_max_tokens
            and self.link.mode(params) == "pull"
        )

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        link = self.link
        # --- multi-turn hook: pull the matched prefix of a remote hold into the new blocks.
        if self.multiturn is not None:
            held = self.multiturn.take_load(request, num_external_tokens)
            if held is not None:
                local = link.transfer_blocks(blocks.get_unhashed_block_ids_all_groups())
                pulling = link.client.pull_async(
                    link.engine_id, request.request_id, local, held, "", link.config.pull_timeout
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
        mode = link.mode(params)
        request_id = request.request_id
        transfer_id = str(params.get("transfer_id") or "")
        if num_external_tokens <= 0:
            # Nothing to load (a full local prefix hit, or a recompute decision).
            self._fetch_nothing(request_id, params, "nothing to load")
            return
        if inline_prefix is None:
            # Blocks of an asynchronous load are cached only once it ends: the unhashed ones.
            local = link.transfer_blocks(blocks.get_unhashed_block_ids_all_groups())
        else:
            # A synchronous load's blocks are cached at allocation: those of the prompt but the
            # local prefix hit (not one allocated ahead for the first output token).
            skip, end = inline_prefix // link.block_size, -(-len(request.prompt_token_ids or ()) // link.block_size)
            local = link.transfer_blocks(tuple(group[skip:end] for group in blocks.get_block_ids()))
        pass_voucher, until_ms = voucher_of(params) if mode == "pull" else (b"", 0)
        target = remote(
            address,
            str(engine),
            str(params.get("remote_request_id") or ""),
            blocks_from_params(params.get("remote_block_ids")) if mode == "pull" else None,
            int(params.get("tp_size") or 0),
            int(params.get("remote_num_tokens") or 0),
            pass_voucher,
            until_ms,
        )
        # The Pull / ExpectPush also ends the sidecar's keep-alive of the request.
        client = link.client
        call: Callable[[], Future[Any]]
        pull_timeout = link.config.pull_timeout
        if inline_prefix is not None:
            pull_timeout = min(pull_timeout or INLINE_PULL_TIMEOUT, INLINE_PULL_TIMEOUT)
        if mode == "pull":
            call = partial(client.pull_async, link.engine_id, request_id, local, target, transfer_id, pull_timeout)
        else:
            call = partial(
                client.expect_push_async,
                link.engine_id,
                request_id,
                local,
                target,
                transfer_id,
                link.config.push_timeout,
            )
        future = self._after_keep_alive(request_id, call)
        what = "Pull" if mode == "pull" else "ExpectPush"
        inline = inline_prefix is not None
        self._track_receive(request_id, transfer_id, local, future, what, num_external_tokens, inline)
        if inline:
            self._await_inline_call(request_id, transfer_id, future)

    def _await_inline_call(self, request_id: str, transfer_id: str, future: FutureLike) -> None:
        """Wait for an inline load's Pull to be answered, so that a refusal reaches the workers in
        this step's metadata (they wait for the load before the forward); it overlaps the READ,
        which the sidecar starts before it answers.

        The workers wait for the sidecar's outcome, which it sends by the Pull's bound, or for the
        end of their event stream (the sidecar died: nothing can write into the blocks any more).
        Not for less: a sidecar that is frozen (SIGSTOP, a hung host) may still complete a READ
        into the blocks when it resumes, and the forward would have used them. So a frozen
        sidecar holds the step until it resumes, or until ``recv_watchdog``, the last resort of
        asynchronous loads too."""
        link = self.link
        self._new_inline[request_id] = link.config.recv_watchdog
        # The call (and a KeepAlive before it) carries the rpc_timeout deadline: an outcome comes.
        rpc_timeout = link.config.rpc_timeout
        try:
            exc = future.exception(timeout=2 * rpc_timeout + 1.0)
        except concurrent.futures.TimeoutError:
            # Not even sent yet (the RPC threads are backed up): fail it in this step, and have
            # the sidecar release it once the call ends, should it start the Pull after all.
            self._release_after(self._receives[request_id], "the inline load's Pull was not answered in time")
            self._failures.append((request_id, "Pull failed: not answered in time"))
            return
        except concurrent.futures.CancelledError as cancelled:  # the client is closing: never sent
            exc = cancelled
        if exc is None:
            return
        # As _on_receive_call_done (which inline loads skip), but decided within this step.
        code, text = rpc_error(exc)
        if code is not None and code not in REFUSED:
            # Unknown whether the sidecar started: ask it to stop. If it knew the request, its
            # terminal event reaches the workers; else no event comes, so fail it here.
            try:
                release = link.client.release_async(link.engine_id, request_id, transfer_id, reason=text[:200])
                if release.result(timeout=rpc_timeout + 1.0).found:
                    return
            except Exception:
                pass
        self._failures.append((request_id, f"Pull failed: {text}"))

    def _track_receive(
        self,
        request_id: str,
        transfer_id: str,
        local: BlockIds,
        future: FutureLike,
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
        link = self.link
        transfer_id = str(params.get("transfer_id") or "")
        release = partial(link.client.release_async, link.engine_id, request_id, transfer_id, reason)
        self._after_keep_alive(request_id, release).add_done_callback(ignore)

    def _notify_only(self, request_id: str, params: Mapping[str, Any]) -> bool:
        """Tell the producer's sidecar that this consumer fetches nothing, so it frees its blocks:
        an empty Pull (pull mode) or an empty ExpectPush (push mode, also before the producer
        submitted: its blocks then go back as soon as it does), the sidecar's full prefix hit path.
        Otherwise the producer would hold them until its lease ran out."""
        link = self.link
        address = peer_address(params)
        engine = params.get("remote_engine_id")
        if address is None or not engine or link.down:
            return False
        remote_request_id = str(params.get("remote_request_id") or "")
        tp_size = int(params.get("tp_size") or 0)
        transfer_id = str(params.get("transfer_id") or "")
        call: Callable[[], Future[Any]]
        if link.mode(params) == "pull":
            remote_blocks = blocks_from_params(params.get("remote_block_ids"))
            if not remote_blocks:
                return False
            target = remote(address, str(engine), remote_request_id, remote_blocks, tp_size)
            empty: BlockIds = tuple([] for _ in remote_blocks)
            call = partial(link.client.pull_async, link.engine_id, request_id, empty, target, transfer_id)
        else:
            target = remote(address, str(engine), remote_request_id, None, tp_size)
            empty = tuple([] for _ in link.transfer_groups)
            push_timeout = link.config.push_timeout
            call = partial(
                link.client.expect_push_async, link.engine_id, request_id, empty, target, transfer_id, push_timeout
            )
        # Best effort: the producer's lease frees the blocks otherwise.
        self._after_keep_alive(request_id, call).add_done_callback(ignore)
        return True

    def request_finished(self, request: Request, params: dict[str, Any]) -> bool:
        """D's part of a request's end: True if it was a consumer request (vLLM frees its blocks
        now: nothing is offered), False if the send side decides."""
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
            return True
        receive = self._receives.get(request_id)
        if receive is None:
            return False
        # Finished while its KV is still on the way (an abort): vLLM keeps the blocks until the
        # workers report the request, so it stays tracked (a failed request call must still
        # reach them); the sidecar is asked to end it now rather than at its timeout.
        if not receive.aborted:
            receive.aborted = True
            self._release_after(receive, "the consumer request was aborted")
        return True

    def _release_after(self, receive: _Receive, reason: str) -> None:
        link = self.link

        def release(_: Future[Any]) -> None:
            future = link.client.release_async(link.engine_id, receive.request_id, receive.transfer_id, reason=reason)
            # If the sidecar did not know it (or is gone), its request call failed and was reported.
            future.add_done_callback(ignore)

        # After the request call, so the release cannot overtake it on the way to the sidecar.
        receive.future.add_done_callback(release)

    def build_meta(self, meta: SidecarConnectorMetadata) -> None:
        """This step's receive news for the workers (``meta.idle`` already set)."""
        if self._arrived:
            # Consumer requests that arrived but were not scheduled in this step wait for blocks.
            for request in self._arrived.values():
                self._keep_alive(request)
            self._arrived = {}
        self._last_step_idle = meta.idle
        self._inline.clear()  # chosen but not allocated (no room): decided afresh next step
        if self._new_receives:
            meta.recv_started, self._new_receives = self._new_receives, {}
        failures = self._failures
        while failures:
            request_id, reason = failures.popleft()
            if self._receives.pop(request_id, None) is not None:
                meta.recv_failed[request_id] = reason
                logger.warning("SidecarConnector: receive of %s failed (%s); vLLM recomputes it", request_id, reason)
        if self._new_inline:
            # The workers end these loads within this step and vLLM hears of no finished receive.
            meta.recv_inline, self._new_inline = self._new_inline, {}
            for request_id in meta.recv_inline:
                self._receives.pop(request_id, None)

    def finished_recving(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._receives.pop(request_id, None)
            if self.multiturn is not None:
                self.multiturn.loaded(request_id)  # multi-turn hook: what the load cost

    def has_pending_work(self) -> bool:
        """Failures wait for delivery to the workers: the engine must keep stepping."""
        return bool(self._failures)
