"""What both halves of the scheduler role share: the sidecar's channel and its state.

``SidecarLink`` is the base of ``SchedulerSide`` (``engine_shim.vllm.scheduler``): the engine's
identity and geometry, the ``SidecarClient``, this sidecar's peer address (returned to routers as
``remote_host``/``remote_port``) and whether its channel is down, the workers' input wake-ups, and
the helpers both roles use (``mode``, ``transfer_blocks``). D's receive side
(``engine_shim.vllm.receive``) and P's send side (``engine_shim.vllm.send``) hold the link and read
``client``/``config`` through it on each use (so a replaced client or config reaches both).

Threads: vLLM's scheduler thread calls every method; gRPC callback threads only set plain fields
(``_down``, ``_address``) in ``_on_connectivity`` and ``_refresh_address``'s callback.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from vllm.logger import init_logger

from engine_shim.client import Future, SidecarClient
from engine_shim.vllm.config import MODES, BlockIds, ShimConfig
from engine_shim.vllm.input_wake import InputWaker, engine_input_queue, socket_name, wake_workers_on_input

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger("vllm.kvsidecar.scheduler")

# Status codes with which the sidecar refused a request call before starting anything: the request
# can fail at once. Any other error (a deadline, a cancelled call) leaves it unknown whether the
# sidecar accepted the call, so the shim first asks it to release the request (see the receive side).
REFUSED = frozenset(
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


class FutureLike(Protocol):
    """A gRPC future, or a plain future standing for a call issued later (see ``after_keep_alive``)."""

    def add_done_callback(self, fn: Callable[[Any], object]) -> None: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...

    def result(self, timeout: float | None = None) -> Any: ...

    def done(self) -> bool: ...


def copy_outcome(source: Future[Any], target: concurrent.futures.Future[Any]) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def ignore(future: FutureLike) -> None:
    """Done-callback of a best-effort call: consume its outcome (gRPC logs unretrieved errors)."""
    future.exception()


def rpc_error(exc: BaseException) -> tuple[grpc.StatusCode | None, str]:
    if isinstance(exc, grpc.RpcError):
        code = exc.code()
        return code, f"{code.name}: {exc.details()}"
    return None, repr(exc)


class SidecarLink:
    """The engine's sidecar as both scheduler roles see it (see the module doc)."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ShimConfig, dp_rank: int
    ) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None and transfer.engine_id is not None
        self.engine_id: str = transfer.engine_id
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.transfer_groups = tuple(kv_cache_config.transfer_group_ids)
        self._all_groups = len(self.transfer_groups) == len(kv_cache_config.kv_cache_groups)
        self.client = SidecarClient(config.sidecar_socket, timeout=config.rpc_timeout)
        self._input_waker = self._wake_idle_workers_on_input(dp_rank)
        # This sidecar's PeerService address, returned to routers as remote_host/remote_port.
        self._address: str | None = None
        self._address_future: Future[Any] | None = None
        self._down = False  # the channel is in TRANSIENT_FAILURE / SHUTDOWN

    def _connect(self) -> None:
        """Follow the channel's state and ask for the peer address (once the roles are built)."""
        self.client.subscribe_connectivity(self._on_connectivity)
        try:
            self._address = self.client.status_async().result(timeout=min(5.0, self.config.rpc_timeout)).sidecar.address
        except Exception as exc:
            logger.warning("SidecarConnector: sidecar at %s not reachable yet (%s)", self.config.sidecar_socket, exc)

    def shutdown(self) -> None:
        try:
            self.client.unsubscribe_connectivity(self._on_connectivity)
        except Exception:
            pass
        self.client.close()
        if self._input_waker is not None:
            self._input_waker.close()

    def _wake_idle_workers_on_input(self, dp_rank: int) -> InputWaker | None:
        """Have everything that reaches this EngineCore end its workers' idle waits (input_wake)."""
        if self.config.idle_wait <= 0:
            return None
        input_queue = engine_input_queue()
        if input_queue is None:
            logger.info("SidecarConnector: no EngineCore input queue found; idle steps end at idle_wait")
            return None
        names = [
            socket_name(self.engine_id, dp_rank, tp, pp) for pp in range(self.pp_size) for tp in range(self.tp_size)
        ]
        waker = InputWaker(names)
        try:
            wake_workers_on_input(input_queue, waker)
        except TypeError as exc:
            waker.close()
            logger.warning("SidecarConnector: idle steps end only at idle_wait (%s)", exc)
            return None
        logger.info("SidecarConnector: input to the EngineCore wakes %d idle worker(s)", len(waker.names))
        return waker

    @property
    def offers_kv(self) -> bool:
        """Whether a finished prefill is offered to consumers now: the sidecar's channel is up and
        its peer address known (after a sidecar restart, once the channel reconnects)."""
        return self._address is not None and not self._down

    @property
    def down(self) -> bool:
        return self._down

    @property
    def address(self) -> str | None:
        return self._address

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

    # vLLM scheduler thread ---------------------------------------------------------------------

    def mode(self, params: Mapping[str, Any]) -> str:
        mode = params.get("transfer_mode")
        return mode if mode in MODES else self.config.transfer_mode

    def transfer_blocks(self, block_ids: Sequence[Sequence[int]]) -> BlockIds:
        """The block ids of the KV cache groups the sidecar transfers (vLLM's, one list per group)."""
        if self._all_groups:
            return tuple(list(group) for group in block_ids)
        return tuple(list(block_ids[group]) for group in self.transfer_groups)
