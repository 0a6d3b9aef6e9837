"""A small synchronous, thread-safe client of the local sidecar's EngineService.

Used by the vLLM connector (inside vLLM's processes), by simulated engines, the demo and the
tests. It imports nothing of the daemon: only the generated ``kvsidecar.v1`` stubs and grpc.

- Request calls have a blocking form (``submit_blocks``) and a non-blocking one
  (``submit_blocks_async``) returning a ``concurrent.futures.Future``, so vLLM's scheduler never
  waits on the network. The non-blocking calls run as blocking calls on a few long-lived RPC
  threads: grpc's own futures start a fresh "channel spin" thread whenever the channel was idle,
  and ``Thread.start()`` waits until that thread runs, which stalled vLLM's scheduler thread for
  30-400 ms on a busy 2-core machine.
- ``EventWatcher`` drains one worker's WatchEvents stream in a daemon thread into a queue; the
  owner reads it without blocking (``drain``) or with a bound (``wait``).
- Every call carries the session token the sidecar's credential socket gave this process after
  checking its uid (``kvsidecar.engine_auth``); ``engine_channel`` is such a channel for code that
  uses the stubs directly (tools, tests). The token is fetched at the first call and again when
  the sidecar refuses one as stale (it restarted), and that call is retried once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvsidecar.engine_auth import NO_TOKEN, TOKEN_KEY, auth_socket_for, request_token
from kvsidecar.v1 import common_pb2, engine_pb2, engine_pb2_grpc

BlockIdsLike = Sequence[Sequence[int]]
Future = concurrent.futures.Future
# Non-blocking calls in flight at once; more queue up (each call has a deadline).
_RPC_THREADS = 8

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # Notice a dead sidecar on an idle WatchEvents stream within seconds.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


def grouped(block_ids: BlockIdsLike | None) -> common_pb2.GroupedBlockIds:
    """vLLM's tuple-of-lists block ids as the proto message."""
    if block_ids is None:
        return common_pb2.GroupedBlockIds()
    return common_pb2.GroupedBlockIds(groups=[common_pb2.BlockIdList(ids=list(group)) for group in block_ids])


def remote(
    address: str,
    engine_id: str,
    request_id: str = "",
    block_ids: BlockIdsLike | None = None,
    tp_size: int = 0,
    num_tokens: int = 0,
    voucher: bytes = b"",
    vouched_until_ms: int = 0,
) -> engine_pb2.RemoteBlocks:
    return engine_pb2.RemoteBlocks(
        address=address,
        engine_id=engine_id,
        request_id=request_id,
        block_ids=grouped(block_ids),
        tp_size=tp_size,
        num_tokens=num_tokens,
        voucher=voucher,
        vouched_until_ms=vouched_until_ms,
    )


log = logging.getLogger("kvsidecar.engine_shim")


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ["method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"]
    ),
    grpc.ClientCallDetails,
):
    pass


class SessionToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the session token to every call (see the module docstring). Thread-safe."""

    def __init__(
        self, auth_socket: str | os.PathLike[str] | None, timeout: float = 5.0, problem_level: int = logging.WARNING
    ) -> None:
        self._auth_socket = auth_socket
        self._timeout = timeout
        self._token = ""
        self._problem = ""
        # A readiness poll of a sidecar still starting expects refusals: it logs them at DEBUG.
        self._problem_level = problem_level
        self._lock = threading.Lock()

    @property
    def problem(self) -> str:
        """Why the last request for a token failed ("" after one succeeded)."""
        with self._lock:
            return self._problem

    def current(self, stale: str = "") -> str:
        """The token, asked for when there is none yet or the one the sidecar refused is ``stale``."""
        with self._lock:
            if self._auth_socket is not None and (not self._token or self._token == stale):
                try:
                    self._token = request_token(self._auth_socket, self._timeout)
                    self._problem = ""
                except OSError as exc:  # refused (PermissionError) or no sidecar: the call says so
                    self._token = ""
                    if str(exc) != self._problem:
                        log.log(self._problem_level, "no session token from the sidecar: %s", exc)
                    self._problem = str(exc)
            return self._token

    @staticmethod
    def _with(details: grpc.ClientCallDetails, token: str) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), (TOKEN_KEY, token)] if token else details.metadata
        extra = (getattr(details, "wait_for_ready", None), getattr(details, "compression", None))
        return _CallDetails(details.method, details.timeout, metadata, details.credentials, *extra)

    def intercept_unary_unary(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        token = self.current()
        outcome = continuation(self._with(details, token), request)
        if outcome.code() == grpc.StatusCode.PERMISSION_DENIED and NO_TOKEN in (outcome.details() or ""):
            fresh = self.current(stale=token)  # the sidecar restarted since: a new token, once
            if fresh and fresh != token:
                outcome = continuation(self._with(details, fresh), request)
        return outcome

    def intercept_unary_stream(self, continuation: Any, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._with(details, self.current()), request)


def engine_channel(
    socket_path: str | os.PathLike[str] | None = None,
    target: str | None = None,
    auth_socket: str | os.PathLike[str] | None = None,
    options: Sequence[tuple[str, Any]] = (),
    token: SessionToken | None = None,
) -> grpc.Channel:
    """A channel to a sidecar's engine socket (or loopback ``target``) whose calls carry a session
    token. A TCP ``target`` needs ``auth_socket`` (the credential socket next to the engine socket).
    ``token``: the session token to use (e.g. one shared by successive channels), else a new one."""
    if target is None:
        if socket_path is None:
            raise ValueError("give socket_path or target")
        target = f"unix:{os.fspath(socket_path)}"
        auth_socket = auth_socket or auth_socket_for(socket_path)
    channel = grpc.insecure_channel(target, options=list(options))
    return grpc.intercept_channel(channel, token or SessionToken(auth_socket))


class SidecarClient:
    """EngineService over the sidecar's Unix socket (or a loopback ``host:port`` target, with the
    ``auth_socket`` to get its session token from)."""

    def __init__(
        self,
        socket_path: str | Path | None = None,
        target: str | None = None,
        timeout: float = 10.0,
        auth_socket: str | Path | None = None,
    ) -> None:
        self.timeout = timeout
        self._channel = engine_channel(socket_path, target, auth_socket, _CHANNEL_OPTIONS)
        self.target = target or f"unix:{socket_path}"
        self.stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._rpc_threads = concurrent.futures.ThreadPoolExecutor(_RPC_THREADS, thread_name_prefix="kvsidecar-rpc")
        # Calls running on the RPC threads (close waits for them, bounded).
        self._calls_changed = threading.Condition()
        self._running = 0

    def close(self) -> None:
        """Cancel queued calls, give running ones up to ``timeout`` to end, then close the channel:
        gRPC's C core can crash a thread whose call runs on an intercepted channel closed under it
        (seen: SIGSEGV in cygrpc with a call to a stopped sidecar in flight at close). It joins no
        thread, so a call's done callback (on an RPC thread) may close the client too."""
        self._rpc_threads.shutdown(wait=False, cancel_futures=True)
        with self._calls_changed:
            self._calls_changed.wait_for(lambda: self._running == 0, timeout=self.timeout)
        self._await_connectivity_poller()
        self._channel.close()

    def _await_connectivity_poller(self) -> None:
        """Let gRPC's connectivity poller thread end before the channel closes. ``subscribe`` (and
        ``channel_ready_future``) start it; once nobody is subscribed it stops at its next wake-up,
        within 0.2 s, but a channel closed before that makes it raise "Channel closed!" in its
        thread, a traceback in the engine's log at every shutdown (grpc/grpc#18995). Bounded at
        0.5 s; a gRPC without the attributes read here closes at once, as before."""
        inner = getattr(self._channel, "_channel", self._channel)  # under grpc.intercept_channel
        state = getattr(inner, "_connectivity_state", None)
        if state is None or not hasattr(state, "polling"):
            return
        deadline = time.monotonic() + 0.5
        while state.polling and not state.callbacks_and_connectivities and time.monotonic() < deadline:
            time.sleep(0.01)

    def _start(self, method: Callable[..., Any], request: Any) -> concurrent.futures.Future[Any]:
        """Run one unary call on the RPC threads; the future completes with its response or error."""
        return self._rpc_threads.submit(self._call, method, request)

    def _call(self, method: Callable[..., Any], request: Any) -> Any:
        with self._calls_changed:
            self._running += 1
        try:
            return method(request, timeout=self.timeout)
        finally:
            with self._calls_changed:
                self._running -= 1
                self._calls_changed.notify_all()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float) -> None:
        """Block until the sidecar answers (bounded)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    # --- registration ---------------------------------------------------------------------------

    def register_worker(self, request: engine_pb2.RegisterWorkerRequest) -> engine_pb2.RegisterWorkerResponse:
        response: engine_pb2.RegisterWorkerResponse = self.stub.RegisterWorker(request, timeout=self.timeout)
        return response

    def unregister_worker(
        self, engine_id: str, tp_rank: int = 0, pp_rank: int = 0
    ) -> engine_pb2.UnregisterWorkerResponse:
        request = engine_pb2.UnregisterWorkerRequest(engine_id=engine_id, tp_rank=tp_rank, pp_rank=pp_rank)
        response: engine_pb2.UnregisterWorkerResponse = self.stub.UnregisterWorker(request, timeout=self.timeout)
        return response

    def watch(self, engine_id: str, tp_rank: int = 0, pp_rank: int = 0) -> EventWatcher:
        return EventWatcher(self, engine_id, tp_rank, pp_rank)

    # --- request calls --------------------------------------------------------------------------

    @staticmethod
    def submit_request(
        engine_id: str,
        request_id: str,
        block_ids: BlockIdsLike,
        transfer_id: str = "",
        num_tokens: int = 0,
        lease_seconds: float = 0.0,
        mode: int = common_pb2.TRANSFER_MODE_UNSPECIFIED,
        vouched_until_ms: int = 0,
    ) -> engine_pb2.SubmitBlocksRequest:
        return engine_pb2.SubmitBlocksRequest(
            engine_id=engine_id,
            request_id=request_id,
            transfer_id=transfer_id,
            block_ids=grouped(block_ids),
            num_tokens=num_tokens,
            lease_seconds=lease_seconds,
            mode=mode,  # type: ignore[arg-type]
            vouched_until_ms=vouched_until_ms,
        )

    def submit_blocks(self, *args: Any, **kwargs: Any) -> engine_pb2.SubmitBlocksResponse:
        response: engine_pb2.SubmitBlocksResponse = self.stub.SubmitBlocks(
            self.submit_request(*args, **kwargs), timeout=self.timeout
        )
        return response

    def submit_blocks_async(self, *args: Any, **kwargs: Any) -> Future[engine_pb2.SubmitBlocksResponse]:
        return self._start(self.stub.SubmitBlocks, self.submit_request(*args, **kwargs))

    @staticmethod
    def pull_request(
        engine_id: str,
        request_id: str,
        local_block_ids: BlockIdsLike,
        remote_blocks: engine_pb2.RemoteBlocks,
        transfer_id: str = "",
        timeout_seconds: float = 0.0,
    ) -> engine_pb2.PullRequest:
        return engine_pb2.PullRequest(
            engine_id=engine_id,
            request_id=request_id,
            transfer_id=transfer_id,
            local_block_ids=grouped(local_block_ids),
            remote=remote_blocks,
            timeout_seconds=timeout_seconds,
        )

    def pull(self, *args: Any, **kwargs: Any) -> engine_pb2.PullResponse:
        response: engine_pb2.PullResponse = self.stub.Pull(self.pull_request(*args, **kwargs), timeout=self.timeout)
        return response

    def pull_async(self, *args: Any, **kwargs: Any) -> Future[engine_pb2.PullResponse]:
        return self._start(self.stub.Pull, self.pull_request(*args, **kwargs))

    def keep_alive_async(
        self,
        engine_id: str,
        request_id: str,
        remote_blocks: engine_pb2.RemoteBlocks,
        transfer_id: str = "",
        timeout_seconds: float = 0.0,
    ) -> Future[engine_pb2.KeepAliveResponse]:
        request = engine_pb2.KeepAliveRequest(
            engine_id=engine_id,
            request_id=request_id,
            transfer_id=transfer_id,
            remote=remote_blocks,
            timeout_seconds=timeout_seconds,
        )
        return self._start(self.stub.KeepAlive, request)

    def keep_alive(self, *args: Any, **kwargs: Any) -> engine_pb2.KeepAliveResponse:
        response: engine_pb2.KeepAliveResponse = self.keep_alive_async(*args, **kwargs).result()
        return response

    @staticmethod
    def expect_push_request(
        engine_id: str,
        request_id: str,
        block_ids: BlockIdsLike,
        remote_blocks: engine_pb2.RemoteBlocks,
        transfer_id: str = "",
        timeout_seconds: float = 0.0,
    ) -> engine_pb2.ExpectPushRequest:
        return engine_pb2.ExpectPushRequest(
            engine_id=engine_id,
            request_id=request_id,
            transfer_id=transfer_id,
            block_ids=grouped(block_ids),
            remote=remote_blocks,
            timeout_seconds=timeout_seconds,
        )

    def expect_push(self, *args: Any, **kwargs: Any) -> engine_pb2.ExpectPushResponse:
        response: engine_pb2.ExpectPushResponse = self.stub.ExpectPush(
            self.expect_push_request(*args, **kwargs), timeout=self.timeout
        )
        return response

    def expect_push_async(self, *args: Any, **kwargs: Any) -> Future[engine_pb2.ExpectPushResponse]:
        return self._start(self.stub.ExpectPush, self.expect_push_request(*args, **kwargs))

    def release(
        self, engine_id: str, request_id: str, transfer_id: str = "", reason: str = ""
    ) -> engine_pb2.ReleaseResponse:
        request = engine_pb2.ReleaseRequest(
            engine_id=engine_id, request_id=request_id, transfer_id=transfer_id, reason=reason
        )
        response: engine_pb2.ReleaseResponse = self.stub.Release(request, timeout=self.timeout)
        return response

    def release_async(
        self, engine_id: str, request_id: str, transfer_id: str = "", reason: str = ""
    ) -> Future[engine_pb2.ReleaseResponse]:
        request = engine_pb2.ReleaseRequest(
            engine_id=engine_id, request_id=request_id, transfer_id=transfer_id, reason=reason
        )
        return self._start(self.stub.Release, request)

    @staticmethod
    def hold_blocks_request(
        engine_id: str,
        request_id: str,
        block_ids: BlockIdsLike,
        conversation_id: str = "",
        num_tokens: int = 0,
        ttl_seconds: float = 0.0,
        block_hashes: Sequence[bytes] = (),
    ) -> engine_pb2.HoldBlocksRequest:
        return engine_pb2.HoldBlocksRequest(
            engine_id=engine_id,
            request_id=request_id,
            conversation_id=conversation_id,
            block_ids=grouped(block_ids),
            num_tokens=num_tokens,
            ttl_seconds=ttl_seconds,
            block_hashes=list(block_hashes),
        )

    def hold_blocks(self, *args: Any, **kwargs: Any) -> engine_pb2.HoldBlocksResponse:
        response: engine_pb2.HoldBlocksResponse = self.stub.HoldBlocks(
            self.hold_blocks_request(*args, **kwargs), timeout=self.timeout
        )
        return response

    def hold_blocks_async(self, *args: Any, **kwargs: Any) -> Future[engine_pb2.HoldBlocksResponse]:
        return self._start(self.stub.HoldBlocks, self.hold_blocks_request(*args, **kwargs))

    @staticmethod
    def query_cache_request(
        engine_id: str,
        address: str = "",
        conversation_id: str = "",
        request_id: str = "",
        block_hashes: Sequence[bytes] = (),
        known_peers: bool = False,
        timeout_seconds: float = 0.0,
    ) -> engine_pb2.QueryCacheRequest:
        return engine_pb2.QueryCacheRequest(
            engine_id=engine_id,
            address=address,
            conversation_id=conversation_id,
            request_id=request_id,
            block_hashes=list(block_hashes),
            known_peers=known_peers,
            timeout_seconds=timeout_seconds,
        )

    def query_cache(self, *args: Any, **kwargs: Any) -> engine_pb2.QueryCacheResponse:
        response: engine_pb2.QueryCacheResponse = self.stub.QueryCache(
            self.query_cache_request(*args, **kwargs), timeout=self.timeout
        )
        return response

    def query_cache_async(self, *args: Any, **kwargs: Any) -> Future[engine_pb2.QueryCacheResponse]:
        return self._start(self.stub.QueryCache, self.query_cache_request(*args, **kwargs))

    def status(self, include_requests: bool = False) -> engine_pb2.GetStatusResponse:
        response: engine_pb2.GetStatusResponse = self.stub.GetStatus(
            engine_pb2.GetStatusRequest(include_requests=include_requests), timeout=self.timeout
        )
        return response

    def status_async(self, include_requests: bool = False) -> Future[engine_pb2.GetStatusResponse]:
        return self._start(self.stub.GetStatus, engine_pb2.GetStatusRequest(include_requests=include_requests))

    def subscribe_connectivity(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        """Call ``callback`` (on a gRPC thread) with every connectivity change of the channel, and
        keep the channel connecting, so a caller can tell without an RPC that the sidecar is down."""
        self._channel.subscribe(callback, try_to_connect=True)

    def unsubscribe_connectivity(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        self._channel.unsubscribe(callback)


class EventWatcher:
    """Drains one worker's WatchEvents stream into a queue from a daemon thread.

    ``connected`` turns true at WATCH_STARTED; when the stream ends (the sidecar stopped, or it
    dropped the worker) ``closed`` is set and ``on_closed`` runs with the reason. Events never
    block the caller: ``drain()`` returns what arrived, ``wait()`` waits with a bound.
    """

    def __init__(
        self,
        client: SidecarClient,
        engine_id: str,
        tp_rank: int = 0,
        pp_rank: int = 0,
        on_closed: Callable[[str], None] | None = None,
        on_event: Callable[[engine_pb2.Event], None] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.sidecar_id = ""
        self.connected = threading.Event()
        self.closed = threading.Event()
        self.close_reason = ""
        self._events: queue.SimpleQueue[engine_pb2.Event] = queue.SimpleQueue()
        self._on_closed = on_closed
        self._on_event = on_event
        request = engine_pb2.WatchEventsRequest(engine_id=engine_id, tp_rank=tp_rank, pp_rank=pp_rank)
        self._call = client.stub.WatchEvents(request)
        self._thread = threading.Thread(target=self._run, name=f"kvsidecar-events-{engine_id}-tp{tp_rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        reason = "the stream ended"
        try:
            for event in self._call:
                if event.kind == engine_pb2.WATCH_STARTED:
                    self.sidecar_id = event.sidecar_id
                    self.connected.set()
                    continue
                if self._on_event is not None:
                    self._on_event(event)
                else:
                    self._events.put(event)
        except grpc.RpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        finally:
            self.close_reason = reason
            self.closed.set()
            if self._on_closed is not None:
                self._on_closed(reason)

    def wait_connected(self, timeout: float) -> None:
        if not self.connected.wait(timeout):
            raise TimeoutError(f"WatchEvents did not start within {timeout}s ({self.close_reason or 'no answer'})")

    def drain(self) -> list[engine_pb2.Event]:
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def wait(self, timeout: float) -> engine_pb2.Event | None:
        """The next event, or None after ``timeout`` seconds."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait_for(
        self, request_ids: Iterable[str], timeout: float, kinds: Iterable[int] | None = None
    ) -> dict[str, engine_pb2.Event]:
        """Wait until a terminal event arrived for every request id (bounded). Other events are kept."""
        wanted = set(request_ids)
        allowed = set(kinds) if kinds is not None else None
        found: dict[str, engine_pb2.Event] = {}
        kept: list[engine_pb2.Event] = []
        deadline = time.monotonic() + timeout
        while wanted - found.keys():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            event = self.wait(remaining)
            if event is None:
                break
            if event.request_id in wanted and (allowed is None or event.kind in allowed):
                found[event.request_id] = event
            else:
                kept.append(event)
        for event in kept:
            self._events.put(event)
        return found

    def cancel(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5.0)
