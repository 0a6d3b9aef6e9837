"""Pooled gRPC channels to peer sidecars (one per address, mTLS when configured). Rotated
certificate files take effect without a restart: once they changed, new channels are opened and
the old ones closed after a call deadline (``sidecar.tls``).

A channel whose connection attempt failed waits (backs off, up to 2 s) before its next attempt, and
meanwhile fails at once every call that does not wait for a connection (heartbeats): a peer that
restarted would look dead for that long. A call that finds its channel backing off gets a new
channel, which dials at once; at most once per half heartbeat period per peer, so a dead peer is
dialed no more often than it is heartbeated. Event loop thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from kvsidecar.v1 import peer_pb2_grpc
from sidecar.config import Settings
from sidecar.errors import ResourceExhausted
from sidecar.tls import TlsFiles


class PeerChannels:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._channels: dict[str, tuple[grpc.aio.Channel, peer_pb2_grpc.PeerServiceStub]] = {}
        self._tls: TlsFiles | None = None
        if settings.peer_tls_cert and settings.peer_tls_key and settings.peer_tls_ca:
            self._tls = TlsFiles(settings.peer_tls_cert, settings.peer_tls_key, settings.peer_tls_ca)
        self._tls_generation = 0
        self._closing: set[asyncio.Task[None]] = set()
        self._retired: set[grpc.aio.Channel] = set()  # replaced, closing once their calls' deadline passed
        self._dialed: dict[str, float] = {}  # address -> when its channel was opened (monotonic)
        self._redial_after = settings.heartbeat_interval / 2.0

    async def stub(self, address: str, may_close: Callable[[str], bool]) -> peer_pb2_grpc.PeerServiceStub:
        """The stub for ``address``, dialing it if needed; at ``max_peers`` channels, first closes
        those ``may_close`` allows (RESOURCE_EXHAUSTED if that makes no room)."""
        if self._tls is not None and self._tls.client_generation() != self._tls_generation:
            self._retire_all()
        entry = self._channels.get(address)
        if entry is not None and self._backing_off(address, entry[0]):
            del self._channels[address]
            self._retire([entry[0]])
            entry = None
        if entry is None:
            if len(self._channels) >= self._settings.max_peers:
                for idle in [other for other in self._channels if may_close(other)]:
                    await self.close_one(idle)
                if len(self._channels) >= self._settings.max_peers:
                    raise ResourceExhausted(
                        f"connections to {len(self._channels)} peer sidecars are open, the limit is "
                        f"max_peers={self._settings.max_peers}"
                    )
            options = [
                ("grpc.max_send_message_length", self._settings.max_message_bytes),
                ("grpc.max_receive_message_length", self._settings.max_message_bytes),
                ("grpc.keepalive_time_ms", 20_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                # Reconnect quickly after a peer restarts instead of backing off for minutes.
                ("grpc.max_reconnect_backoff_ms", 2_000),
                # Its own connection: a new channel to a peer must not share the subchannel (and
                # the backoff) of the channel it replaces.
                ("grpc.use_local_subchannel_pool", 1),
            ]
            if self._tls is not None:
                channel = grpc.aio.secure_channel(address, self._tls.channel_credentials(), options=options)
            else:
                channel = grpc.aio.insecure_channel(address, options=options)
            entry = (channel, peer_pb2_grpc.PeerServiceStub(channel))
            self._channels[address] = entry
            self._dialed[address] = time.monotonic()
        return entry[1]

    def connected(self, address: str) -> bool:
        """The channel to ``address`` has a connection (a peer stream may be opened on it)."""
        entry = self._channels.get(address)
        return entry is not None and entry[0].get_state() == grpc.ChannelConnectivity.READY

    def _backing_off(self, address: str, channel: grpc.aio.Channel) -> bool:
        """The channel's last connection attempt failed and it was not opened just now."""
        return (
            channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE
            and time.monotonic() - self._dialed.get(address, 0.0) >= self._redial_after
        )

    def _retire_all(self) -> None:
        """The certificate files changed: later calls get new channels (presenting the new files)."""
        assert self._tls is not None
        self._tls_generation = self._tls.client_generation()
        stale = [channel for channel, _ in self._channels.values()]
        self._channels.clear()
        self._dialed.clear()
        self._retire(stale)

    def _retire(self, channels: list[grpc.aio.Channel]) -> None:
        """Close ``channels`` once calls already on them had their deadline."""
        if channels:
            self._retired.update(channels)
            asyncio.get_running_loop().call_later(
                self._settings.peer_call_timeout_seconds + 1.0, self._close_later, channels
            )

    def _close_later(self, channels: list[grpc.aio.Channel]) -> None:
        for channel in channels:
            if channel not in self._retired:
                continue  # closed already (shutdown)
            self._retired.discard(channel)
            task = asyncio.ensure_future(channel.close(grace=None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close_one(self, address: str) -> None:
        self._dialed.pop(address, None)
        entry = self._channels.pop(address, None)
        if entry is not None:
            await entry[0].close(grace=None)

    async def close(self) -> None:
        for channel in [*(channel for channel, _ in self._channels.values()), *self._retired]:
            await channel.close(grace=None)
        self._channels.clear()
        self._retired.clear()
        self._dialed.clear()
