"""The NIXL owner thread: the only thread that ever touches a NIXL object.

NIXL agents are not safe to share between threads in their default mode (two threads on one agent
corrupted UCX state in our measurements), and released handles segfault when used again. So every
agent, registration, prepared descriptor list and transfer handle lives in this thread's
dictionaries and never leaves it.

Threads:
- The event loop thread calls the ``async`` methods. Each enqueues a command on ``self._commands``
  and awaits a future that the owner thread completes: a transfer's through the outbox
  (``handoff.LoopOutbox``), other commands' as a ``concurrent.futures.Future``.
  ``expect_notifications`` and ``warm`` are not commands: they change counts; a rise wakes the
  owner thread (``_WAKE``), a fall does not (it is seen at the next poll).
- The owner thread (``kvsidecar-nixl``) executes commands, posts transfers and polls. NIXL's own
  progress thread is disabled (with NIXL's hard-coded zero delay it spins a core per agent), so
  this thread drives progress: while anything is in flight or expected it polls transfer states
  and notifications, right away after activity and backing off to ``poll_interval_max``
  (``next_poll_delay``; 10 ms when it only lets a peer that just handshaked wire up), and slower
  while it only waits for a notification that recent waits say cannot have come yet
  (``polling.NotificationWaits``); with nothing in flight it blocks on the command queue.
- Transfer results and notifications reach the loop through the outbox, flushed after each
  command and poll: one ``loop.call_soon_threadsafe`` per delivery, none while one is pending.

Large transfers are posted in chunks of at most ``max_post_bytes``, round robin between
transfers (``chunks.ChunkScheduler``, which says why); the agents' tables (registrations, remote
agents, prepared lists) are ``agents.Agent``; loading NIXL and creating an agent is ``loader``.

NIXL has no timeouts of its own: every transfer carries a deadline enforced here. A transfer
that cannot be cancelled at its deadline keeps its handle (and therefore its blocks) until NIXL
releases it; its waiter learns the outcome only then, because handing the blocks back while the
transfer may still write would corrupt the next request's KV.

A deadline is also a validity bound, not only a timeout: the caller may pass one after which the
other side may reuse the memory (a pull's producer lease). So a transfer found DONE only after its
deadline is reported as failed (it may have finished after the other side gave up, e.g. this
process was stopped mid-transfer and resumed), and each poll cancels overdue transfers before it
drives any progress, so a resumed process does not progress them further.

This module is the owner loop that composes them: the commands, the polling, the posts and their
completion; the values that cross it are in ``contract``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sidecar.config import NixlSettings
from sidecar.dataplane.contract import (
    NOT_POSTED_LATE,
    NotificationsCallback,
    RemoteAgent,
    RunsSpec,
    Staging,
    TransferResult,
    TransferSpec,
    XferDoneCallback,
    is_disconnect,
)
from sidecar.dataplane.priority import PostPriority, name_thread
from sidecar.dataplane.transport.agents import LOCAL, Agent
from sidecar.dataplane.transport.chunks import ChunkScheduler, Split, split_of
from sidecar.dataplane.transport.handoff import LoopOutbox
from sidecar.dataplane.transport.inflight import Post
from sidecar.dataplane.transport.loader import load_nixl, new_agent
from sidecar.dataplane.transport.polling import HOT_WINDOW_S, MIN_DELAY_S, NotificationWaits, next_poll_delay
from sidecar.logs import get_logger

log = get_logger("kvsidecar.transport")

# How long a post waits in place for a small transfer to complete.
_POST_SPIN_S = 0.00005
# How long the owner thread polls without sleeping while a split transfer's last chunk waits for
# its earlier chunks' DONE: over CMA each chunk's copy ran inside its post and NIXL reports DONE
# two progress calls (~50-100 us) later, so a timed sleep here (~100 us with the timer's slack)
# was most of a chunk's cost. Bounded, for a backend whose chunks complete on their own time.
_CHUNK_WAIT_SPIN_S = 0.0003
_NOTHING = object()  # "no command" marker in the owner loop
_DEFERRED = object()  # a command body that completes its future later
# Wakes the owner thread for a rise of the expected count or a warm period (no command body, no
# future). It counts as activity, so polling starts hot (50 us for 2 ms). Waking only an idle owner
# thread measured pulls 0.25-0.5 ms slower (control p50, two invocations), and starting at the warm
# cadence cost push 0.25 ms of latency p50 to save 9 of D's ~26 owner wake-ups per push.
_WAKE = object()


# What a transfer's caller awaits; completed on the loop thread through the outbox (handoff.py).
_Waiter = asyncio.Future[TransferResult]
# make(rows, notification): a transfer handle for some descriptor rows (a chunk, or slice(None)).
_Make = Callable[[Any, bytes], Any]


def _no_op() -> None:
    return None


class NixlTransport:
    """Owns every NIXL agent of the sidecar and runs the owner thread."""

    def __init__(
        self,
        settings: NixlSettings,
        on_notifications: NotificationsCallback,
        on_xfer_done: XferDoneCallback | None = None,
    ) -> None:
        self._settings = settings
        self._api, self.nixl_version = load_nixl()
        self._outbox = LoopOutbox(on_notifications)
        self._on_xfer_done = on_xfer_done
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._agents: dict[str, Agent] = {}
        self._in_flight: dict[int, Post] = {}
        self._stuck: dict[int, Post] = {}
        self._splits = ChunkScheduler(self._end_split)  # transfers with chunks left to post
        self._ids = itertools.count()
        self._expecting = 0
        self._waits = NotificationWaits()  # when each expected notification's wait began; how long they last
        self._warm_until = 0.0
        self._thread: threading.Thread | None = None
        self._post_priority = PostPriority(settings.post_priority)

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._outbox.bind(loop)
        self._thread = threading.Thread(target=self._run, name="kvsidecar-nixl", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float = 5.0) -> None:
        """Fail what is in flight, release everything, and join the owner thread (bounded)."""
        if self._thread is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await self._call(self._shutdown_all)
        except TimeoutError:
            # The owner thread is stuck in a NIXL call; it is a daemon thread, so exiting still works.
            log.error("nixl_shutdown_timed_out", timeout_seconds=timeout)
        self._commands.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        self._thread = None

    async def ping(self) -> None:
        """Returns once the owner thread has run a no-op: it still takes commands."""
        await self._call(_no_op)

    @property
    def in_flight(self) -> int:
        """NIXL posts in flight (a split transfer's chunks each count) plus split transfers with
        chunks still to post (between two chunks, none of theirs may be in flight)."""
        return len(self._in_flight) + len(self._stuck) + len(self._splits)

    # --- commands (called from the loop thread) ------------------------------------------------

    async def create_agent(self, name: str, regions: list[tuple[int, int, int]], mem_type: str) -> bytes:
        """Create an agent, register its memory once per backing storage, return its metadata."""
        result: bytes = await self._call(self._create_agent, name, regions, mem_type)
        return result

    async def drop_agent(self, name: str) -> None:
        """Forget an agent everywhere: other local agents unload it, its lists and memory go."""
        await self._call(self._drop_agent, name)

    async def drop_remote(self, names: list[str]) -> None:
        """Unload remote agents (a peer restarted or its engine re-registered)."""
        await self._call(self._drop_remote, names)

    async def transfer(self, spec: TransferSpec) -> TransferResult:
        """Post one READ or WRITE and wait for its end. Never raises for transfer failures."""
        waiter: _Waiter = asyncio.get_running_loop().create_future()
        self._commands.put((self._post, (spec, waiter, time.monotonic()), concurrent.futures.Future()))
        return await waiter

    async def transfer_runs(self, spec: RunsSpec) -> TransferResult:
        """Like ``transfer`` with explicit descriptor arrays, prepared for this transfer only: for
        plans that change block size or layout, which are not a selection of a prepared view."""
        waiter: _Waiter = asyncio.get_running_loop().create_future()
        self._commands.put((self._post_runs, (spec, waiter), concurrent.futures.Future()))
        return await waiter

    async def staging(self, agent_name: str, nbytes: int) -> Staging:
        """Lend a registered staging buffer of at least ``nbytes`` (pooled per agent; sizes are
        rounded up to a power of two so the pool stays small). Give it back with ``unstage``."""
        result: Staging = await self._call(self._lend_staging, agent_name, nbytes)
        return result

    def unstage(self, staging: Staging) -> None:
        """Give a staging buffer back; only once no transfer on it can still be in flight."""
        self._commands.put((self._return_staging, (staging,), concurrent.futures.Future()))

    async def register_host(self, agent_name: str, address: int, nbytes: int) -> bytes:
        """Register caller-owned host memory with an agent as DRAM, once (see ``Transport``)."""
        metadata: bytes = await self._call(self._register_host, agent_name, address, nbytes)
        return metadata

    async def notify(self, agent_name: str, remote: RemoteAgent, payload: bytes) -> None:
        await self._call(self._notify, agent_name, remote, payload)

    def expect_notifications(self, delta: int) -> None:
        """Count of things waiting for notifications; polling continues while it is > 0. Only
        the loop thread writes the count; a rise wakes the owner thread (``_WAKE``), a fall does
        not: the owner thread sees it at its next poll."""
        self._expecting = max(0, self._expecting + delta)
        self._waits.change(delta, time.monotonic())
        if delta > 0:
            self._commands.put(_WAKE)

    def warm(self, seconds: float) -> None:
        """Poll for a while even with nothing expected, e.g. so a peer that just handshaked can
        connect to our agents (UCX wire-up needs both sides to progress)."""
        self._warm_until = max(self._warm_until, time.monotonic() + seconds)
        self._commands.put(_WAKE)

    async def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((function, args, future))
        return await asyncio.wrap_future(future)

    # --- owner thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        name_thread("kvsidecar-nixl")
        delay = MIN_DELAY_S
        last_activity = time.monotonic()
        while True:
            if not self._is_active():
                self._post_priority.lower()
                item = self._commands.get()  # nothing in flight or expected: sleep until told
            elif self._splits and self._splits.any_ready():
                item = self._next_command()  # a chunk is ready: take what is queued, do not sleep
            elif self._splits and time.monotonic() - last_activity < _CHUNK_WAIT_SPIN_S:
                item = self._next_command()  # a last chunk waits for its earlier chunks' DONE, due now
            else:
                self._post_priority.lower()
                now = time.monotonic()
                timeout = MIN_DELAY_S if now - last_activity < HOT_WINDOW_S else delay
                if not (self._in_flight or self._stuck or self._splits or now < self._warm_until):
                    timeout = self._waits.delay(timeout, now, self._settings.poll_interval_max_ms / 1000.0)
                try:
                    item = self._commands.get(timeout=timeout)
                except queue.Empty:
                    item = _NOTHING
            worked = False
            while item is not _NOTHING:
                if item is None:
                    self._outbox.flush()
                    return  # stop sentinel
                if item is not _WAKE:
                    self._execute(*item)
                    self._outbox.flush()  # a result found in the post's spin goes now, not after the batch
                worked = True
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = _NOTHING
            progressed = self._poll() if self._is_active() else False
            if self._splits:
                progressed = self._splits.post_next(time.monotonic(), self._post_chunk) or progressed
            self._outbox.flush()  # one wake-up of the loop for this turn's results and notifications
            now = time.monotonic()
            if worked or progressed:
                last_activity = now
                delay = MIN_DELAY_S
            else:
                delay = next_poll_delay(
                    delay, now - last_activity, self._settings.poll_interval_max_ms / 1000.0, not self._expects_work()
                )

    def _next_command(self) -> Any:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return _NOTHING

    def _is_active(self) -> bool:
        return self._expects_work() or time.monotonic() < self._warm_until

    def _expects_work(self) -> bool:
        """A transfer in flight or notifications expected (not only a peer's wire-up)."""
        return bool(self._in_flight or self._stuck or self._splits or self._expecting > 0)

    @staticmethod
    def _execute(function: Callable[..., Any], args: tuple[Any, ...], future: concurrent.futures.Future[Any]) -> None:
        try:
            result = function(*args)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if result is not _DEFERRED and not future.done():
            future.set_result(result)

    def _poll(self) -> bool:
        progressed = False
        # Overdue transfers end before anything below drives progress (a resumed process must not
        # move a transfer's bytes further once its deadline passed).
        now = time.monotonic()
        for xfer_id, xfer in list(self._in_flight.items()):
            if now > xfer.deadline:
                xfer.cancel_reason = f"{xfer.op} did not complete within its deadline"
                self._finish(xfer_id, TransferResult(False, xfer.cancel_reason))
                progressed = True
        notifications: list[tuple[str, bytes]] = []
        for name, state in self._agents.items():
            try:
                new = state.agent.get_new_notifs()
            except Exception as exc:
                log.warning("nixl_notification_poll_failed", agent=name, error=str(exc))
                continue
            for messages in new.values():
                for message in messages:
                    notifications.append((name, bytes(message)))
        if notifications:
            progressed = True
            seen = time.monotonic()
            self._outbox.notifications(notifications, seen)
            self._waits.seen(seen)
        now = time.monotonic()
        for xfer_id, xfer in list(self._in_flight.items()):
            owner = self._agents.get(xfer.agent_name)
            if owner is None:
                continue
            try:
                status = owner.agent.check_xfer_state(xfer.handle)
            except Exception as exc:
                self._finish(xfer_id, TransferResult(False, f"transfer failed: {exc}", peer_gone=is_disconnect(exc)))
                progressed = True
                continue
            if status == "DONE":
                self._finish(xfer_id, xfer.result(owner))
                progressed = True
            elif status != "PROC":
                self._finish(xfer_id, TransferResult(False, f"NIXL reported transfer state {status}"))
                progressed = True
            elif now > xfer.deadline:
                xfer.cancel_reason = f"{xfer.op} did not complete within its deadline"
                self._finish(xfer_id, TransferResult(False, xfer.cancel_reason))
                progressed = True
        for xfer_id, xfer in list(self._stuck.items()):
            if xfer.release():
                del self._stuck[xfer_id]
                log.warning("nixl_transfer_released_late", agent=xfer.agent_name, op=xfer.op)
                failed = TransferResult(False, xfer.cancel_reason or "transfer failed")
                if xfer.split is not None:
                    self._splits.chunk_done(xfer.split, failed)
                else:
                    self._complete(xfer.future, failed)
                progressed = True
        return progressed

    def _finish(self, xfer_id: int, result: TransferResult) -> None:
        xfer = self._in_flight.pop(xfer_id)
        if not xfer.release():
            # The backend may still move bytes: keep the handle, report only once it is released.
            log.error("nixl_transfer_not_releasable", agent=xfer.agent_name, op=xfer.op, reason=result.error)
            xfer.cancel_reason = result.error or "transfer could not be released"
            self._stuck[xfer_id] = xfer
            return
        if xfer.split is not None:
            self._splits.chunk_done(xfer.split, result)
            return
        if self._on_xfer_done is not None and xfer.observed:
            self._on_xfer_done(xfer.op, result)
        self._complete(xfer.future, result)

    # --- split transfers (owner thread; the scheduling itself is chunks.ChunkScheduler) -----------

    def _start_split(self, split: Split) -> object:
        self._splits.add(split)
        self._splits.post_next(time.monotonic(), self._post_chunk)
        return _DEFERRED

    def _post_chunk(self, split: Split, index: int) -> None:
        handle = split.make(index)
        now = time.monotonic()
        # Only the last chunk is waited for in place: an earlier one's DONE is seen by the polls
        # between the next chunks' posts (spinning on each cost ~50 us a chunk for nothing).
        last = index == split.chunks - 1
        self._launch(
            split.owner, split.agent_name, split.op, handle, split.deadline, split.future, now, split, spin=last
        )

    def _end_split(self, split: Split, result: TransferResult) -> None:
        if self._on_xfer_done is not None and split.observed:
            self._on_xfer_done(split.op, result)
        self._complete(split.future, result)

    def _complete(self, future: _Waiter, result: TransferResult) -> None:
        result.reported_at = time.monotonic()
        self._outbox.result(future, result)

    # --- command bodies (owner thread) ----------------------------------------------------------

    def _create_agent(self, name: str, regions: list[tuple[int, int, int]], mem_type: str) -> bytes:
        if name in self._agents:
            raise ValueError(f"agent {name} exists")
        state = Agent(new_agent(self._api, self._settings, name, {d for _, _, d in regions}, mem_type))
        state.register(regions, mem_type)
        self._agents[name] = state
        return bytes(state.agent.get_agent_metadata())

    def _drop_agent(self, name: str) -> None:
        state = self._agents.pop(name, None)
        if state is not None:
            self._splits.fail_where("the worker was unregistered", agent_name=name)
        for other_name, other in self._agents.items():
            if name in other.remotes:
                self._unload(other_name, other, name)
        if state is None:
            return
        for xfer_id, xfer in list(self._in_flight.items()):
            if xfer.agent_name == name:
                self._finish(xfer_id, TransferResult(False, "the worker was unregistered"))
        state.close()
        # The agent object is dropped here, on the owner thread, so its destructor runs here too.
        del state

    def _drop_remote(self, names: list[str]) -> None:
        for agent_name, state in self._agents.items():
            for name in names:
                if name in state.remotes:
                    self._unload(agent_name, state, name)

    def _unload(self, agent_name: str, state: Agent, remote_name: str) -> None:
        self._splits.fail_where(f"the remote agent {remote_name} was unloaded", agent_name, remote_name)
        state.unload_remote(remote_name)

    def _ensure_remote(self, agent_name: str, state: Agent, remote: RemoteAgent) -> None:
        if state.knows(remote):
            return
        if remote.name in state.remotes:
            self._unload(agent_name, state, remote.name)
        state.load_remote(remote)

    def _post(self, spec: TransferSpec, future: _Waiter, queued: float = 0.0) -> object:
        """Post a transfer between two prepared lists; its future completes later, from _poll
        (hence _DEFERRED). ``queued``: when the loop queued it (the trace's owner_wait)."""

        def setup(state: Agent) -> tuple[np.ndarray, _Make]:
            local_handle = state.dlist(LOCAL, spec.local_list)
            remote_handle = state.dlist(spec.remote.name, spec.remote_list)
            local, remote = spec.local_indices, spec.remote_indices

            def make(rows: np.ndarray | slice, notification: bytes) -> Any:
                return state.agent.make_prepped_xfer(
                    spec.op, local_handle, local[rows], remote_handle, remote[rows], notif_msg=notification
                )

            return state.local_lengths(spec.local_list.key)[local], make

        return self._post_with(spec, future, setup, queued)

    def _post_runs(self, spec: RunsSpec, future: _Waiter) -> object:
        """Post a transfer over explicit descriptor arrays (prepared for this transfer only)."""

        def setup(state: Agent) -> tuple[np.ndarray, _Make]:
            def make(rows: np.ndarray | slice, notification: bytes) -> Any:
                return state.agent.initialize_xfer(
                    spec.op,
                    state.agent.get_xfer_descs(spec.local[rows], spec.local_mem),
                    state.agent.get_xfer_descs(spec.remote_descs[rows], spec.remote_mem),
                    spec.remote.name,
                    notif_msg=notification,
                )

            return spec.local[:, 1], make

        return self._post_with(spec, future, setup)

    def _post_with(
        self,
        spec: TransferSpec | RunsSpec,
        future: _Waiter,
        setup: Callable[[Agent], tuple[np.ndarray, _Make]],
        queued: float = 0.0,
    ) -> object:
        """Post ``spec`` in one post or in chunks; ``setup(agent)`` gives the byte length of each
        descriptor and ``make(rows, notification)``, which creates the handle for some rows."""
        now = time.monotonic()
        observed = not isinstance(spec, RunsSpec) or spec.observed  # reported to on_xfer_done
        if spec.not_after is not None and now > spec.not_after:
            self._complete(future, TransferResult(False, NOT_POSTED_LATE))
            return _DEFERRED
        state = self._agents.get(spec.agent_name)
        if state is None:
            self._complete(future, TransferResult(False, f"local agent {spec.agent_name} is gone"))
            return _DEFERRED
        try:
            self._ensure_remote(spec.agent_name, state, spec.remote)
            sizes, make = setup(state)
            split = split_of(spec, state, future, sizes, make, self._settings.max_post_bytes)
            if split is not None:
                split.observed = observed
                return self._start_split(split)
            handle = make(slice(None), spec.notification)
        except Exception as exc:
            self._complete(future, TransferResult(False, f"transfer setup failed: {exc}", peer_gone=is_disconnect(exc)))
            return _DEFERRED
        return self._launch(
            state, spec.agent_name, spec.op, handle, spec.deadline, future, now, queued=queued, observed=observed
        )

    def _launch(
        self,
        state: Agent,
        agent_name: str,
        op: str,
        handle: Any,
        deadline: float,
        future: _Waiter,
        now: float,
        split: Split | None = None,
        queued: float = 0.0,
        observed: bool = True,
        spin: bool = True,
    ) -> object:
        xfer = Post(agent_name, handle, op, deadline, future, now, split=split, queued=queued, observed=observed)
        xfer_id = next(self._ids)
        self._in_flight[xfer_id] = xfer
        try:
            self._post_priority.raise_()  # the copy runs inside the post (priority.py)
            status = state.agent.transfer(handle)
        except Exception as exc:
            self._finish(xfer_id, TransferResult(False, f"transfer failed: {exc}", peer_gone=is_disconnect(exc)))
            return _DEFERRED
        xfer.posted = time.monotonic()
        # Small transfers complete within microseconds: check a few times before leaving it to
        # the poll loop, whose sleeps are ~60 us at the finest.
        spin_until = time.perf_counter() + (_POST_SPIN_S if spin else 0.0)
        while status == "PROC" and time.perf_counter() < spin_until:
            try:
                status = state.agent.check_xfer_state(handle)
            except Exception as exc:
                self._finish(xfer_id, TransferResult(False, f"transfer failed: {exc}", peer_gone=is_disconnect(exc)))
                return _DEFERRED
        if status == "DONE":
            self._finish(xfer_id, xfer.result(state))
        elif status != "PROC":
            self._finish(xfer_id, TransferResult(False, f"NIXL refused the transfer (state {status})"))
        return _DEFERRED

    def _notify(self, agent_name: str, remote: RemoteAgent, payload: bytes) -> None:
        state = self._agent(agent_name)
        self._ensure_remote(agent_name, state, remote)
        state.agent.send_notif(remote.name, payload)

    def _agent(self, agent_name: str) -> Agent:
        state = self._agents.get(agent_name)
        if state is None:
            raise ValueError(f"local agent {agent_name} is gone")
        return state

    def _lend_staging(self, agent_name: str, nbytes: int) -> Staging:
        return self._agent(agent_name).lend_staging(nbytes)

    def _register_host(self, agent_name: str, address: int, nbytes: int) -> bytes:
        state = self._agent(agent_name)
        state.register_host(address, nbytes)
        return bytes(state.agent.get_agent_metadata())  # with the range: what peers need to READ it

    @staticmethod
    def _return_staging(staging: Staging) -> None:
        staging.busy = False

    def _shutdown_all(self) -> None:
        self._splits.fail_where("the sidecar is shutting down")
        for xfer_id in list(self._in_flight):
            self._finish(xfer_id, TransferResult(False, "the sidecar is shutting down"))
        for name in list(self._agents):
            self._drop_agent(name)
