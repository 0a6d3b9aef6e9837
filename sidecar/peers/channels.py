"""Pooled gRPC channels to peer sidecars (one per address, mTLS when configured). Event loop thread."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from kvsidecar.v1 import peer_pb2_grpc
from sidecar.config import Settings
from sidecar.errors import ResourceExhausted


class PeerChannels:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._channels: dict[str, tuple[grpc.aio.Channel, peer_pb2_grpc.PeerServiceStub]] = {}

    async def stub(self, address: str, may_close: Callable[[str], bool]) -> peer_pb2_grpc.PeerServiceStub:
        """The stub for ``address``, dialing it if needed; at ``max_peers`` channels, first closes
        those ``may_close`` allows (RESOURCE_EXHAUSTED if that makes no room)."""
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
            if self._settings.tls_enabled:
                assert self._settings.peer_tls_ca and self._settings.peer_tls_key and self._settings.peer_tls_cert
                credentials = grpc.ssl_channel_credentials(
                    root_certificates=self._settings.peer_tls_ca.read_bytes(),
                    private_key=self._settings.peer_tls_key.read_bytes(),
                    certificate_chain=self._settings.peer_tls_cert.read_bytes(),
                )
                channel = grpc.aio.secure_channel(address, credentials, options=options)
            else:
                channel = grpc.aio.insecure_channel(address, options=options)
            entry = (channel, peer_pb2_grpc.PeerServiceStub(channel))
            self._channels[address] = entry
        return entry[1]

    async def close_one(self, address: str) -> None:
        entry = self._channels.pop(address, None)
        if entry is not None:
            await entry[0].close(grace=None)

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()
