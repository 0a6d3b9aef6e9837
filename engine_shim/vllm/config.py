"""The SidecarConnector's settings (``kv_connector_extra_config``) and the names both roles share.

Pure data, read once at construction on whichever thread vLLM builds the connector on.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from engine_shim.vllm.multiturn import CONFIG_KEYS as MULTI_TURN_KEYS
from kvsidecar.shm import SHM_DIR
from kvsidecar.v1 import common_pb2

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.kvsidecar.config")

ROLES = {
    "kv_producer": common_pb2.ENGINE_ROLE_PRODUCER,
    "kv_consumer": common_pb2.ENGINE_ROLE_CONSUMER,
    "kv_both": common_pb2.ENGINE_ROLE_BOTH,
}
MODES = {"pull": common_pb2.TRANSFER_MODE_PULL, "push": common_pb2.TRANSFER_MODE_PUSH}

BlockIds = tuple[list[int], ...]


def _default_socket() -> str:
    # Same default as ``kvsidecar serve`` (sidecar.config.default_engine_socket), which the shim must
    # not import: it runs inside vLLM and depends on the generated stubs only.
    explicit = os.environ.get("KVSIDECAR_ENGINE_SOCKET")
    if explicit:
        return explicit
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return str(Path(base) / "kvsidecar" / "engine.sock")


@dataclass(frozen=True)
class ShimConfig:
    """``kv_connector_extra_config`` of the SidecarConnector (durations in seconds; 0 = sidecar default)."""

    sidecar_socket: str
    transfer_mode: str = "pull"  # default flow; a request's kv_transfer_params["transfer_mode"] overrides
    rpc_timeout: float = 10.0  # deadline of every request-level gRPC call
    register_timeout: float = 15.0  # bound on RegisterWorker + WatchEvents start at engine start
    lease_seconds: float = 0.0  # producer lease armed by SubmitBlocks
    pull_timeout: float = 0.0  # bound on one Pull (handshake + READs), enforced by the sidecar
    push_timeout: float = 0.0  # ExpectPush watchdog, enforced by the sidecar
    recv_watchdog: float = 900.0  # last-resort bound on a receive with no terminal event
    # In a step that computes nothing while transfers are outstanding, the worker waits up to this
    # long for their next event instead of returning at once (0 = never wait); anything reaching
    # the EngineCore ends the wait sooner (input_wake). See WorkerSide._wait_for_event.
    idle_wait: float = 0.02
    # How long vLLM's shm queue readers in this engine busy-loop after a read before they sleep
    # (vLLM: 1 s); below idle_wait, so an engine that only waits for KV leaves the cores to the
    # sidecar. Negative = leave vLLM's. See engine_spin.
    engine_busy_loop: float = 0.001
    # Opt-in: a pull of at most this many prompt tokens, into an engine that computed nothing in
    # its last step, loads inside the step that computes its first token (vLLM's synchronous load):
    # one engine step sooner than an asynchronous load. Larger ones, pushes and loads under load
    # stay asynchronous (the step waits for the transfer). 0 = never (the default: a failed
    # synchronous load's blocks stay in vLLM's prefix cache until recomputed). See
    # engine_shim.vllm.receive.Receiver._loads_inline.
    inline_load_max_tokens: int = 0
    memory_export: str = "auto"  # "auto" | "mem_pool" | "torch_shm"
    shm_dir: str = str(SHM_DIR)

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ShimConfig:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        extra: Mapping[str, Any] = transfer.kv_connector_extra_config or {}
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known - MULTI_TURN_KEYS)  # multi-turn hook: read by multiturn.py
        if unknown:
            logger.warning("SidecarConnector: ignoring unknown kv_connector_extra_config keys %s", unknown)
        values: dict[str, Any] = {"sidecar_socket": str(extra.get("sidecar_socket") or _default_socket())}
        for name in known - {"sidecar_socket"}:
            if name in extra:
                convert: Any = type(cls.__dataclass_fields__[name].default)  # str, int or float
                values[name] = convert(extra[name])
        config = cls(**values)
        if config.transfer_mode not in MODES:
            raise ValueError(f"kv_connector_extra_config.transfer_mode: 'pull' or 'push', not {config.transfer_mode!r}")
        if config.memory_export not in ("auto", "mem_pool", "torch_shm"):
            raise ValueError(
                "kv_connector_extra_config.memory_export: 'auto', 'mem_pool' or 'torch_shm', "
                f"not {config.memory_export!r}"
            )
        return config
