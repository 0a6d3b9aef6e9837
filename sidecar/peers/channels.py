"""Pooled gRPC channels to peer sidecars (one per address, mTLS when configured). Rotated
certificate files take effect without a restart: once they changed, new channels are opened and
the old ones closed after a call deadline (``sidecar.tls``). Event loop thread."""

from __future__ import annotations

import asyncio
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

    async def stub(self, address: str, may_close: Callable[[str], bool]) -> peer_pb2_grpc.PeerServiceStub:
        """The stub for ``address``, dialing it if needed; at ``max_peers`` channels, first closes
        those ``may_close`` allows (RESOURCE_EXHAUSTED if that makes no room)."""
        if self._tls is not None and self._tls.client_generation() != self._tls_generation:
            self._retire_all()
        entry = self._channels.get(address)
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
            ]
            if self._tls is not None:
                channel = grpc.aio.secure_channel(address, self._tls.channel_credentials(), options=options)
            else:
                channel = grpc.aio.insecure_channel(address, options=options)
            entry = (channel, peer_pb2_grpc.PeerServiceStub(channel))
            self._channels[address] = entry
        return entry[1]

    def _retire_all(self) -> None:
        """The certificate files changed: later calls get new channels (presenting the new files);
        the old ones close once calls already on them had their deadline."""
        assert self._tls is not None
        self._tls_generation = self._tls.client_generation()
        stale = [channel for channel, _ in self._channels.values()]
        self._channels.clear()
        if stale:
            asyncio.get_running_loop().call_later(
                self._settings.peer_call_timeout_seconds + 1.0, self._close_later, stale
            )

    def _close_later(self, channels: list[grpc.aio.Channel]) -> None:
        for channel in channels:
            task = asyncio.ensure_future(channel.close(grace=None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close_one(self, address: str) -> None:
        entry = self._channels.pop(address, None)
        if entry is not None:
            await entry[0].close(grace=None)

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()
