"""A small synchronous, thread-safe client of the local sidecar's EngineService.

Used by the vLLM connector (inside vLLM's processes), by simulated engines, the demo and the
tests. It imports nothing of the daemon: only the generated ``kvsidecar.v1`` stubs and grpc.

- The calls come from one table in ``SidecarClient`` (one ``engine_rpc`` row per RPC: method,
  request builder from ``engine_shim.messages``, response type), which generates each call's
  builder (``submit_request``), blocking form (``submit_blocks``) and non-blocking form
  (``submit_blocks_async``, a ``concurrent.futures.Future``), so vLLM's scheduler never waits on
  the network. Every call goes through ``SidecarClient.call`` / ``start``.
- Request calls ride the engine session stream (``engine_shim.session``: one stream per client,
  on the plain Unix socket next to the engine socket when the sidecar has it, else the Session
  RPC) when it is open, else they are unary. Non-blocking unary calls run as blocking
  calls on a few long-lived RPC threads: grpc's own futures start a fresh "channel spin" thread
  whenever the channel was idle, and ``Thread.start()`` waits until that thread runs, which
  stalled vLLM's scheduler thread for 30-400 ms on a busy 2-core machine.
- ``EventWatcher`` (``engine_shim.events``) drains one worker's events into a queue, over the
  session stream when the sidecar has it, else over WatchEvents; the owner reads it without
  blocking (``drain``) or with a bound (``wait``).
- Every call carries the session token the sidecar's credential socket gave this process after
  checking its uid (``kvsidecar.engine_auth``); ``engine_channel`` is such a channel for code that
  uses the stubs directly (tools, tests). The token is fetched at the first call and again when
  the sidecar refuses one as stale (it restarted), and that call is retried once (a session
  stream refused so renews it and reopens).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, ParamSpec, TypeVar

import grpc
from google.protobuf.message import Message

from engine_shim import messages
from engine_shim.backoff import RefusalBackoff
from engine_shim.events import EventWatcher as EventWatcher
from engine_shim.messages import BlockIdsLike as BlockIdsLike
from engine_shim.messages import grouped as grouped
from engine_shim.messages import remote as remote
from engine_shim.session import EngineSession, SessionCallError
from kvsidecar.engine_auth import NO_TOKEN, TOKEN_KEY, auth_socket_for, request_token
from kvsidecar.session_socket import session_socket_for
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc

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


log = logging.getLogger("kvsidecar.engine_shim")

# --- the table's machinery -----------------------------------------------------------------------

P = ParamSpec("P")
Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


@dataclass(frozen=True)
class EngineRpc(Generic[P, Req, Resp]):
    """One EngineService RPC the shim calls: its method name, its request builder (whose return
    type is the request type) and its response type."""

    method: str
    build: Callable[P, Req]
    response: type[Resp]
    # Rides the session stream when it is open (registration stays unary: once per worker, and
    # its message can be large).
    session: bool = True


# Every row of SidecarClient's table, by method name.
ENGINE_RPCS: dict[str, EngineRpc[..., Any, Any]] = {}


class _Blocking(Generic[P, Req, Resp]):
    """``client.<name>(...)``: builds the request and waits for the answer (bounded by the client's timeout)."""

    def __init__(self, rpc: EngineRpc[P, Req, Resp]) -> None:
        self.rpc = rpc

    def __get__(self, client: SidecarClient, owner: type | None = None) -> Callable[P, Resp]:
        rpc = self.rpc

        def call(*args: P.args, **kwargs: P.kwargs) -> Resp:
            return client.call(rpc, rpc.build(*args, **kwargs))

        return call


class _NonBlocking(Generic[P, Req, Resp]):
    """``client.<name>_async(...)``: builds the request and returns a Future of the answer."""

    def __init__(self, rpc: EngineRpc[P, Req, Resp]) -> None:
        self.rpc = rpc

    def __get__(self, client: SidecarClient, owner: type | None = None) -> Callable[P, Future[Resp]]:
        rpc = self.rpc

        def start(*args: P.args, **kwargs: P.kwargs) -> Future[Resp]:
            return client.start(rpc, rpc.build(*args, **kwargs))

        return start


def engine_rpc(
    method: str, build: Callable[P, Req], response: type[Resp], session: bool = True
) -> tuple[staticmethod[P, Req], _Blocking[P, Req, Resp], _NonBlocking[P, Req, Resp]]:
    """One row of the table: the builder (a static method), the blocking and the non-blocking call."""
    rpc = EngineRpc(method, build, response, session)
    ENGINE_RPCS[method] = rpc
    return staticmethod(build), _Blocking(rpc), _NonBlocking(rpc)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ["method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"]
    ),
    grpc.ClientCallDetails,
):
    pass


class SessionToken(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor
):
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

    def intercept_stream_stream(self, continuation: Any, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._with(details, self.current()), requests)

    def renew(self) -> None:
        """Ask for a new token (a stream was refused the current one: the sidecar restarted)."""
        self.current(stale=self.current())


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
    return _token_channel(target, auth_socket, options, token)[0]


def _token_channel(
    target: str,
    auth_socket: str | os.PathLike[str] | None,
    options: Sequence[tuple[str, Any]],
    token: SessionToken | None = None,
) -> tuple[grpc.Channel, SessionToken]:
    token = token or SessionToken(auth_socket)
    return grpc.intercept_channel(grpc.insecure_channel(target, options=list(options)), token), token


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
        if target is None:
            if socket_path is None:
                raise ValueError("give socket_path or target")
            auth_socket = auth_socket or auth_socket_for(socket_path)
        self.target = target or f"unix:{os.fspath(socket_path or '')}"
        self._channel, token = _token_channel(self.target, auth_socket, _CHANNEL_OPTIONS)
        self.stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        # Request calls ride one stream when it is open (``engine_shim.session``), else unary; on
        # the engine socket, the plain session socket next to it when the sidecar has one.
        session_socket = session_socket_for(socket_path) if target is None and socket_path is not None else None
        self.session = EngineSession(self.stub.Session, token.renew, open_timeout=timeout, socket_path=session_socket)
        self._rpc_threads = concurrent.futures.ThreadPoolExecutor(_RPC_THREADS, thread_name_prefix="kvsidecar-rpc")
        # Calls running on the RPC threads (close waits for them, bounded).
        self._calls_changed = threading.Condition()
        self._running = 0
        # After an overloaded sidecar's refusal, the same calls are refused here for a moment.
        self.backoff = RefusalBackoff()

    def close(self) -> None:
        """Cancel queued calls, give running ones up to ``timeout`` to end, then close the channel:
        gRPC's C core can crash a thread whose call runs on an intercepted channel closed under it
        (seen: SIGSEGV in cygrpc with a call to a stopped sidecar in flight at close). It joins no
        thread, so a call's done callback (on an RPC thread) may close the client too."""
        self._rpc_threads.shutdown(wait=False, cancel_futures=True)
        self.session.close(self.timeout)
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

    def call(self, rpc: EngineRpc[..., Req, Resp], request: Req) -> Resp:
        """One call of ``rpc``, waiting for its answer (bounded by ``timeout``); failures raise
        ``grpc.RpcError``. Over the session stream when it is open, else unary."""
        backing_off = self.backoff.refused_locally(rpc.method, request)
        if backing_off is not None:
            raise SessionCallError(grpc.StatusCode.RESOURCE_EXHAUSTED, backing_off)
        try:
            future = self.session.start(rpc.method, request, rpc.response, self.timeout) if rpc.session else None
            if future is None:
                return self._unary(rpc, request)
            try:
                response: Resp = future.result(timeout=self.timeout + 1.0)  # the session's sweeper fails it first
            except concurrent.futures.TimeoutError:
                raise SessionCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            return response
        except grpc.RpcError as exc:
            self.backoff.observe(rpc.method, request, exc)
            raise

    def start(self, rpc: EngineRpc[..., Req, Resp], request: Req) -> Future[Resp]:
        """``call`` without waiting: over the session stream when it is open, else unary on the RPC
        threads; the future completes with its response or error."""
        backing_off = self.backoff.refused_locally(rpc.method, request)
        if backing_off is not None:
            refused: Future[Resp] = Future()
            refused.set_exception(SessionCallError(grpc.StatusCode.RESOURCE_EXHAUSTED, backing_off))
            return refused
        future = self.session.start(rpc.method, request, rpc.response, self.timeout) if rpc.session else None
        if future is None:
            future = self._rpc_threads.submit(self._call, rpc, request)
        future.add_done_callback(lambda done: self.backoff.observe_future(rpc.method, request, done))
        return future

    def open_session(self, timeout: float) -> bool:
        """Open the session stream now and wait (bounded) until it is open; False if it did not
        open (an older sidecar, or none): calls go unary then."""
        return self.session.wait_open(timeout)

    def _unary(self, rpc: EngineRpc[..., Req, Resp], request: Req) -> Resp:
        response: Resp = getattr(self.stub, rpc.method)(request, timeout=self.timeout)
        return response

    def _call(self, rpc: EngineRpc[..., Req, Resp], request: Req) -> Resp:
        with self._calls_changed:
            self._running += 1
        try:
            return self._unary(rpc, request)
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

    # --- the calls: one row per EngineService RPC the shim makes ---------------------------------
    # Each row gives the message builder (``*_request``), the blocking call and the non-blocking one
    # (``*_async``, a Future), all three generated from the row (``engine_rpc``).

    register_worker_request, register_worker, register_worker_async = engine_rpc(
        "RegisterWorker", messages.given_registration, engine_pb2.RegisterWorkerResponse, session=False
    )
    unregister_worker_request, unregister_worker, unregister_worker_async = engine_rpc(
        "UnregisterWorker", messages.unregister_request, engine_pb2.UnregisterWorkerResponse, session=False
    )
    submit_request, submit_blocks, submit_blocks_async = engine_rpc(
        "SubmitBlocks", messages.submit_request, engine_pb2.SubmitBlocksResponse
    )
    pull_request, pull, pull_async = engine_rpc("Pull", messages.pull_request, engine_pb2.PullResponse)
    keep_alive_request, keep_alive, keep_alive_async = engine_rpc(
        "KeepAlive", messages.keep_alive_request, engine_pb2.KeepAliveResponse
    )
    expect_push_request, expect_push, expect_push_async = engine_rpc(
        "ExpectPush", messages.expect_push_request, engine_pb2.ExpectPushResponse
    )
    release_request, release, release_async = engine_rpc(
        "Release", messages.release_request, engine_pb2.ReleaseResponse
    )
    hold_blocks_request, hold_blocks, hold_blocks_async = engine_rpc(
        "HoldBlocks", messages.hold_blocks_request, engine_pb2.HoldBlocksResponse
    )
    query_cache_request, query_cache, query_cache_async = engine_rpc(
        "QueryCache", messages.query_cache_request, engine_pb2.QueryCacheResponse
    )
    status_request, status, status_async = engine_rpc(
        "GetStatus", messages.status_request, engine_pb2.GetStatusResponse
    )

    def watch(self, engine_id: str, tp_rank: int = 0, pp_rank: int = 0) -> EventWatcher:
        return EventWatcher(self, engine_id, tp_rank, pp_rank)

    def subscribe_connectivity(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        """Call ``callback`` (on a gRPC thread) with every connectivity change of the channel, and
        keep the channel connecting, so a caller can tell without an RPC that the sidecar is down."""
        self._channel.subscribe(callback, try_to_connect=True)

    def unsubscribe_connectivity(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        self._channel.unsubscribe(callback)
