"""The engine shim's SidecarClient shuts down cleanly: a client closed right after it watched its
channel's connectivity (the vLLM shim's scheduler does, to tell when its sidecar is down) leaves no
gRPC thread failing on the closed channel, a traceback in the engine's log otherwise. Real gRPC
channels to Unix sockets with nobody listening."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from engine_shim.client import SidecarClient


def test_closing_a_client_right_after_it_watched_its_channel_fails_no_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failures: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(repr(args.exc_value)))
    for attempt in range(20):
        client = SidecarClient(socket_path=tmp_path / f"nobody-{attempt}.sock", timeout=1.0)

        def watch(state: grpc.ChannelConnectivity) -> None:
            pass

        client.subscribe_connectivity(watch)
        client.unsubscribe_connectivity(watch)
        client.close()
    time.sleep(0.5)  # a connectivity poller that outlived its channel fails at its next wake-up (0.2 s)
    assert failures == []
