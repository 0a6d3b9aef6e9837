"""The NIXL owner thread: the only thread that ever touches a NIXL object.

NIXL agents are not safe to share between threads in their default mode (two threads on one agent
corrupted UCX state in our measurements), and released handles segfault when used again. So every
agent, registration, prepared descriptor list and transfer handle lives in this thread's
dictionaries and never leaves it.

Threads:
- The event loop thread calls the ``async`` methods. Each enqueues a command on ``self._commands``
  and awaits a ``concurrent.futures.Future`` that the owner thread completes.
- The owner thread (``kvsidecar-nixl``) executes commands, posts transfers and polls. NIXL's own
  progress thread is disabled (with NIXL's hard-coded zero delay it spins a core per agent), so
  this thread drives progress: while anything is in flight or expected it polls transfer states
  and notifications, right away after activity and backing off to ``poll_interval_max``
  (``next_poll_delay``; 10 ms when it only lets a peer that just handshaked wire up); with
  nothing in flight it blocks on the command queue and uses no CPU.
- Notifications are handed to the loop through ``on_notifications`` with
  ``loop.call_soon_threadsafe``, in batches.

Large transfers are posted in chunks of at most ``max_post_bytes`` (``_Split``). Between two
processes on one host UCX copies by CMA inside ``agent.transfer()``, on this thread, so one 128 MiB
post held every other request's post (and its completion) for the whole copy. Chunks of different
requests are posted round robin, with the command queue drained between two chunks: a small
request waits for at most one chunk's copy. Only the last chunk carries the notification, and it is
posted only once every other chunk is DONE, so a peer never learns of data still in flight; every
chunk is checked against the transfer's deadline and ``not_after`` before it is posted.

NIXL has no timeouts of its own: every transfer carries a deadline enforced here. A transfer
that cannot be cancelled at its deadline keeps its handle (and therefore its blocks) until NIXL
releases it; its waiter learns the outcome only then, because handing the blocks back while the
transfer may still write would corrupt the next request's KV.

A deadline is also a validity bound, not only a timeout: the caller may pass one after which the
other side may reuse the memory (a pull's producer lease). So a transfer found DONE only after its
deadline is reported as failed (it may have finished after the other side gave up, e.g. this
process was stopped mid-transfer and resumed), and each poll cancels overdue transfers before it
drives any progress, so a resumed process does not progress them further.

Why ~600 lines: every NIXL object must live on this one thread, so the owner loop, its polling
and every command body (converting plans' explicit-descriptor transfers and staging pool
included) stay together; the values that cross it are in ``contract``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sidecar.config import NixlSettings
from sidecar.dataplane import cuda_ipc
from sidecar.dataplane.contract import (
    NOT_POSTED_LATE,
    DlistSpec,
    NotificationsCallback,
    RemoteAgent,
    RunsSpec,
    Staging,
    TransferResult,
    TransferSpec,
    XferDoneCallback,
)
from sidecar.dataplane.priority import PostPriority, name_thread
from sidecar.logs import get_logger, route_foreign_loggers

log = get_logger("kvsidecar.transport")

_LOCAL = "NIXL_INIT_AGENT"
# Poll cadence while something is expected: every ~50 us for 2 ms after activity (completions and
# notifications follow within microseconds), every 200 us for 100 ms after it (a busy sidecar's
# next request), then backing off to poll_interval_max_ms (a push that waits for a long prefill).
_HOT_WINDOW_S = 0.002
_MIN_DELAY_S = 0.00005
_WARM_WINDOW_S = 0.1
_WARM_DELAY_S = 0.0002
# Polled only so that a peer that just handshaked can wire up to our agents (``warm``), with no
# transfer or notification expected: its first transfer almost always follows at once (the warm
# window above), so later the owner thread polls at this pace. At poll_interval_max_ms it kept a
# sidecar at 0.05-0.09 of a core for the 5 s after every handshake; this costs a late first
# transfer at most this much more, once per peer.
_CONNECT_DELAY_S = 0.01


def next_poll_delay(delay: float, since_activity: float, poll_max: float, waits_only_for_connects: bool) -> float:
    """The owner thread's next sleep between polls, ``since_activity`` seconds after it last
    posted, completed or received something (pure)."""
    if since_activity < _WARM_WINDOW_S:
        return min(max(delay * 2, _MIN_DELAY_S), _WARM_DELAY_S)
    return min(delay * 2, max(poll_max, _CONNECT_DELAY_S) if waits_only_for_connects else poll_max)


# How long a post waits in place for a small transfer to complete.
_POST_SPIN_S = 0.00005
_NOTHING = object()  # "no command" marker in the owner loop
_DEFERRED = object()  # a command body that completes its future later


def _no_op() -> None:
    return None


class NixlUnavailable(RuntimeError):
    """NIXL could not be imported or an agent could not be created."""


# NIXL's wheels, one per CUDA major version; the ``nixl`` meta package only picks one of them.
_NIXL_PACKAGES = ("nixl_cu12", "nixl_cu13")


def nixl_package(installed: list[str], cuda_major: int | None) -> str:
    """Which installed NIXL wheel to use (pure): the only one, else the one built for ``cuda_major``."""
    if len(installed) == 1 or cuda_major is None:
        return installed[0]
    wanted = f"nixl_cu{cuda_major}"
    return wanted if wanted in installed else installed[0]


def load_nixl() -> tuple[Any, str]:
    """Import NIXL's Python API; returns (api module, version string)."""
    import importlib
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    installed = [name for name in _NIXL_PACKAGES if importlib.util.find_spec(name) is not None]
    if not installed:
        raise NixlUnavailable(
            "NIXL is not installed. Install it with `pip install --no-deps nixl-cu12==1.5.1 numpy` "
            "(nixl-cu13 on a CUDA 13 node; its plain dependency list pulls a CUDA torch)."
        )
    cuda_major = None
    if len(installed) > 1:
        try:
            from nixl_meta_utils import detect_cuda_major  # the ``nixl`` meta package (optional)

            cuda_major = detect_cuda_major()
        except Exception:  # no meta package, or its guess failed: the first installed wheel
            pass
    package = nixl_package(installed, cuda_major)
    # UCX's memory-type cache learns of GPU memory through hooks on CUDA's allocation calls; a
    # range mapped by a call it did not see (our cuIpcOpenMemHandle, looked up before UCX loaded)
    # stays "host" in it, and NIXL then refuses to register it as VRAM ("VRAM memory is detected as
    # host by UCX"): on an H100 the second engine's KV registered on one sidecar failed so. Without
    # the cache UCX asks the driver at each registration, off the transfer path. Read when UCX
    # loads, so set before the import; an operator's own value wins.
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    try:
        api = importlib.import_module(f"{package}._api")
    except ImportError as exc:
        raise NixlUnavailable(f"NIXL ({package}) is installed but does not import: {exc}") from exc
    distribution = package.replace("_", "-")
    try:
        nixl_version = f"{distribution} {version(distribution)}"
    except PackageNotFoundError:
        nixl_version = f"{distribution} unknown"
    route_foreign_loggers()
    return api, nixl_version


def available_backends() -> list[str]:
    """The backend plugins this NIXL installation offers (a throwaway agent asks NIXL)."""
    api, _ = load_nixl()
    config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
    agent = api.nixl_agent("kvsidecar-backend-probe", config)
    return [str(name) for name in agent.get_plugin_list()]


@dataclass
class _Agent:
    agent: Any
    registrations: list[Any] = field(default_factory=list)
    dlists: dict[tuple[str, Hashable], Any] = field(default_factory=dict)
    # Byte length of each descriptor of a prepared list (same keys as ``dlists``): splits posts.
    lengths: dict[tuple[str, Hashable], np.ndarray] = field(default_factory=dict)
    remotes: dict[str, bytes] = field(default_factory=dict)
    staging: list[Staging] = field(default_factory=list)
    hosted: set[tuple[int, int]] = field(default_factory=set)  # register_host ranges


@dataclass(eq=False)
class _Split:
    """A transfer posted as ``chunks`` bounded posts (see the module docstring). ``make(i)``
    creates chunk ``i``'s handle; the last one carries the notification."""

    state: _Agent
    agent_name: str
    remote_name: str
    op: str
    deadline: float
    not_after: float | None
    future: concurrent.futures.Future[TransferResult]
    make: Callable[[int], Any]
    chunks: int
    posted: int = 0
    outstanding: int = 0
    total: TransferResult = field(default_factory=lambda: TransferResult(True))
    failure: TransferResult | None = None
    observed: bool = True  # reported to on_xfer_done (RunsSpec.observed)

    def ready(self) -> bool:
        """Whether a chunk may be posted now: the last one only once every other is DONE."""
        return self.failure is None and (self.posted < self.chunks - 1 or self.outstanding == 0)


@dataclass
class _InFlight:
    agent_name: str
    handle: Any
    op: str
    deadline: float
    future: concurrent.futures.Future[TransferResult]
    started: float
    cancel_reason: str = ""
    split: _Split | None = None  # the transfer this post is a chunk of
    queued: float = 0.0  # when the loop queued the command (0: not measured)
    posted: float = 0.0  # when the post returned
    observed: bool = True  # reported to on_xfer_done (RunsSpec.observed)


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
        self._on_notifications = on_notifications
        self._on_xfer_done = on_xfer_done
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._agents: dict[str, _Agent] = {}
        self._in_flight: dict[int, _InFlight] = {}
        self._stuck: dict[int, _InFlight] = {}
        self._splits: deque[_Split] = deque()  # transfers with chunks left to post, round robin
        self._ids = itertools.count()
        self._expecting = 0
        self._warm_until = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._post_priority = PostPriority(settings.post_priority)

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
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
        future: concurrent.futures.Future[TransferResult] = concurrent.futures.Future()
        self._commands.put((self._post, (spec, future, time.monotonic()), future))
        return await asyncio.wrap_future(future)

    async def transfer_runs(self, spec: RunsSpec) -> TransferResult:
        """Like ``transfer`` with explicit descriptor arrays, prepared for this transfer only: for
        plans that change block size or layout, which are not a selection of a prepared view."""
        future: concurrent.futures.Future[TransferResult] = concurrent.futures.Future()
        self._commands.put((self._post_runs, (spec, future), future))
        return await asyncio.wrap_future(future)

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
        """Count of things waiting for notifications; polling continues while it is > 0."""
        self._commands.put((self._adjust_expecting, (delta,), concurrent.futures.Future()))

    def warm(self, seconds: float) -> None:
        """Poll for a while even with nothing expected, e.g. so a peer that just handshaked can
        connect to our agents (UCX wire-up needs both sides to progress)."""
        self._commands.put((self._set_warm, (time.monotonic() + seconds,), concurrent.futures.Future()))

    async def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((function, args, future))
        return await asyncio.wrap_future(future)

    # --- owner thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        name_thread("kvsidecar-nixl")
        delay = _MIN_DELAY_S
        last_activity = time.monotonic()
        while True:
            if not self._is_active():
                self._post_priority.lower()
                item = self._commands.get()  # nothing in flight or expected: sleep until told
            elif self._splits and any(split.ready() for split in self._splits):
                item = self._next_command()  # a chunk is ready: take what is queued, do not sleep
            else:
                self._post_priority.lower()
                hot = time.monotonic() - last_activity < _HOT_WINDOW_S
                try:
                    item = self._commands.get(timeout=_MIN_DELAY_S if hot else delay)
                except queue.Empty:
                    item = _NOTHING
            worked = False
            while item is not _NOTHING:
                if item is None:
                    return  # stop sentinel
                self._execute(*item)
                worked = True
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = _NOTHING
            progressed = self._poll() if self._is_active() else False
            if self._splits:
                progressed = self._post_next_chunk() or progressed
            now = time.monotonic()
            if worked or progressed:
                last_activity = now
                delay = _MIN_DELAY_S
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
        if notifications and self._loop is not None:
            progressed = True
            self._loop.call_soon_threadsafe(self._on_notifications, notifications, time.monotonic())
        now = time.monotonic()
        for xfer_id, xfer in list(self._in_flight.items()):
            owner = self._agents.get(xfer.agent_name)
            if owner is None:
                continue
            try:
                status = owner.agent.check_xfer_state(xfer.handle)
            except Exception as exc:
                self._finish(xfer_id, TransferResult(False, f"transfer failed: {exc}", peer_gone=_is_disconnect(exc)))
                progressed = True
                continue
            if status == "DONE":
                self._finish(xfer_id, self._done(owner, xfer))
                progressed = True
            elif status != "PROC":
                self._finish(xfer_id, TransferResult(False, f"NIXL reported transfer state {status}"))
                progressed = True
            elif now > xfer.deadline:
                xfer.cancel_reason = f"{xfer.op} did not complete within its deadline"
                self._finish(xfer_id, TransferResult(False, xfer.cancel_reason))
                progressed = True
        for xfer_id, xfer in list(self._stuck.items()):
            if self._try_release(xfer):
                del self._stuck[xfer_id]
                log.warning("nixl_transfer_released_late", agent=xfer.agent_name, op=xfer.op)
                failed = TransferResult(False, xfer.cancel_reason or "transfer failed")
                if xfer.split is not None:
                    self._chunk_done(xfer.split, failed)
                else:
                    self._complete(xfer.future, failed)
                progressed = True
        return progressed

    def _done(self, state: _Agent, xfer: _InFlight) -> TransferResult:
        """The result of a transfer NIXL reported DONE: a failure if seen only after its deadline,
        since its bytes may then have moved after the other side reused the memory."""
        if time.monotonic() > xfer.deadline:
            log.warning("nixl_transfer_done_after_deadline", agent=xfer.agent_name, op=xfer.op)
            return TransferResult(False, f"{xfer.op} completed only after its deadline; its data is not trusted")
        return self._telemetry(state, xfer)

    def _telemetry(self, state: _Agent, xfer: _InFlight) -> TransferResult:
        now = time.monotonic()
        result = TransferResult(True, duration_s=now - xfer.started)
        if xfer.queued and xfer.posted:
            result.handoff = {
                "owner_wait": xfer.started - xfer.queued,
                "owner_post": xfer.posted - xfer.started,
                "owner_done": now - xfer.posted,
            }
        try:
            telemetry = state.agent.get_xfer_telemetry(xfer.handle)
            result.bytes = int(telemetry.totalBytes)
            result.descriptors = int(telemetry.descCount)
            result.duration_s = telemetry.xferDuration / 1e6
            result.post_s = telemetry.postDuration / 1e6
        except Exception:
            pass
        return result

    def _finish(self, xfer_id: int, result: TransferResult) -> None:
        xfer = self._in_flight.pop(xfer_id)
        if not self._try_release(xfer):
            # The backend may still move bytes: keep the handle, report only once it is released.
            log.error("nixl_transfer_not_releasable", agent=xfer.agent_name, op=xfer.op, reason=result.error)
            xfer.cancel_reason = result.error or "transfer could not be released"
            self._stuck[xfer_id] = xfer
            return
        if xfer.split is not None:
            self._chunk_done(xfer.split, result)
            return
        if self._on_xfer_done is not None and xfer.observed:
            self._on_xfer_done(xfer.op, result)
        self._complete(xfer.future, result)

    # --- split transfers (owner thread) ----------------------------------------------------------

    def _post_next_chunk(self) -> bool:
        """Post one chunk of the first split transfer that has one ready, then move that transfer
        to the back of the queue (round robin). Returns whether a chunk was posted."""
        for _ in range(len(self._splits)):
            split = self._splits.popleft()
            if not split.ready():
                self._splits.append(split)
                continue
            now = time.monotonic()
            if split.not_after is not None and now > split.not_after:
                self._fail_split(split, NOT_POSTED_LATE)
                return True
            if now > split.deadline:
                self._fail_split(split, f"{split.op} did not complete within its deadline")
                return True
            index = split.posted
            split.posted += 1
            try:
                handle = split.make(index)
            except Exception as exc:
                split.posted -= 1
                self._fail_split(split, f"transfer setup failed: {exc}", peer_gone=_is_disconnect(exc))
                return True
            if split.posted < split.chunks:
                self._splits.append(split)
            split.outstanding += 1
            self._launch(split.state, split.agent_name, split.op, handle, split.deadline, split.future, now, split)
            return True
        return False

    def _chunk_done(self, split: _Split, result: TransferResult) -> None:
        split.outstanding -= 1
        if result.ok:
            total = split.total
            total.bytes += result.bytes
            total.descriptors += result.descriptors
            total.duration_s += result.duration_s
            total.post_s += result.post_s
        elif split.failure is None:
            split.failure = result
        self._end_split_if_done(split)

    def _fail_split(self, split: _Split, reason: str, peer_gone: bool = False) -> None:
        """No more chunks of ``split`` are posted; it ends once its posted chunks have."""
        if split.failure is None:
            split.failure = TransferResult(False, reason, peer_gone=peer_gone)
        self._end_split_if_done(split)

    def _end_split_if_done(self, split: _Split) -> None:
        if split.outstanding or (split.failure is None and split.posted < split.chunks):
            return
        if split in self._splits:
            self._splits.remove(split)
        result = split.failure or split.total
        if self._on_xfer_done is not None and split.observed:
            self._on_xfer_done(split.op, result)
        self._complete(split.future, result)

    def _fail_splits(self, reason: str, state: _Agent | None = None, remote_name: str | None = None) -> None:
        """Stop the split transfers of ``state`` (to ``remote_name``), or all: their agent, remote
        metadata or prepared lists are about to go, and a later chunk must not use them."""
        for split in list(self._splits):
            if (state is None or split.state is state) and (remote_name is None or split.remote_name == remote_name):
                self._fail_split(split, reason)

    def _split(
        self,
        state: _Agent,
        agent_name: str,
        remote_name: str,
        spec: TransferSpec | RunsSpec,
        future: concurrent.futures.Future[TransferResult],
        sizes: np.ndarray,
        make: Callable[[np.ndarray, bytes], Any],
    ) -> _Split | None:
        """A ``_Split`` over the descriptors whose byte lengths are ``sizes`` (``make(rows,
        notification)`` creates the handle of a chunk of rows), or None when one post is enough."""
        limit = self._settings.max_post_bytes
        if not limit or len(sizes) < 2:
            return None
        sizes = np.asarray(sizes, dtype=np.int64)
        starts = np.cumsum(sizes) - sizes
        cuts = np.flatnonzero(np.diff(starts // limit)) + 1  # a chunk per window of `limit` bytes
        if not len(cuts):
            return None
        rows = np.split(np.arange(len(sizes)), cuts)
        last = len(rows) - 1
        notification = spec.notification
        return _Split(
            state,
            agent_name,
            remote_name,
            spec.op,
            spec.deadline,
            spec.not_after,
            future,
            lambda index: make(rows[index], notification if index == last else b""),
            len(rows),
        )

    def _start_split(self, split: _Split) -> object:
        self._splits.append(split)
        self._post_next_chunk()
        return _DEFERRED

    @staticmethod
    def _try_release(xfer: _InFlight) -> bool:
        try:
            xfer.handle.release()
            return True
        except Exception:
            return False

    @staticmethod
    def _complete(future: concurrent.futures.Future[TransferResult], result: TransferResult) -> None:
        result.reported_at = time.monotonic()
        if not future.done():
            future.set_result(result)

    # --- command bodies (owner thread) ----------------------------------------------------------

    def _agent_config(self) -> Any:
        return self._api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            capture_telemetry=True,
            num_threads=self._settings.num_threads,
            backends=[],
        )

    def _create_agent(self, name: str, regions: list[tuple[int, int, int]], mem_type: str) -> bytes:
        if name in self._agents:
            raise ValueError(f"agent {name} exists")
        if mem_type == "VRAM":
            # CUDA contexts are per thread: UCX registers (and later copies) GPU memory from this
            # one, so the device's primary context, where the IPC handles were opened, is made
            # current here too, before the backends are created.
            for device_id in sorted({d for _, _, d in regions}):
                cuda_ipc.make_current(device_id)
        agent = self._api.nixl_agent(name, self._agent_config())
        for backend in self._settings.backends:
            params: dict[str, str] = {}
            if backend == "UCX":
                params["ucx_error_handling_mode"] = self._settings.ucx_error_handling_mode
                if self._settings.num_threads:
                    params["num_threads"] = str(self._settings.num_threads)
            agent.create_backend(backend, params)
        state = _Agent(agent)
        if regions:
            state.registrations.append(agent.register_memory([(a, n, d, "") for a, n, d in regions], mem_type))
        self._agents[name] = state
        return bytes(agent.get_agent_metadata())

    def _drop_agent(self, name: str) -> None:
        state = self._agents.pop(name, None)
        if state is not None:
            self._fail_splits("the worker was unregistered", state)
        for other in self._agents.values():
            if name in other.remotes:
                self._unload(other, name)
        if state is None:
            return
        for xfer_id, xfer in list(self._in_flight.items()):
            if xfer.agent_name == name:
                self._finish(xfer_id, TransferResult(False, "the worker was unregistered"))
        for handle in state.dlists.values():
            _quietly(handle.release)
        state.dlists.clear()
        state.lengths.clear()
        for remote in list(state.remotes):
            _quietly(state.agent.remove_remote_agent, remote)
        for registration in state.registrations:
            _quietly(state.agent.deregister_memory, registration)
        state.registrations.clear()
        state.staging.clear()  # deregistered above with the other registrations
        state.hosted.clear()
        # The agent object is dropped here, on the owner thread, so its destructor runs here too.
        del state

    def _drop_remote(self, names: list[str]) -> None:
        for state in self._agents.values():
            for name in names:
                if name in state.remotes:
                    self._unload(state, name)

    def _unload(self, state: _Agent, remote_name: str) -> None:
        self._fail_splits(f"the remote agent {remote_name} was unloaded", state, remote_name)
        for key in [key for key in state.dlists if key[0] == remote_name]:
            state.lengths.pop(key, None)
            _quietly(state.dlists.pop(key).release)
        _quietly(state.agent.remove_remote_agent, remote_name)
        state.remotes.pop(remote_name, None)

    def _ensure_remote(self, state: _Agent, remote: RemoteAgent) -> None:
        known = state.remotes.get(remote.name)
        if known == remote.metadata:
            return
        if known is not None:
            self._unload(state, remote.name)
        loaded = state.agent.add_remote_agent(remote.metadata)
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != remote.name:
            _quietly(state.agent.remove_remote_agent, loaded_name)
            raise ValueError(f"agent metadata names {loaded_name!r}, expected {remote.name!r}")
        state.remotes[remote.name] = remote.metadata

    def _dlist(self, state: _Agent, target: str, spec: DlistSpec) -> Any:
        slot = (target, spec.key)
        handle = state.dlists.get(slot)
        if handle is None:
            descriptors = spec.build()
            handle = state.agent.prep_xfer_dlist(target, descriptors, spec.mem_type)
            state.dlists[slot] = handle
            state.lengths[slot] = np.asarray(descriptors[:, 1], dtype=np.int64) if len(descriptors) else np.zeros(0)
        return handle

    def _post(
        self, spec: TransferSpec, future: concurrent.futures.Future[TransferResult], queued: float = 0.0
    ) -> object:
        """Post a transfer; its future completes later, from _poll (hence _DEFERRED). ``queued``:
        when the loop queued it (the trace's owner_wait)."""
        agent_name, op, remote = spec.agent_name, spec.op, spec.remote
        now = time.monotonic()
        if spec.not_after is not None and now > spec.not_after:
            self._complete(future, TransferResult(False, NOT_POSTED_LATE))
            return _DEFERRED
        state = self._agents.get(agent_name)
        if state is None:
            self._complete(future, TransferResult(False, f"local agent {agent_name} is gone"))
            return _DEFERRED
        try:
            self._ensure_remote(state, remote)
            local_handle = self._dlist(state, _LOCAL, spec.local_list)
            remote_handle = self._dlist(state, remote.name, spec.remote_list)
            local_indices, remote_indices = spec.local_indices, spec.remote_indices

            def make(rows: np.ndarray, notification: bytes) -> Any:
                return state.agent.make_prepped_xfer(
                    op, local_handle, local_indices[rows], remote_handle, remote_indices[rows], notif_msg=notification
                )

            sizes = state.lengths[(_LOCAL, spec.local_list.key)][local_indices]
            split = self._split(state, agent_name, remote.name, spec, future, sizes, make)
            if split is not None:
                return self._start_split(split)
            handle = state.agent.make_prepped_xfer(
                op, local_handle, local_indices, remote_handle, remote_indices, notif_msg=spec.notification
            )
        except Exception as exc:
            self._complete(
                future, TransferResult(False, f"transfer setup failed: {exc}", peer_gone=_is_disconnect(exc))
            )
            return _DEFERRED
        return self._launch(state, agent_name, op, handle, spec.deadline, future, now, queued=queued)

    def _post_runs(self, spec: RunsSpec, future: concurrent.futures.Future[TransferResult]) -> object:
        """Post a transfer over explicit descriptor arrays (prepared for this transfer only)."""
        now = time.monotonic()
        if spec.not_after is not None and now > spec.not_after:
            self._complete(future, TransferResult(False, NOT_POSTED_LATE))
            return _DEFERRED
        state = self._agents.get(spec.agent_name)
        if state is None:
            self._complete(future, TransferResult(False, f"local agent {spec.agent_name} is gone"))
            return _DEFERRED
        try:
            self._ensure_remote(state, spec.remote)

            def make(rows: np.ndarray | slice, notification: bytes) -> Any:
                return state.agent.initialize_xfer(
                    spec.op,
                    state.agent.get_xfer_descs(spec.local[rows], spec.local_mem),
                    state.agent.get_xfer_descs(spec.remote_descs[rows], spec.remote_mem),
                    spec.remote.name,
                    notif_msg=notification,
                )

            split = self._split(state, spec.agent_name, spec.remote.name, spec, future, spec.local[:, 1], make)
            if split is not None:
                split.observed = spec.observed
                return self._start_split(split)
            handle = make(slice(None), spec.notification)
        except Exception as exc:
            self._complete(
                future, TransferResult(False, f"transfer setup failed: {exc}", peer_gone=_is_disconnect(exc))
            )
            return _DEFERRED
        return self._launch(state, spec.agent_name, spec.op, handle, spec.deadline, future, now, observed=spec.observed)

    def _launch(
        self,
        state: _Agent,
        agent_name: str,
        op: str,
        handle: Any,
        deadline: float,
        future: concurrent.futures.Future[TransferResult],
        now: float,
        split: _Split | None = None,
        queued: float = 0.0,
        observed: bool = True,
    ) -> object:
        xfer = _InFlight(agent_name, handle, op, deadline, future, now, split=split, queued=queued, observed=observed)
        xfer_id = next(self._ids)
        self._in_flight[xfer_id] = xfer
        try:
            self._post_priority.raise_()  # the copy runs inside the post (priority.py)
            status = state.agent.transfer(handle)
        except Exception as exc:
            self._finish(xfer_id, TransferResult(False, f"transfer failed: {exc}", peer_gone=_is_disconnect(exc)))
            return _DEFERRED
        xfer.posted = time.monotonic()
        # Small transfers complete within microseconds: check a few times before leaving it to
        # the poll loop, whose sleeps are ~60 us at the finest.
        spin_until = time.perf_counter() + _POST_SPIN_S
        while status == "PROC" and time.perf_counter() < spin_until:
            try:
                status = state.agent.check_xfer_state(handle)
            except Exception as exc:
                self._finish(xfer_id, TransferResult(False, f"transfer failed: {exc}", peer_gone=_is_disconnect(exc)))
                return _DEFERRED
        if status == "DONE":
            self._finish(xfer_id, self._done(state, xfer))
        elif status != "PROC":
            self._finish(xfer_id, TransferResult(False, f"NIXL refused the transfer (state {status})"))
        return _DEFERRED

    def _notify(self, agent_name: str, remote: RemoteAgent, payload: bytes) -> None:
        state = self._agents.get(agent_name)
        if state is None:
            raise ValueError(f"local agent {agent_name} is gone")
        self._ensure_remote(state, remote)
        state.agent.send_notif(remote.name, payload)

    def _lend_staging(self, agent_name: str, nbytes: int) -> Staging:
        state = self._agents.get(agent_name)
        if state is None:
            raise ValueError(f"local agent {agent_name} is gone")
        for staging in state.staging:
            if not staging.busy and staging.array.size >= nbytes:
                staging.busy = True
                return staging
        size = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
        array = np.zeros(size, dtype=np.uint8)
        array[::4096] = 1  # fault every page in now, not during the first transfer
        state.registrations.append(state.agent.register_memory([(int(array.ctypes.data), size, 0, "")], "DRAM"))
        staging = Staging(array, busy=True)
        state.staging.append(staging)
        return staging

    def _register_host(self, agent_name: str, address: int, nbytes: int) -> bytes:
        state = self._agents.get(agent_name)
        if state is None:
            raise ValueError(f"local agent {agent_name} is gone")
        if (address, nbytes) not in state.hosted:
            state.registrations.append(state.agent.register_memory([(address, nbytes, 0, "")], "DRAM"))
            state.hosted.add((address, nbytes))
        return bytes(state.agent.get_agent_metadata())

    @staticmethod
    def _return_staging(staging: Staging) -> None:
        staging.busy = False

    def _adjust_expecting(self, delta: int) -> None:
        self._expecting = max(0, self._expecting + delta)

    def _set_warm(self, until: float) -> None:
        self._warm_until = max(self._warm_until, until)

    def _shutdown_all(self) -> None:
        self._fail_splits("the sidecar is shutting down")
        for xfer_id in list(self._in_flight):
            self._finish(xfer_id, TransferResult(False, "the sidecar is shutting down"))
        for name in list(self._agents):
            self._drop_agent(name)


def _is_disconnect(exc: BaseException) -> bool:
    return "Disconnect" in type(exc).__name__ or "disconnect" in str(exc).lower()


def _quietly(function: Callable[..., Any], *args: Any) -> None:
    try:
        function(*args)
    except Exception as exc:
        log.debug("nixl_cleanup_failed", call=getattr(function, "__name__", "?"), error=str(exc))
