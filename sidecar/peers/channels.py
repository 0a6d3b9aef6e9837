"""Pooled gRPC channels to peer sidecars (one per address, mTLS when configured). Event loop thread."""

from __future__ import annotations

import grpc

from kvsidecar.v1 import peer_pb2_grpc
from sidecar.config import Settings


class PeerChannels:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._channels: dict[str, tuple[grpc.aio.Channel, peer_pb2_grpc.PeerServiceStub]] = {}

    def stub(self, address: str) -> peer_pb2_grpc.PeerServiceStub:
        entry = self._channels.get(address)
        if entry is None:
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

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()
