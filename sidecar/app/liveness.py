"""Whether the NIXL owner thread still takes commands.

Every NIXL call runs on one owner thread (``sidecar.dataplane.transport``), and NIXL has no timeouts of its
own: a call that never returns (a peer that stalls UCX wire-up, a driver that hangs) would leave
the daemon accepting requests that can only time out, while its event loop, and so its systemd
watchdog pings and gRPC health, looked fine. ``LivenessMonitor`` sends the thread a no-op every
``interval`` seconds; one that is not answered within ``stall_after`` seconds marks the daemon
unhealthy (the server sets both health services NOT_SERVING and withholds watchdog pings, so
Kubernetes or systemd restart it), and an answer marks it healthy again.

Runs on the event loop; the probe is awaited there, the no-op itself runs on the owner thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from sidecar.logs import get_logger

log = get_logger("kvsidecar.liveness")


class LivenessMonitor:
    def __init__(
        self,
        probe: Callable[[], Awaitable[None]],
        on_change: Callable[[bool], Awaitable[None]],
        interval: float,
        stall_after: float,
    ) -> None:
        self._probe = probe
        self._on_change = on_change
        self.interval = interval
        self.stall_after = stall_after
        self.healthy = True
        self._pending: asyncio.Future[None] | None = None
        self._pending_since = 0.0

    async def check_once(self) -> bool:
        """Probe (or keep waiting for the probe still in flight); returns whether healthy."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._probe())
            self._pending_since = time.monotonic()
        waited = time.monotonic() - self._pending_since
        done, _ = await asyncio.wait({self._pending}, timeout=max(0.0, self.stall_after - waited))
        if done:
            probe, self._pending = self._pending, None
            if probe.exception() is not None:
                log.error("transport_probe_failed", error=repr(probe.exception()))
                await self._set(False, f"the probe failed: {probe.exception()!r}")
            else:
                await self._set(True, "answered")
        else:
            await self._set(False, f"no answer in {time.monotonic() - self._pending_since:.1f}s")
        return self.healthy

    async def run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.interval)

    async def _set(self, healthy: bool, detail: str) -> None:
        if healthy == self.healthy:
            return
        self.healthy = healthy
        if healthy:
            log.warning("transport_recovered", detail=detail)
        else:
            log.error(
                "transport_unresponsive",
                detail=detail,
                hint="a NIXL call on the owner thread does not return; health is NOT_SERVING until it does",
            )
        await self._on_change(healthy)
