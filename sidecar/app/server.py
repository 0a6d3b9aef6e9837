"""The daemon process: gRPC servers, health, reflection, metrics endpoint, signals, systemd.

Two servers, so neither port exposes the other's API:
- EngineService (and PeerService, for local debugging) on a Unix socket (mode
  ``engine_socket_mode``, 0600 by default; its directory 0700 when created here) and optionally on
  a loopback TCP port; every call there but health and reflection needs a session token from the
  credential socket next to it (``sidecar.api.engine_auth``: the caller's ``SO_PEERCRED``);
  the engine session also on a plain Unix socket next to it (``sidecar.api.session_socket``,
  ``<engine_socket>.session``, same mode, callers checked by ``SO_PEERCRED``);
- PeerService alone on TCP (mTLS when configured).
Both serve ``grpc.health.v1.Health`` and server reflection, so ``grpcurl`` works out of the box.

Shutdown on SIGTERM/SIGINT: STOPPING=1, health NOT_SERVING, new work refused, running requests
get a bounded grace, then the node releases NIXL and memory, the servers stop and the socket
file is removed. Everything runs on one asyncio loop; the only other threads are NIXL's owner
thread (``sidecar.dataplane.transport``), the metrics HTTP server, and the loop's default executor
that maps (pre-faults) a registering worker's memory (``sidecar.core.registration``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import stat
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvsidecar.v1 import engine_pb2, engine_pb2_grpc, peer_pb2_grpc, selftest_pb2, selftest_pb2_grpc
from sidecar import __version__
from sidecar.api.engine import EngineServicer
from sidecar.api.engine_auth import PEER_SERVICE, CredentialSocket, SessionTokens, TokenInterceptor
from sidecar.api.interceptor import CallInterceptor
from sidecar.api.peer import PeerServicer
from sidecar.api.session_socket import SessionSocket
from sidecar.app.liveness import LivenessMonitor
from sidecar.app.selftest_host import SelfTestServicer, TestEngineHost
from sidecar.app.systemd import SystemdNotifier
from sidecar.config import Settings, split_host_port
from sidecar.core.node import Node
from sidecar.logs import get_logger
from sidecar.tls import TlsFiles

log = get_logger("kvsidecar.server")

_PR_SET_PDEATHSIG = 1

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
SELFTEST_SERVICE = selftest_pb2.DESCRIPTOR.services_by_name["SelfTestService"].full_name


def _server_options(settings: Settings) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Let clients keep idle WatchEvents streams open with keepalive pings.
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def advertised_address(settings: Settings, bound_port: int) -> str:
    """The address peers should use: ``advertise`` if set, else the peer listen address with the
    bound port, and the host's name instead of a wildcard host."""
    if settings.advertise:
        return settings.advertise
    host, _ = split_host_port(settings.peer_listen, "peer_listen")
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{bound_port}"


class SidecarServer:
    """One running daemon: a node, its two gRPC servers and its operational plumbing."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.node: Node | None = None
        self.engine_server: grpc.aio.Server | None = None
        self.peer_server: grpc.aio.Server | None = None
        self.engine_health = health.aio.HealthServicer()
        self.peer_health = health.aio.HealthServicer()
        self.peer_port = 0
        self.engine_tcp_port = 0
        self.metrics_port = 0
        self._metrics_http: Any = None
        self._stop = asyncio.Event()
        self._notifier = SystemdNotifier()
        self._watchdog_task: asyncio.Task[None] | None = None
        self._liveness: LivenessMonitor | None = None
        self._liveness_task: asyncio.Task[None] | None = None
        self._socket_path = Path(settings.engine_socket)
        self._owns_socket = False
        self._credentials: CredentialSocket | None = None
        self._session_socket: SessionSocket | None = None
        self._selftest: TestEngineHost | None = None

    async def start(self) -> None:
        settings = self.settings
        self.node = node = Node(settings)
        interceptor = CallInterceptor(node.metrics)
        tokens = SessionTokens()
        self._credentials = CredentialSocket(settings, tokens, node.sidecar_id)

        # Engine server: Unix socket and optional loopback TCP; calls need a session token.
        self.engine_server = grpc.aio.server(
            interceptors=[interceptor, TokenInterceptor(tokens, self._credentials.path)],
            options=_server_options(settings),
        )
        engine_servicer = EngineServicer(node)
        engine_pb2_grpc.add_EngineServiceServicer_to_server(engine_servicer, self.engine_server)
        self._session_socket = SessionSocket(settings, engine_servicer.session)
        # PeerService on the local socket too, so one `grpcurl -unix ... list` shows the whole API;
        # EngineService is never exposed on the peer port.
        # One PeerService servicer for both servers; its open peer streams end when the node stops.
        peer_servicer = PeerServicer(node.routes, interceptor, lambda: node.peers.closed)
        peer_pb2_grpc.add_PeerServiceServicer_to_server(peer_servicer, self.engine_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.engine_health, self.engine_server)
        reflection.enable_server_reflection(
            [ENGINE_SERVICE, PEER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], self.engine_server
        )
        _prepare_socket_path(self._socket_path, settings.engine_socket_mode)
        # Tokens first: a client that finds the engine socket finds its credential socket too.
        await self._credentials.start()
        previous_umask = os.umask(0o177)
        try:
            self.engine_server.add_insecure_port(f"unix:{self._socket_path}")
            self._owns_socket = True
        finally:
            os.umask(previous_umask)
        if settings.engine_tcp_listen:
            self.engine_tcp_port = self.engine_server.add_insecure_port(settings.engine_tcp_listen)

        # Peer server: TCP, mTLS when configured.
        self.peer_server = grpc.aio.server(interceptors=[interceptor], options=_server_options(settings))
        peer_pb2_grpc.add_PeerServiceServicer_to_server(peer_servicer, self.peer_server)
        # The far side of `kvsidecar selftest` (sidecar.app.selftest_host): hosts one test engine.
        self._selftest = TestEngineHost(settings, node.identity.info)
        selftest_pb2_grpc.add_SelfTestServiceServicer_to_server(SelfTestServicer(self._selftest), self.peer_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.peer_health, self.peer_server)
        reflection.enable_server_reflection(
            [PEER_SERVICE, SELFTEST_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], self.peer_server
        )
        if settings.peer_tls_cert and settings.peer_tls_key and settings.peer_tls_ca:
            # Re-reads the files when they change: rotated certificates need no restart (sidecar.tls).
            tls = TlsFiles(settings.peer_tls_cert, settings.peer_tls_key, settings.peer_tls_ca)
            self.peer_port = self.peer_server.add_secure_port(settings.peer_listen, tls.server_credentials())
        else:
            self.peer_port = self.peer_server.add_insecure_port(settings.peer_listen)
        if self.peer_port == 0:
            raise RuntimeError(f"cannot bind the peer address {settings.peer_listen}")

        advertise = advertised_address(settings, self.peer_port)
        host, _ = split_host_port(settings.peer_listen, "peer_listen")
        await node.start(advertise, [f"{host}:{self.peer_port}"])
        await self._session_socket.start()  # before the engine socket answers: a client finds both
        await self.engine_server.start()
        await self.peer_server.start()
        os.chmod(self._socket_path, settings.engine_socket_mode)

        if settings.metrics_listen != "off":
            metrics_host, metrics_port = split_host_port(settings.metrics_listen, "metrics_listen")
            self._metrics_http, self.metrics_port = node.metrics.serve_http(metrics_host, metrics_port)

        await self._set_health(True)
        if settings.nixl.probe_interval_seconds > 0:
            self._liveness = LivenessMonitor(
                node.transport.ping, self._set_health, settings.nixl.probe_interval_seconds, settings.nixl.stall_seconds
            )
            self._liveness_task = asyncio.ensure_future(self._liveness.run())
        log.info(
            "sidecar_serving",
            version=__version__,
            sidecar_id=node.sidecar_id,
            engine_socket=str(self._socket_path),
            engine_tcp_port=self.engine_tcp_port or None,
            peer_port=self.peer_port,
            advertise=advertise,
            metrics_port=self.metrics_port or None,
            tls=settings.tls_enabled,
        )
        self._notifier.ready(f"serving; peers at {advertise}")
        if self._notifier.watchdog_interval:
            self._watchdog_task = asyncio.ensure_future(self._watchdog(self._notifier.watchdog_interval))

    async def _set_health(self, serving: bool) -> None:
        if self.node is not None:
            self.node.metrics.transport_responsive.set(1 if serving else 0)
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for servicer, names in (
            (self.engine_health, (ENGINE_SERVICE, PEER_SERVICE)),
            (self.peer_health, (PEER_SERVICE,)),
        ):
            for name in ("", *names):
                await servicer.set(name, status)

    async def _watchdog(self, interval: float) -> None:
        # Pings come from the event loop itself: if the loop wedges, systemd notices; a stuck NIXL
        # owner thread (see sidecar.app.liveness) withholds them too.
        while True:
            if self._liveness is None or self._liveness.healthy:
                self._notifier.watchdog()
            await asyncio.sleep(interval)

    def request_stop(self) -> None:
        self._stop.set()

    async def wait_for_stop(self) -> None:
        await self._stop.wait()

    async def shutdown(self) -> None:
        grace = self.settings.shutdown_grace_seconds
        deadline = time.monotonic() + grace
        self._notifier.stopping()
        log.info("sidecar_stopping", grace_seconds=grace)
        if self._liveness_task is not None:
            self._liveness_task.cancel()
        await self.engine_health.enter_graceful_shutdown()
        await self.peer_health.enter_graceful_shutdown()
        if self._selftest is not None:
            await self._selftest.close()
        if self.node is not None:
            # Keep most of the grace for transfers; the rest is for closing servers.
            started = time.monotonic()
            await self.node.drain(max(0.0, grace * 0.7))
            # What the bound cut off is failed or handed back by stop(): the operator sees how much.
            log.info(
                "sidecar_drained",
                seconds=round(time.monotonic() - started, 3),
                running=len(self.node.tasks),
                receiving=len(self.node.consumer.requests),
                awaiting_consumers=self.node.producer.awaiting_consumers(),
            )
            await self.node.stop()
        remaining = max(0.1, deadline - time.monotonic())
        servers = [server for server in (self.engine_server, self.peer_server) if server is not None]
        session_socket = self._session_socket.stop(remaining) if self._session_socket is not None else asyncio.sleep(0)
        await asyncio.gather(*(server.stop(remaining) for server in servers), session_socket)
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        if self._owns_socket:  # never remove the socket of another daemon we refused to replace
            with contextlib.suppress(FileNotFoundError):
                self._socket_path.unlink()
        if self._credentials is not None:  # removes its socket only if it started (after the check above)
            await self._credentials.stop()
        log.info("sidecar_stopped")


def _prepare_socket_path(path: Path, mode: int) -> None:
    """Create the socket's directory (0700, searchable by group or others when the socket's mode
    lets them in) and remove a stale socket; refuse a live one."""
    directory = path.parent
    if not directory.exists():
        search = (0o010 if mode & 0o060 else 0) | (0o001 if mode & 0o006 else 0)
        directory.mkdir(mode=0o700 | search, parents=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise RuntimeError(f"engine socket path {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody listens: a leftover from a crashed sidecar
        else:
            raise RuntimeError(f"another process already serves the engine socket {path}")
        finally:
            probe.close()


def exit_with_parent(parent_pid: int) -> None:
    """Get SIGTERM (a graceful shutdown) when the process that started us dies, even by SIGKILL;
    for daemons started by a supervisor that is not systemd (the demo, tests). Linux only."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


async def serve(settings: Settings) -> int:
    """Run the daemon until SIGTERM or SIGINT; returns the exit status."""
    server = SidecarServer(settings)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.request_stop)
    try:
        await server.start()
    except Exception as exc:
        log.error("sidecar_start_failed", error=str(exc))
        await server.shutdown()
        return 1
    await server.wait_for_stop()
    await server.shutdown()
    return 0
