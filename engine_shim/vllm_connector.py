"""``SidecarConnector``: vLLM's KV connector that hands every KV transfer to the node's kvsidecar.

Loaded by vLLM with::

    {"kv_connector": "SidecarConnector", "kv_connector_module_path": "engine_shim.vllm_connector",
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "engine_id": "<stable id>",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"sidecar_socket": "/run/kvsidecar/engine.sock", "transfer_mode": "pull"}}

What it owns (and nothing else: NIXL, handshakes, leases and heartbeats live in the sidecar):

- **Worker role** (one instance per TP/PP rank, in vLLM's worker process): the KV cache's shared
  memory, its registration with the sidecar (``RegisterWorker``), and that rank's ``WatchEvents``
  stream. Completions are drained into a local queue by the watcher thread; vLLM's per-step calls
  (``get_transfer_results``, ``get_block_ids_with_load_errors``) only read that queue.
- **Scheduler role** (one instance per engine, in the EngineCore process): request-level calls
  (``SubmitBlocks``, ``Pull``, ``ExpectPush``, ``Release``) issued as gRPC futures, so
  ``schedule()`` never waits on the sidecar, and vLLM's ``kv_transfer_params`` with their usual
  keys and meanings (``remote_host``/``remote_port`` name the producer's *sidecar*).

Threads:
- vLLM's scheduler thread calls every scheduler-role method; gRPC callback threads complete the
  futures and only append to ``_SchedulerSide._failures`` (a deque) or set plain flags;
- vLLM's worker thread calls every worker-role method; one ``EventWatcher`` thread per
  registration puts events on ``_WorkerSide._inbox``; a supervisor thread re-registers after the
  stream closes (a restarted sidecar) and announces it through the same queue, so all request
  state of the worker is touched by vLLM's worker thread only.

How failures reach vLLM: a request call the sidecar refused (or a sidecar that is down) is
reported by the scheduler to the workers in the next step's metadata; the workers put the
request in ``finished_recving`` *and* ``failed_recving`` (and its blocks in the load-error set when
block ids are unambiguous), so with ``kv_load_failure_policy="recompute"`` vLLM recomputes the
prompt. A closed event stream fails every receive the worker waits for and frees every block it
was holding for a consumer, so vLLM never waits on a dead sidecar.

Memory export (CPU engines). vLLM allocates the whole KV cache as one ``torch.zeros(n, int8)`` and
views it per layer. Two ways to share it with the sidecar were verified (reference
``vllm_on_cpu.md`` section 2):

1. ``get_mem_pool_context()`` returns a ``TorchFunctionMode`` that turns exactly that allocation
   into a tensor over a ``SharedBuffer`` (``engine_shim.memory``): a ``/dev/shm`` file this module
   creates.
2. ``register_kv_caches`` calls ``untyped_storage()._share_filename_cpu_()``, which copies the
   storage into a torch-managed shm file with a 64-byte refcount header.

The default ("auto") is method 1, with method 2 as the fallback when the hook did not see the
allocation (a future vLLM that allocates differently). Method 1 is the robust one: the file holds
exactly the KV bytes (no header whose size depends on the torch version), it is named and owned
by this module (0600, locked while the engine lives, unlinked at shutdown; a killed engine's file
is removed by its sidecar or by the next engine that starts), nothing is copied at start-up, and
it does not depend on torch's shm manager process or sharing strategy. Its one dependency on
vLLM internals (a single int8 ``torch.zeros`` of the size ``kv_cache_config`` announces) fails
safe: if it does not match, method 2 takes over. ``kv_connector_extra_config.memory_export``
("auto" | "mem_pool" | "torch_shm") forces one of them. GPU engines would export VRAM through
CUDA IPC; that path is not implemented here and the worker refuses non-CPU KV caches clearly.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import os
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import torch
from torch.overrides import TorchFunctionMode
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.logger import init_logger

from engine_shim import multiturn, vllm_stats
from engine_shim.client import EventWatcher, Future, SidecarClient, remote
from engine_shim.memory import SharedBuffer, remove_if_orphaned
from kvsidecar.v1 import common_pb2, engine_pb2

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

CONNECTOR_VERSION = "1"
SHM_DIR = Path("/dev/shm")
# Not "kvsidecar-": that prefix belongs to engine_shim.memory's simulated engines.
SHM_PREFIX = "kvsvllm-"

_ROLES = {
    "kv_producer": common_pb2.ENGINE_ROLE_PRODUCER,
    "kv_consumer": common_pb2.ENGINE_ROLE_CONSUMER,
    "kv_both": common_pb2.ENGINE_ROLE_BOTH,
}
_MODES = {"pull": common_pb2.TRANSFER_MODE_PULL, "push": common_pb2.TRANSFER_MODE_PUSH}

# Status codes with which the sidecar refused a request call before starting anything: the request
# can fail at once. Any other error (a deadline, a cancelled call) leaves it unknown whether the
# sidecar accepted the call, so the shim first asks it to release the request (see _SchedulerSide).
_REFUSED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)

BlockIds = tuple[list[int], ...]


# --- configuration -------------------------------------------------------------------------------


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
    memory_export: str = "auto"  # "auto" | "mem_pool" | "torch_shm"
    shm_dir: str = str(SHM_DIR)

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ShimConfig:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        extra: Mapping[str, Any] = transfer.kv_connector_extra_config or {}
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known - multiturn.CONFIG_KEYS)  # multi-turn hook: its keys
        if unknown:
            logger.warning("SidecarConnector: ignoring unknown kv_connector_extra_config keys %s", unknown)
        values: dict[str, Any] = {"sidecar_socket": str(extra.get("sidecar_socket") or _default_socket())}
        for name in known - {"sidecar_socket"}:
            if name in extra:
                convert: Any = type(cls.__dataclass_fields__[name].default)  # str or float
                values[name] = convert(extra[name])
        config = cls(**values)
        if config.transfer_mode not in _MODES:
            raise ValueError(f"kv_connector_extra_config.transfer_mode: 'pull' or 'push', not {config.transfer_mode!r}")
        if config.memory_export not in ("auto", "mem_pool", "torch_shm"):
            raise ValueError(
                "kv_connector_extra_config.memory_export: 'auto', 'mem_pool' or 'torch_shm', "
                f"not {config.memory_export!r}"
            )
        return config


# --- scheduler -> worker metadata ----------------------------------------------------------------


@dataclass
class SidecarConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells every worker each step (plain builtins only)."""

    # Consumer: requests whose KV the sidecar now fetches -> (time.monotonic() of the Pull /
    # ExpectPush call, their local block ids of all groups, flat).
    recv_started: dict[str, tuple[float, list[int]]] = field(default_factory=dict)
    # Consumer: request calls that failed (the request must be recomputed) -> reason.
    recv_failed: dict[str, str] = field(default_factory=dict)
    # Producer: requests whose blocks the sidecar now holds for a consumer -> time.monotonic() of
    # the SubmitBlocks call.
    send_started: dict[str, float] = field(default_factory=dict)
    # Producer: submissions that failed -> reason; their blocks can be freed at once.
    send_abandoned: dict[str, str] = field(default_factory=dict)


# --- helpers -------------------------------------------------------------------------------------


def _flat(block_ids: Sequence[Sequence[int]]) -> list[int]:
    return [block for group in block_ids for block in group]


def _grouped(value: Any) -> BlockIds:
    """Block ids from kv_transfer_params: a list per group, or (older routers) one flat list."""
    if not value:
        return ()
    items = list(value)
    if all(isinstance(item, int) for item in items):
        return (list(items),)
    return tuple([int(block) for block in group] for group in items)


def _address(params: Mapping[str, Any]) -> str | None:
    host, port = params.get("remote_host"), params.get("remote_port")
    if not host or port in (None, ""):
        return None
    host = str(host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # a bare IPv6 address
    return f"{host}:{int(port)}"


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class _FutureLike(Protocol):
    """A gRPC future, or a plain future standing for a call issued later (see _after_keep_alive)."""

    def add_done_callback(self, fn: Callable[[Any], object]) -> None: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...

    def result(self, timeout: float | None = None) -> Any: ...

    def done(self) -> bool: ...


def _copy_outcome(source: Future[Any], target: concurrent.futures.Future[Any]) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def _ignore(future: _FutureLike) -> None:
    """Done-callback of a best-effort call: consume its outcome (gRPC logs unretrieved errors)."""
    future.exception()


def _rpc_error(exc: BaseException) -> tuple[grpc.StatusCode | None, str]:
    if isinstance(exc, grpc.RpcError):
        code = exc.code()
        return code, f"{code.name}: {exc.details()}"
    return None, repr(exc)


# --- scheduler role ------------------------------------------------------------------------------


@dataclass
class _Receive:
    """A consumer request whose KV the sidecar is fetching."""

    request_id: str
    transfer_id: str
    blocks: list[int]
    future: _FutureLike
    aborted: bool = False


class _SchedulerSide:
    """Request-level decisions; runs on vLLM's scheduler thread (see module doc)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ShimConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None and transfer.engine_id is not None
        self.engine_id: str = transfer.engine_id
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self._kv_cache_config = kv_cache_config
        self._transfer_groups = tuple(kv_cache_config.transfer_group_ids)
        self._all_groups = len(self._transfer_groups) == len(kv_cache_config.kv_cache_groups)
        self.client = SidecarClient(config.sidecar_socket, timeout=config.rpc_timeout)
        # This sidecar's PeerService address, returned to routers as remote_host/remote_port.
        self._address: str | None = None
        self._address_future: Future[Any] | None = None
        self._down = False  # the channel is in TRANSIENT_FAILURE / SHUTDOWN
        self._receives: dict[str, _Receive] = {}
        # Consumer requests whose producer lease the sidecar keeps alive until they are scheduled,
        # and those whose producer already said it no longer holds the KV (recompute them).
        self._arrived: dict[str, Request] = {}
        self._kept_alive: dict[str, Future[Any]] = {}
        self._producer_lost: set[str] = set()
        self._sends: set[str] = set()  # producer requests whose blocks the sidecar holds
        self._push_sends: set[str] = set()  # the subset a consumer's registration makes us WRITE
        # Announced to the workers in the next metadata, with the time.monotonic() of the request
        # call (CLOCK_MONOTONIC is node-wide, so workers compare it with their stream losses).
        self._new_receives: dict[str, tuple[float, list[int]]] = {}
        self._new_sends: dict[str, float] = {}
        # Filled by gRPC callback threads: ("recv" | "send", request id, reason).
        self._failures: collections.deque[tuple[str, str, str]] = collections.deque()
        # Tokens this engine was told to load from outside, per request (bounded; for observability).
        self.external_tokens: collections.OrderedDict[str, int] = collections.OrderedDict()
        # --- multi-turn hook (engine_shim.multiturn): P loads earlier turns from D's holds; a
        # decode engine (kv_consumer / kv_both) holds its finished requests for the next turn.
        turns = multiturn.MultiTurnConfig.from_extra(transfer.kv_connector_extra_config or {})
        self.multiturn = (
            multiturn.MultiTurn(turns, self.client, self.engine_id, self.block_size) if turns.enabled else None
        )
        self._holds_turns = self.multiturn is not None and transfer.kv_role in ("kv_consumer", "kv_both")
        self.client.subscribe_connectivity(self._on_connectivity)
        try:
            self._address = self.client.status_async().result(timeout=min(5.0, config.rpc_timeout)).sidecar.address
        except Exception as exc:
            logger.warning("SidecarConnector: sidecar at %s not reachable yet (%s)", config.sidecar_socket, exc)

    def shutdown(self) -> None:
        try:
            self.client.unsubscribe_connectivity(self._on_connectivity)
        except Exception:
            pass
        self.client.close()

    # gRPC threads ------------------------------------------------------------------------------

    def _on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        down = state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)
        if self._down and state == grpc.ChannelConnectivity.READY:
            self._address_future = None  # a restarted sidecar may listen elsewhere: ask again
            self._refresh_address()
        self._down = down

    def _refresh_address(self) -> None:
        if self._address_future is not None and not self._address_future.done():
            return
        future = self.client.status_async()
        self._address_future = future

        def done(f: Future[Any]) -> None:
            if f.exception() is None:
                self._address = f.result().sidecar.address

        future.add_done_callback(done)

    def _on_receive_call_done(self, request_id: str, transfer_id: str, what: str, future: _FutureLike) -> None:
        exc = future.exception()
        if exc is None:
            return  # accepted (or refused with a LOAD_FAILED event, which the workers get)
        code, text = _rpc_error(exc)
        reason = f"{what} failed: {text}"
        if code is None or code in _REFUSED:  # refused, or never sent (code None)
            self._failures.append(("recv", request_id, reason))
            return
        # Unknown whether the sidecar started fetching into our blocks: ask it to stop. If it knows
        # the request, its terminal event follows once nothing is in flight; otherwise fail here.
        logger.warning("SidecarConnector: %s for %s; releasing it on the sidecar", reason, request_id)
        release = self.client.release_async(self.engine_id, request_id, transfer_id, reason=reason[:200])

        def released(f: Future[Any]) -> None:
            if f.exception() is not None or not f.result().found:
                self._failures.append(("recv", request_id, reason))

        release.add_done_callback(released)

    def _on_submit_done(self, request_id: str, future: Future[Any], what: str = "SubmitBlocks") -> None:
        exc = future.exception()
        if exc is not None:
            _, text = _rpc_error(exc)
            # The blocks were never offered (or the sidecar is gone): vLLM may free them.
            self._failures.append(("send", request_id, f"{what} failed: {text}"))

    # vLLM scheduler thread ---------------------------------------------------------------------

    def _mode(self, params: Mapping[str, Any]) -> str:
        mode = params.get("transfer_mode")
        return mode if mode in _MODES else self.config.transfer_mode

    def _transfer_blocks(self, block_ids: Sequence[Sequence[int]]) -> BlockIds:
        if self._all_groups:
            return tuple(list(group) for group in block_ids)
        return tuple(list(block_ids[group]) for group in self._transfer_groups)

    def on_new_request(self, request: Request) -> None:
        # A consumer request may wait here a while before it is scheduled; the producer's lease
        # must not run out meanwhile (vLLM's decode engines heartbeat from arrival). Requests still
        # waiting at the end of this step get a KeepAlive (see build_connector_meta).
        params = request.kv_transfer_params
        if (
            params
            and params.get("do_remote_prefill")
            and (params.get("remote_request_id") or params.get("transfer_id"))
        ):
            self._arrived[request.request_id] = request
        elif self.multiturn is not None and params and params.get("do_remote_decode") and not self._down:
            self.multiturn.prefetch(request)  # multi-turn hook: ask for a hold while it waits

    def _keep_alive(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        address, engine = _address(params), params.get("remote_engine_id")
        if address is None or not engine or self._down:
            return
        request_id = request.request_id
        target = remote(
            address, str(engine), str(params.get("remote_request_id") or ""), tp_size=int(params.get("tp_size") or 0)
        )
        future = self.client.keep_alive_async(
            self.engine_id, request_id, target, transfer_id=str(params.get("transfer_id") or "")
        )
        self._kept_alive[request_id] = future

        def done(f: Future[Any]) -> None:
            # Errors (an older sidecar without KeepAlive, a sidecar that is down) change nothing:
            # the request call that follows reports its own failure.
            if f.exception() is None and not f.result().producer_holds:
                self._producer_lost.add(request_id)

        future.add_done_callback(done)

    def _after_keep_alive(self, request_id: str, call: Callable[[], Future[Any]]) -> _FutureLike:
        """Issue ``call`` once the request's KeepAlive (if any) is answered, so the call that ends
        the keep-alive on the sidecar cannot overtake it and leave it running."""
        kept = self._kept_alive.pop(request_id, None)
        if kept is None or kept.done():
            return call()
        proxy: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def issue(_: Future[Any]) -> None:
            try:
                real = call()
            except Exception as exc:
                proxy.set_exception(exc)
                return
            real.add_done_callback(lambda f: _copy_outcome(f, proxy))

        kept.add_done_callback(issue)
        return proxy

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        # --- multi-turn hook: a prefill leg may load earlier turns from a remote hold (None: ask again).
        if self.multiturn is not None and params and params.get("do_remote_decode") and not self._down:
            return self.multiturn.matched_tokens(request, num_computed_tokens)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if not params.get("remote_engine_id") or _address(params) is None:
            logger.warning(
                "SidecarConnector: %s has incomplete kv_transfer_params %s; recomputing",
                request.request_id,
                params,
            )
            return 0, False
        if self._down or request.request_id in self._producer_lost:
            # Our sidecar is down, or the producer no longer holds the KV: recompute now instead
            # of waiting for a failure.
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # --- multi-turn hook: pull the matched prefix of a remote hold into the new blocks.
        if self.multiturn is not None:
            held = self.multiturn.take_load(request, num_external_tokens)
            if held is not None:
                local = self._transfer_blocks(blocks.get_unhashed_block_ids_all_groups())
                pulling = self.client.pull_async(
                    self.engine_id, request.request_id, local, held, "", self.config.pull_timeout
                )
                self._track_receive(request.request_id, "", local, pulling, "Pull", num_external_tokens)
                return
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        # One transfer per request, also when the request is rescheduled (vLLM's re-entry guard).
        params["do_remote_prefill"] = False
        self._arrived.pop(request.request_id, None)
        self._producer_lost.discard(request.request_id)
        address = _address(params)
        engine = params.get("remote_engine_id")
        if address is None or not engine:
            return
        mode = self._mode(params)
        request_id = request.request_id
        transfer_id = str(params.get("transfer_id") or "")
        if num_external_tokens <= 0:
            # Nothing to load (a full local prefix hit, or a recompute decision).
            self._fetch_nothing(request_id, params, "nothing to load")
            return
        local = self._transfer_blocks(blocks.get_unhashed_block_ids_all_groups())
        target = remote(
            address,
            str(engine),
            str(params.get("remote_request_id") or ""),
            _grouped(params.get("remote_block_ids")) if mode == "pull" else None,
            int(params.get("tp_size") or 0),
            int(params.get("remote_num_tokens") or 0),
        )
        # The Pull / ExpectPush also ends the sidecar's keep-alive of the request.
        client = self.client
        call: Callable[[], Future[Any]]
        if mode == "pull":
            call = partial(
                client.pull_async, self.engine_id, request_id, local, target, transfer_id, self.config.pull_timeout
            )
        else:
            call = partial(
                client.expect_push_async,
                self.engine_id,
                request_id,
                local,
                target,
                transfer_id,
                self.config.push_timeout,
            )
        future = self._after_keep_alive(request_id, call)
        what = "Pull" if mode == "pull" else "ExpectPush"
        self._track_receive(request_id, transfer_id, local, future, what, num_external_tokens)

    def _track_receive(
        self, request_id: str, transfer_id: str, local: BlockIds, future: _FutureLike, what: str, num_external: int
    ) -> None:
        """A receive's request call was issued: its workers hear of it in the next metadata, and a
        failed call reaches them as a failed receive."""
        flat = _flat(local)
        self._receives[request_id] = _Receive(request_id, transfer_id, flat, future)
        self._new_receives[request_id] = (time.monotonic(), flat)
        future.add_done_callback(lambda f: self._on_receive_call_done(request_id, transfer_id, what, f))
        self.external_tokens[request_id] = num_external
        while len(self.external_tokens) > 4096:
            self.external_tokens.popitem(last=False)

    def _fetch_nothing(self, request_id: str, params: Mapping[str, Any], reason: str) -> None:
        """This consumer request will fetch nothing: the producer may free its blocks (pull mode),
        and the sidecar stops keeping the producer's lease alive."""
        if self._notify_only(request_id, params) or request_id not in self._kept_alive:
            return
        transfer_id = str(params.get("transfer_id") or "")
        release = partial(self.client.release_async, self.engine_id, request_id, transfer_id, reason)
        self._after_keep_alive(request_id, release).add_done_callback(_ignore)

    def _notify_only(self, request_id: str, params: Mapping[str, Any]) -> bool:
        """Tell the producer's sidecar that this consumer reads nothing, so it frees its blocks.

        Pull mode only: an empty Pull is the sidecar's "full prefix hit" path. In push mode the
        producer's lease frees them (the contract has no consumer-side cancel before ExpectPush)."""
        remote_blocks = _grouped(params.get("remote_block_ids"))
        address = _address(params)
        if self._mode(params) != "pull" or not remote_blocks or address is None or self._down:
            return False
        target = remote(
            address,
            str(params.get("remote_engine_id")),
            str(params.get("remote_request_id") or ""),
            remote_blocks,
            int(params.get("tp_size") or 0),
        )
        empty: BlockIds = tuple([] for _ in remote_blocks)
        transfer_id = str(params.get("transfer_id") or "")
        call = partial(self.client.pull_async, self.engine_id, request_id, empty, target, transfer_id)
        # Best effort: the producer's lease frees the blocks otherwise.
        self._after_keep_alive(request_id, call).add_done_callback(_ignore)
        return True

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        request_id = request.request_id
        self._producer_lost.discard(request_id)
        self._arrived.pop(request_id, None)
        if self.multiturn is not None:
            self.multiturn.forget(request_id)  # multi-turn hook: a lookup not taken
        if params.get("do_remote_prefill"):
            # Finished (aborted) before blocks were allocated: nothing was fetched. The producer may
            # free its blocks (pull), and the sidecar stops keeping its lease alive.
            params["do_remote_prefill"] = False
            self._fetch_nothing(request_id, params, "aborted before its KV was requested")
            return False, None
        receive = self._receives.get(request_id)
        if receive is not None:
            # Finished while its KV is still on the way (an abort): vLLM keeps the blocks until the
            # workers report the request, so it stays tracked (a failed request call must still
            # reach them); the sidecar is asked to end it now rather than at its timeout.
            if not receive.aborted:
                receive.aborted = True
                self._release_after(receive, "the consumer request was aborted")
            return False, None
        if not params.get("do_remote_decode"):
            if self._holds_turns:  # multi-turn hook: a decode engine keeps the turn for the next one
                return self._hold_for_next_turn(request, block_ids)
            return False, None
        # Producer: keep the blocks for the consumer only after a normal finish.
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            transfer_id = str(params.get("transfer_id") or "")
            if transfer_id and not self._down:
                # A router that dispatched both legs at once has a consumer waiting for this
                # prefill: ask the sidecar to release the transfer everywhere it exists.
                self.client.release_async(
                    self.engine_id, request_id, transfer_id, reason=f"prefill ended with {request.status.name}"
                ).add_done_callback(_ignore)
            return False, None
        blocks = self._transfer_blocks(block_ids)
        if not any(blocks):
            return False, None
        if self._address is None or self._down:
            self._refresh_address()
            # No sidecar to hold them: free now; without params the router sends the decode leg
            # as a plain request and the consumer computes the prompt itself.
            logger.warning("SidecarConnector: sidecar unavailable; %s is not offered to a consumer", request_id)
            return False, None
        mode = self._mode(params)
        transfer_id = str(params.get("transfer_id") or "")
        future = self.client.submit_blocks_async(
            self.engine_id,
            request_id,
            blocks,
            transfer_id=transfer_id,
            num_tokens=request.num_computed_tokens,
            lease_seconds=self.config.lease_seconds,
            mode=_MODES[mode],
        )
        future.add_done_callback(lambda f: self._on_submit_done(request_id, f))
        self._sends.add(request_id)
        if mode == "push":
            self._push_sends.add(request_id)
        self._new_sends[request_id] = time.monotonic()
        host, port = _split_address(self._address)
        result: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(group) for group in blocks],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "dcp_size": 1,
            "remote_num_tokens": request.num_computed_tokens,
            "transfer_mode": mode,
        }
        if transfer_id:
            result["transfer_id"] = transfer_id
        if params.get("conversation_id"):  # multi-turn hook: D's hold is indexed by it
            result["conversation_id"] = params["conversation_id"]
        return True, result

    def _hold_for_next_turn(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Multi-turn hook (engine_shim.multiturn): keep a finished decode request's blocks on the
        sidecar until a prefill engine reads them for the next turn, their TTL ends, or the hold
        cap releases them; vLLM frees them at the FINISHED_SENDING / LEASE_EXPIRED that follows."""
        from vllm.v1.request import RequestStatus

        assert self.multiturn is not None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        blocks = self._transfer_blocks(block_ids)
        if not any(blocks) or self._address is None or self._down:
            return False, None
        request_id = request.request_id
        host, port = _split_address(self._address)
        future, result = self.multiturn.hold(request, blocks, host, port, self.tp_size, self.pp_size)
        future.add_done_callback(lambda f: self._on_submit_done(request_id, f, "HoldBlocks"))
        self._sends.add(request_id)
        self._new_sends[request_id] = time.monotonic()
        return True, result

    def _release_after(self, receive: _Receive, reason: str) -> None:
        def release(_: Future[Any]) -> None:
            future = self.client.release_async(self.engine_id, receive.request_id, receive.transfer_id, reason=reason)
            # If the sidecar did not know it (or is gone), its request call failed and was reported.
            future.add_done_callback(_ignore)

        # After the request call, so the release cannot overtake it on the way to the sidecar.
        receive.future.add_done_callback(release)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SidecarConnectorMetadata:
        if self._arrived:
            # Consumer requests that arrived but were not scheduled in this step wait for blocks.
            for request in self._arrived.values():
                self._keep_alive(request)
            self._arrived = {}
        meta = SidecarConnectorMetadata()
        if self._new_receives:
            meta.recv_started, self._new_receives = self._new_receives, {}
        if self._new_sends:
            meta.send_started, self._new_sends = self._new_sends, {}
        failures = self._failures
        while failures:
            kind, request_id, reason = failures.popleft()
            if kind == "recv":
                if self._receives.pop(request_id, None) is not None:
                    meta.recv_failed[request_id] = reason
                    logger.warning(
                        "SidecarConnector: receive of %s failed (%s); vLLM recomputes it", request_id, reason
                    )
            elif request_id in self._sends:
                self._sends.discard(request_id)
                self._push_sends.discard(request_id)
                meta.send_abandoned[request_id] = reason
                logger.warning("SidecarConnector: %s; freeing the blocks of %s", reason, request_id)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.finished_recving:
            for request_id in connector_output.finished_recving:
                self._receives.pop(request_id, None)
        if connector_output.finished_sending:
            for request_id in connector_output.finished_sending:
                self._sends.discard(request_id)
                self._push_sends.discard(request_id)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping while failures wait for delivery or pushed blocks wait for their
        # WRITEs (vLLM's push semantics); pulled blocks are freed at the next step, as in vLLM.
        return bool(self._failures or self._push_sends)


# --- worker role: memory -------------------------------------------------------------------------


class _ShmKvAllocation(TorchFunctionMode):
    """Turns vLLM's one KV allocation (``torch.zeros(n, dtype=int8)`` with ``n`` announced by
    ``kv_cache_config``) into a tensor over a ``SharedBuffer``; every other call passes."""

    def __init__(self, sizes: set[int], path: Path) -> None:
        super().__init__()
        self.sizes = sizes
        self.path = path
        self.buffer: SharedBuffer | None = None
        self.data_ptr = 0

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and not self.data_ptr:
            size = _single_size(args, kwargs)
            device = kwargs.get("device")
            on_cpu = device is None or torch.device(device).type == "cpu"
            if size in self.sizes and kwargs.get("dtype") == torch.int8 and on_cpu:
                try:
                    return self._allocate(size)
                except OSError as exc:  # e.g. shm_dir on a filesystem without O_TMPFILE
                    logger.warning("SidecarConnector: cannot put the KV cache in %s (%s)", self.path.parent, exc)
        return func(*args, **kwargs)

    def _allocate(self, size: int) -> torch.Tensor:
        self.buffer = SharedBuffer(size, name=self.path.name, directory=self.path.parent)  # zeros, like torch.zeros
        tensor = torch.from_numpy(self.buffer.array).view(torch.int8)
        self.data_ptr = tensor.untyped_storage().data_ptr()
        logger.info("SidecarConnector: KV cache (%d bytes) allocated in shared memory %s", size, self.path)
        return tensor


def _single_size(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
    value = args[0] if args else kwargs.get("size")
    if isinstance(value, int):
        return value
    if isinstance(value, (tuple, list, torch.Size)) and len(value) == 1 and isinstance(value[0], int):
        return int(value[0])
    return None


@dataclass
class _StreamClosed:
    generation: int
    reason: str


@dataclass
class _Connected:
    generation: int
    sidecar_id: str


@dataclass
class _PendingReceive:
    blocks: list[int]
    started: float


class _WorkerSide:
    """One rank's registration and completions; request state is touched only by vLLM's worker
    thread (see module doc)."""

    # A receive's outcome can overtake the step that announces the receive (same step, or the
    # next): kept this long. A send is announced at the producer's *next* step, which may be much
    # later on an idle engine, so early send outcomes are kept until announced (bounded count).
    EARLY_RECV_TTL = 120.0
    MAX_EARLY_SENDS = 100_000

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ShimConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None and transfer.engine_id is not None
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.config = config
        self.engine_id: str = transfer.engine_id
        self.role = _ROLES[transfer.kv_role or "kv_both"]
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = _parallel_ranks(vllm_config)
        self._single_group = len(kv_cache_config.kv_cache_groups) == 1
        self.client = SidecarClient(config.sidecar_socket, timeout=config.rpc_timeout)
        self._inbox: queue.SimpleQueue[engine_pb2.Event | _StreamClosed | _Connected] = queue.SimpleQueue()
        self._allocation: _ShmKvAllocation | None = None
        self._registration: engine_pb2.RegisterWorkerRequest | None = None
        self._watcher: EventWatcher | None = None
        self._watcher_lock = threading.Lock()
        self._generation = 0  # of the newest stream (supervisor thread)
        self._active_generation = -1  # of the stream the worker thread considers live
        self.connected = False
        self.sidecar_id = ""
        self.peer_address = ""
        self._need_connect = threading.Event()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        # Request state (vLLM worker thread only).
        self._receives: dict[str, _PendingReceive] = {}
        self._sends: set[str] = set()
        self._early_recv: collections.OrderedDict[str, tuple[engine_pb2.Event, float]] = collections.OrderedDict()
        self._early_send: dict[str, engine_pb2.Event] = {}
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._step_invalid: set[int] = set()
        self._next_housekeeping = 0.0
        self._last_loss = 0.0  # time.monotonic() of the last lost event stream
        # This interval's outcomes for vLLM's stat loggers (see engine_shim.vllm_stats).
        self.stats = vllm_stats.SidecarKVConnectorStats()
        # Terminal outcomes per request (bounded), for tests, benchmarks and debugging.
        self.transfers: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()

    # memory export -----------------------------------------------------------------------------

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        if self.config.memory_export == "torch_shm" or not _is_cpu(self.vllm_config):
            return None
        sizes = {tensor.size for tensor in self.kv_cache_config.kv_cache_tensors}
        if not sizes:
            return None
        directory = Path(self.config.shm_dir)
        for orphan in directory.glob(f"{SHM_PREFIX}*"):
            if remove_if_orphaned(orphan):  # left by an engine that was killed
                logger.warning("SidecarConnector: removed %s, left behind by an engine that was killed", orphan)
        rank = f"pp{self.pp_rank}-tp{self.tp_rank}"
        name = f"{SHM_PREFIX}{self.engine_id}-{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._allocation = _ShmKvAllocation(sizes, directory / name)
        return self._allocation

    def _export(self, storage: torch.UntypedStorage) -> engine_pb2.MemoryExport:
        nbytes = storage.nbytes()
        allocation = self._allocation
        if allocation is not None and allocation.buffer is not None and allocation.data_ptr == storage.data_ptr():
            return allocation.buffer.export(0, nbytes)
        if self.config.memory_export == "mem_pool":
            raise RuntimeError(
                "SidecarConnector: memory_export='mem_pool' but vLLM did not allocate the KV cache through "
                "get_mem_pool_context(); use memory_export='auto' to fall back to torch shared memory"
            )
        if storage.device.type != "cpu":
            raise NotImplementedError(
                f"SidecarConnector exports DRAM KV caches only; this one lives on {storage.device}"
            )
        # Fallback: move the storage into a torch-managed shm file (copies it once) and export the
        # bytes after the file's refcount header.
        _, name, _ = storage._share_filename_cpu_()
        path = SHM_DIR / (name.decode() if isinstance(name, bytes) else str(name)).lstrip("/")
        header = path.stat().st_size - nbytes
        if not 0 <= header < 4096:
            raise RuntimeError(f"SidecarConnector: unexpected layout of torch shm file {path}")
        logger.info("SidecarConnector: KV cache shared through torch shm file %s (header %d bytes)", path, header)
        return engine_pb2.MemoryExport(
            kind=common_pb2.MEMORY_KIND_DRAM, shm_path=str(path), offset=header, length=nbytes
        )

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self._registration = self._build_registration(kv_caches)
        try:
            self._connect(self.config.register_timeout)
        except Exception as exc:
            logger.warning(
                "SidecarConnector: registration with %s failed (%s); retrying in the background",
                self.config.sidecar_socket,
                exc,
            )
            self._need_connect.set()
        self._supervisor = threading.Thread(target=self._supervise, name="kvsidecar-shim-supervisor", daemon=True)
        self._supervisor.start()
        atexit.register(self._close_shm)

    def _build_registration(self, kv_caches: Mapping[str, torch.Tensor]) -> engine_pb2.RegisterWorkerRequest:
        config = self.kv_cache_config
        transfer_groups = list(config.transfer_group_ids)
        group_of: dict[str, int] = {}
        for index, group_id in enumerate(transfer_groups):
            for name in config.kv_cache_groups[group_id].layer_names:
                group_of[name] = index
        exports: list[engine_pb2.MemoryExport] = []
        export_of: dict[int, int] = {}
        regions: list[engine_pb2.KvRegion] = []
        seen: set[tuple[int, int]] = set()
        num_blocks = 0
        for name, tensor in kv_caches.items():
            if name not in group_of:
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in export_of:
                export_of[key] = len(exports)
                exports.append(self._export(storage))
                key = storage.data_ptr()  # the torch shm fallback moves the storage
                export_of[key] = len(exports) - 1
            element = tensor.element_size()
            offset = int(tensor.storage_offset())
            view = (key, offset)
            if view in seen:
                continue  # a layer sharing another layer's KV cache
            seen.add(view)
            if tensor.dim() < 2 or not tensor[0].is_contiguous():
                raise NotImplementedError(
                    f"SidecarConnector needs block-contiguous KV caches (layout LBHNC); {name} has shape "
                    f"{tuple(tensor.shape)} and strides {tensor.stride()}"
                )
            if num_blocks and tensor.shape[0] != num_blocks:
                raise NotImplementedError("SidecarConnector needs the same number of blocks in every layer")
            num_blocks = int(tensor.shape[0])
            regions.append(
                engine_pb2.KvRegion(
                    name=name,
                    export_index=export_of[key],
                    offset=offset * element,
                    block_len=tensor[0].numel() * element,
                    block_stride=tensor.stride(0) * element,
                    group_id=group_of[name],
                )
            )
        if not regions:
            raise RuntimeError("SidecarConnector: vLLM registered no transferable KV cache layers")
        logical = max(1, config.num_blocks)
        model = self.vllm_config.model_config
        parallel = self.vllm_config.parallel_config
        return engine_pb2.RegisterWorkerRequest(
            engine_id=self.engine_id,
            role=self.role,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            geometry=common_pb2.KvGeometry(
                block_size=self.vllm_config.cache_config.block_size,
                physical_blocks_per_logical=max(1, num_blocks // logical),
                kv_layout=str(config.kv_cache_layout or "LBHNC"),
                num_blocks=num_blocks,
                num_kv_heads=model.get_num_kv_heads(parallel),
                total_num_kv_heads=model.get_total_num_kv_heads(),
                is_mla=bool(model.use_mla),
            ),
            exports=exports,
            regions=regions,
            compat_factors=compat_factors(self.vllm_config),
            engine_version=f"vllm {_vllm_version()}",
            pid=os.getpid(),
        )

    # connection (init thread, then the supervisor thread) ---------------------------------------

    def _connect(self, timeout: float) -> None:
        registration = self._registration
        assert registration is not None
        if not Path(self.config.sidecar_socket).exists():
            raise ConnectionError(f"no sidecar socket at {self.config.sidecar_socket}")  # fail fast, retry later
        self.client.wait_ready(timeout)
        response = self.client.register_worker(registration)
        with self._watcher_lock:
            self._generation += 1
            generation = self._generation
            old, self._watcher = self._watcher, None
        if old is not None:
            old.cancel()
        watcher = EventWatcher(
            self.client,
            self.engine_id,
            self.tp_rank,
            self.pp_rank,
            on_closed=lambda reason: self._on_closed(generation, reason),
            on_event=self._inbox.put,
        )
        try:
            watcher.wait_connected(timeout)
        except BaseException:
            watcher.cancel()
            raise
        with self._watcher_lock:
            self._watcher = watcher
        self.peer_address = response.peer_address
        self._inbox.put(_Connected(generation, watcher.sidecar_id))
        logger.info(
            "SidecarConnector: worker %s registered with sidecar %s (%s, %d bytes)",
            response.worker_id,
            watcher.sidecar_id[:8],
            response.peer_address,
            response.registered_bytes,
        )

    def _on_closed(self, generation: int, reason: str) -> None:  # watcher thread
        if self._stopping.is_set():
            return
        self._inbox.put(_StreamClosed(generation, reason))
        with self._watcher_lock:
            current = generation == self._generation
        if current:
            logger.warning("SidecarConnector: event stream closed (%s); registering again", reason)
            self._need_connect.set()

    def _supervise(self) -> None:
        backoff = 0.2
        while not self._stopping.is_set():
            if not self._need_connect.wait(timeout=1.0):
                continue
            if self._stopping.is_set():
                return
            # Cleared before connecting: a stream that closes right after it opened sets it again.
            self._need_connect.clear()
            try:
                self._connect(self.config.register_timeout)
            except Exception as exc:
                logger.debug("SidecarConnector: registering again failed: %s", exc)
                self._need_connect.set()
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.2

    # per step (vLLM worker thread) --------------------------------------------------------------

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, SidecarConnectorMetadata):
            return
        if meta.recv_started or meta.send_started:
            self._drain()  # so that an already-arrived event resolves the request right away
        now = time.monotonic()
        # A request call made before this worker's event stream was last lost went to a sidecar
        # registration that no longer exists: no outcome will come for it.
        for request_id, (issued, blocks) in meta.recv_started.items():
            self._receives[request_id] = _PendingReceive(blocks, now)
            early = self._early_recv.pop(request_id, None)
            if early is not None:
                self._on_event(early[0])
            elif not self.connected or issued < self._last_loss:
                self._fail_receive(request_id, "the sidecar's event stream was lost")
        for request_id, issued in meta.send_started.items():
            self._sends.add(request_id)
            sent = self._early_send.pop(request_id, None)
            if sent is not None:
                self._on_event(sent)
            elif not self.connected or issued < self._last_loss:
                self._finish_send(request_id, "the sidecar's event stream was lost")
        for request_id, reason in meta.recv_failed.items():
            self._fail_receive(request_id, reason)
        for request_id, reason in meta.send_abandoned.items():
            self._finish_send(request_id, reason)

    def poll(self) -> None:
        """Apply what the event stream delivered so far (vLLM's worker thread only; results are
        kept for the next ``get_transfer_results``)."""
        self._drain()

    def get_transfer_results(self) -> KVConnectorTransferResults:
        self._drain()
        if self._receives or self._early_recv:
            now = time.monotonic()
            if now >= self._next_housekeeping:
                self._housekeeping(now)
        results = KVConnectorTransferResults()
        if self._done_sending:
            results.finished_sending, self._done_sending = self._done_sending, set()
        if self._done_recving:
            results.finished_recving, self._done_recving = self._done_recving, set()
        if self._failed_recving:
            results.failed_recving, self._failed_recving = self._failed_recving, set()
        if self._invalid_blocks:
            self._step_invalid, self._invalid_blocks = self._invalid_blocks, set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self._step_invalid:
            return set()
        invalid, self._step_invalid = self._step_invalid, set()
        return invalid

    def _drain(self) -> None:
        inbox = self._inbox
        while True:
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, engine_pb2.Event):
                self._on_event(item)
            elif isinstance(item, _Connected):
                self._active_generation = item.generation
                self.connected = True
                self.sidecar_id = item.sidecar_id
            elif item.generation == self._active_generation:
                self.connected = False
                self._stream_lost(item.reason)

    def _on_event(self, event: engine_pb2.Event) -> None:
        request_id = event.request_id
        kind = event.kind
        if kind in (engine_pb2.FINISHED_RECEIVING, engine_pb2.LOAD_FAILED):
            if request_id not in self._receives:
                self._early_recv[request_id] = (event, time.monotonic())
                if len(self._early_recv) > 10_000:
                    self._early_recv.popitem(last=False)
            elif kind == engine_pb2.FINISHED_RECEIVING:
                del self._receives[request_id]
                self._done_recving.add(request_id)
                self._record(request_id, event, "received")
            else:
                self._fail_receive(request_id, event.reason, list(event.failed_block_ids), event)
        elif kind in (engine_pb2.FINISHED_SENDING, engine_pb2.LEASE_EXPIRED):
            if request_id not in self._sends:
                self._early_send[request_id] = event
                if len(self._early_send) > self.MAX_EARLY_SENDS:
                    self._early_send.pop(next(iter(self._early_send)))
            else:
                self._sends.discard(request_id)
                self._done_sending.add(request_id)
                self._record(request_id, event, "sent" if kind == engine_pb2.FINISHED_SENDING else "lease_expired")

    def _fail_receive(
        self,
        request_id: str,
        reason: str,
        failed: list[int] | None = None,
        event: engine_pb2.Event | None = None,
    ) -> None:
        pending = self._receives.pop(request_id, None)
        if pending is None:
            return
        self._done_recving.add(request_id)
        self._failed_recving.add(request_id)
        if self._single_group:
            # Block ids are unambiguous only with one KV cache group (vLLM refuses them otherwise).
            self._invalid_blocks.update(failed or pending.blocks)
        self._record(request_id, event, "load_failed", reason)
        logger.warning("SidecarConnector: loading KV for %s failed (%s); vLLM recomputes it", request_id, reason)

    def _finish_send(self, request_id: str, reason: str) -> None:
        if request_id in self._sends:
            self._sends.discard(request_id)
            self._done_sending.add(request_id)
            self._record(request_id, None, "send_abandoned", reason)

    def _stream_lost(self, reason: str) -> None:
        # The sidecar dropped this worker (or died): nothing it was doing for us continues, so every
        # receive fails and every held block is free.
        self._last_loss = time.monotonic()
        for request_id in list(self._receives):
            self._fail_receive(request_id, f"event stream closed: {reason}")
        for request_id in list(self._sends):
            self._finish_send(request_id, f"event stream closed: {reason}")

    def _housekeeping(self, now: float) -> None:
        self._next_housekeeping = now + 1.0
        limit = self.config.recv_watchdog
        for request_id, pending in list(self._receives.items()):
            if now - pending.started > limit:
                logger.error("SidecarConnector: no outcome for %s after %.0fs", request_id, limit)
                self._fail_receive(request_id, f"no outcome from the sidecar within {limit:g}s")
        while self._early_recv:
            request_id, (_, seen) = next(iter(self._early_recv.items()))
            if now - seen < self.EARLY_RECV_TTL:
                break
            del self._early_recv[request_id]

    def _record(self, request_id: str, event: engine_pb2.Event | None, outcome: str, reason: str = "") -> None:
        nbytes = event.bytes if event is not None else 0
        duration_ms = event.duration_ms if event is not None else 0.0
        self.stats.record(outcome, nbytes, duration_ms)
        self.transfers[request_id] = {
            "outcome": outcome,
            "bytes": nbytes,
            "duration_ms": duration_ms,
            "reason": reason or (event.reason if event is not None else ""),
        }
        while len(self.transfers) > 4096:
            self.transfers.popitem(last=False)

    # shutdown ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self._stopping.set()
        self._need_connect.set()
        with self._watcher_lock:
            watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
        if self._registration is not None:
            try:
                self.client.stub.UnregisterWorker(
                    engine_pb2.UnregisterWorkerRequest(
                        engine_id=self.engine_id, tp_rank=self.tp_rank, pp_rank=self.pp_rank
                    ),
                    timeout=2.0,
                )
            except grpc.RpcError:
                pass  # gone already, or it drops us when the stream closes
        if self._supervisor is not None:
            self._supervisor.join(timeout=5.0)
        self.client.close()
        self._close_shm()

    def shm_paths(self) -> list[Path]:
        """The KV file this worker exported, if it made one (tests and debugging)."""
        allocation = self._allocation
        return [allocation.path] if allocation is not None and allocation.buffer is not None else []

    def _close_shm(self) -> None:
        # Removes the file's name; vLLM's tensors keep the mapping for as long as they live.
        if self._allocation is not None and self._allocation.buffer is not None:
            self._allocation.buffer.close()


# --- vLLM facts ----------------------------------------------------------------------------------


def _vllm_version() -> str:
    try:
        from vllm import __version__

        return str(__version__)
    except Exception:
        return "unknown"


def _is_cpu(vllm_config: VllmConfig) -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.device_type == "cpu")
    except Exception:
        return str(getattr(vllm_config.device_config, "device_type", "")) == "cpu"


def _parallel_ranks(vllm_config: VllmConfig) -> tuple[int, int, int, int]:
    parallel = vllm_config.parallel_config
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    tp_rank = pp_rank = 0
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank = get_tp_group().rank_in_group
        pp_rank = get_pp_group().rank_in_group
    except Exception:
        pass
    return tp_rank, tp_size, pp_rank, pp_size


def _attention_backends(vllm_config: VllmConfig) -> str:
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        return ",".join(sorted({backend.get_name() for backend in get_current_attn_backends(vllm_config)}))
    except Exception:
        return "unknown"


def compat_factors(vllm_config: VllmConfig) -> dict[str, str]:
    """What decides whether two engines' KV blocks are interchangeable byte for byte.

    Like vLLM's NIXL compatibility hash, TP size and block size are left out (the sidecar checks
    them per transfer); the transfer mode too, because one sidecar serves both flows."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    factors = {
        "connector": f"SidecarConnector/{CONNECTOR_VERSION}",
        "engine": f"vllm {_vllm_version()}",
        "model": str(model.model),
        "revision": str(model.revision or ""),
        "dtype": str(model.dtype),
        "num_kv_heads": str(model.get_total_num_kv_heads()),
        "head_size": str(model.get_head_size()),
        "num_layers": str(model.get_total_num_hidden_layers()),
        "attention_backend": _attention_backends(vllm_config),
        "cache_dtype": str(cache.cache_dtype),
        "kv_layout": "LBHNC",
        "device": "cpu" if _is_cpu(vllm_config) else "gpu",
    }
    if factors["device"] == "cpu":
        # The CPU attention kernels' block-internal layout depends on the ISA (AVX-512 vs AMX).
        factors["cpu_isa"] = str(torch.backends.cpu.get_cpu_capability())
    return factors


# --- the connector -------------------------------------------------------------------------------


class SidecarConnector(KVConnectorBase_V1, SupportsHMA):
    """Delegates to ``_SchedulerSide`` or ``_WorkerSide`` by role (see the module doc)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        if transfer.engine_id is None:
            raise ValueError("SidecarConnector needs kv_transfer_config.engine_id")
        self.config = ShimConfig.from_vllm(vllm_config)
        _check_groups(kv_cache_config)
        if transfer.kv_load_failure_policy != "recompute" and transfer.is_kv_consumer:
            logger.warning(
                "SidecarConnector: kv_load_failure_policy=%r: a failed KV load fails the request; set "
                "'recompute' to have vLLM compute the prompt instead",
                transfer.kv_load_failure_policy,
            )
        self.scheduler_side: _SchedulerSide | None = None
        self.worker_side: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = _SchedulerSide(vllm_config, kv_cache_config, self.config)
        else:
            self.worker_side = _WorkerSide(vllm_config, kv_cache_config, self.config)
        try:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource

            self._cache_hit_source = CacheHitSource.P2P
        except Exception:
            pass

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Block-contiguous per layer, so one block of one layer is one descriptor (as NIXL asks).
        model = vllm_config.model_config
        if model is None or model.use_mla:
            return None
        return "LBHNC"

    def _scheduler(self) -> _SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-role method was called on a worker"
        return self.scheduler_side

    def _worker(self) -> _WorkerSide:
        assert self.worker_side is not None, "a worker-role method was called on the scheduler"
        return self.worker_side

    # worker role -------------------------------------------------------------------------------

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        return self._worker().get_mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # transfers complete between steps; nothing is loaded layer by layer

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # the sidecar reads the blocks in place; nothing is saved

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self._worker().get_transfer_results()
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker().get_transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # vLLM asks both roles; only workers see transfer outcomes.
        return self.worker_side.stats.take() if self.worker_side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return vllm_stats.build(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return vllm_stats.SidecarPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()

    # scheduler role ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_push_work()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # Every transfer group is written by the sidecar: vLLM must not zero those blocks.
        return tuple(self._kv_cache_config.transfer_group_ids)


def _check_groups(kv_cache_config: KVCacheConfig) -> None:
    """Only full-attention groups are transferred block for block; sliding-window and Mamba groups
    need per-group clipping this shim does not do, so refuse them at start rather than corrupt."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    for group_id in kv_cache_config.transfer_group_ids:
        spec = kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
        inner_specs: dict[str, Any] = getattr(spec, "kv_cache_specs", None) or {"": spec}
        for inner in inner_specs.values():
            if not isinstance(inner, FullAttentionSpec) or getattr(inner, "sliding_window", None):
                raise NotImplementedError(
                    f"SidecarConnector transfers full-attention KV cache groups only; group {group_id} is "
                    f"{type(inner).__name__}"
                )


__all__ = ["ShimConfig", "SidecarConnector", "SidecarConnectorMetadata", "compat_factors"]
