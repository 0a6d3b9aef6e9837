"""A NIXL owner thread that stops taking commands (a NIXL call that never returns) makes the
sidecar unhealthy, and healthy again once it answers: first the monitor on its own with a real
transport, then a real server in this process answering grpc.health.v1 over its Unix socket."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.app.liveness import LivenessMonitor
from sidecar.app.server import SidecarServer
from sidecar.config import NixlSettings, load_settings
from sidecar.dataplane.transport import NixlTransport

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def stall(transport: NixlTransport, release: threading.Event) -> asyncio.Future[object]:
    """Occupy the owner thread the way a NIXL call that does not return would."""
    return asyncio.ensure_future(transport._call(release.wait, 30.0))


def test_the_monitor_reports_a_stuck_owner_thread_and_its_recovery() -> None:
    async def scenario() -> None:
        transport = NixlTransport(NixlSettings(), lambda batch, seen_at: None)
        transport.start(asyncio.get_running_loop())
        changes: list[bool] = []

        async def on_change(healthy: bool) -> None:
            changes.append(healthy)

        monitor = LivenessMonitor(transport.ping, on_change, interval=0.05, stall_after=0.3)
        release = threading.Event()
        try:
            assert await monitor.check_once() and changes == []
            stuck = stall(transport, release)
            assert not await monitor.check_once()
            assert not await monitor.check_once()  # still the same unanswered probe
            assert changes == [False]
            release.set()
            await stuck
            # The probe queued behind the stall is answered just after it; on a busy machine that
            # answer may reach the loop a moment after the stall's own result.
            for _ in range(100):
                if await monitor.check_once():
                    break
                await asyncio.sleep(0.05)
            assert monitor.healthy
            assert changes == [False, True]
        finally:
            release.set()
            await transport.stop()

    asyncio.run(scenario())


def test_a_stuck_owner_thread_turns_the_sidecars_health_not_serving(workdir: Path) -> None:
    async def scenario() -> None:
        settings = load_settings(
            {
                "engine_socket": str(workdir / "engine.sock"),
                "peer_listen": "127.0.0.1:0",
                "metrics_listen": "off",
                "nixl": {"probe_interval_seconds": 0.05, "stall_seconds": 0.3},
            }
        )
        server = SidecarServer(settings)
        release = threading.Event()
        await server.start()
        try:
            assert server.node is not None
            channel = grpc.aio.insecure_channel(f"unix:{settings.engine_socket}")
            health = health_pb2_grpc.HealthStub(channel)

            async def status(service: str = "") -> int:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                return int(reply.status)

            async def becomes(wanted: int) -> None:
                for _ in range(100):
                    if await status() == wanted:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"health never became {wanted}")

            registry = server.node.metrics.registry

            def responsive() -> float | None:
                return registry.get_sample_value("kvsidecar_transport_responsive")

            assert await status() == SERVING and responsive() == 1
            stuck = stall(server.node.transport, release)
            await becomes(NOT_SERVING)
            assert await status("kvsidecar.v1.EngineService") == NOT_SERVING
            assert responsive() == 0
            release.set()
            await stuck
            await becomes(SERVING)
            assert responsive() == 1
            await channel.close()
        finally:
            release.set()
            await server.shutdown()
        assert not Path(settings.engine_socket).exists()

    asyncio.run(scenario())
