"""Unit tests of the vLLM connector package (``engine_shim.vllm``) without a vLLM engine.

vLLM is imported (the connector subclasses its interfaces) but no engine runs: the connector's
parts are built from the few configuration fields they read. Most need no sidecar; the voucher
test talks to a real one with a registered simulated engine. The end-to-end behaviour with real
vLLM instances is in ``test_vllm_e2e.py``.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from engine_shim.vllm import compat  # noqa: E402
from engine_shim.vllm.compat import compat_factors  # noqa: E402
from engine_shim.vllm.config import ShimConfig  # noqa: E402
from engine_shim.vllm.scheduler import SchedulerSide  # noqa: E402
from engine_shim.vllm.worker import WorkerSide  # noqa: E402
from tests.support.tiny_models import kv_cache_config  # noqa: E402


class ThreadRecordingSet(set[str]):
    """A set that records which thread mutated it (the scheduler's state belongs to one thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.mutators: list[int] = []

    def add(self, item: str) -> None:
        self.mutators.append(threading.get_ident())
        super().add(item)

    def discard(self, item: str) -> None:
        self.mutators.append(threading.get_ident())
        super().discard(item)


class KeepAliveClient:
    """Stands in for the gRPC client: KeepAlive returns a future the test completes."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future[Any]] = []

    def keep_alive_async(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.futures.append(future)
        return future


def vllm_config(engine_id: str = "decode-0", kv_role: str = "kv_both", extra: dict[str, Any] | None = None) -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=engine_id, kv_role=kv_role, kv_connector_extra_config=extra or {}),
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(
            model="tiny-llama",
            revision=None,
            dtype=torch.float32,
            use_mla=False,
            get_total_num_kv_heads=lambda: 2,
            get_num_kv_heads=lambda parallel: 2,
            get_head_size=lambda: 32,
            get_total_num_hidden_layers=lambda: 2,
        ),
        device_config=SimpleNamespace(device_type="cpu"),
    )


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[SchedulerSide]:
    kv_cache_config = SimpleNamespace(transfer_group_ids=(0,), kv_cache_groups=[object()])
    config = ShimConfig(sidecar_socket=str(tmp_path / "no-sidecar.sock"), rpc_timeout=0.5)
    side = SchedulerSide(vllm_config(), kv_cache_config, config)  # type: ignore[arg-type]
    yield side
    side.shutdown()


def test_a_kv_producer_with_multi_turn_does_not_look_for_holds(tmp_path: Path) -> None:
    """A prefill engine configured kv_producer cannot load a hold (its sidecar refuses a producer's
    Pull): its prefill legs are scheduled at once instead of waiting for a lookup; kv_both looks."""
    kv_cache_config = SimpleNamespace(transfer_group_ids=(0,), kv_cache_groups=[object()])
    config = ShimConfig(sidecar_socket=str(tmp_path / "no-sidecar.sock"), rpc_timeout=0.5)
    request = SimpleNamespace(
        request_id="turn-2",
        kv_transfer_params={"do_remote_decode": True},
        prompt_token_ids=list(range(200)),
        num_prompt_tokens=200,
        block_hashes=[bytes([i]) * 32 for i in range(6)],
    )
    asked = {}
    for role in ("kv_producer", "kv_both"):
        side = SchedulerSide(vllm_config("prefill-0", role, {"multi_turn": True}), kv_cache_config, config)  # type: ignore[arg-type]
        side._down = False  # as if the sidecar were up (there is none: a query fails or stays in flight)
        try:
            answer = side.get_num_new_matched_tokens(request, 0)  # type: ignore[arg-type]
            assert side.multiturn is not None
            asked[role] = "turn-2" in side.multiturn._lookups or bool(side.multiturn.outcomes)
            if role == "kv_producer":
                assert answer == (0, False)
        finally:
            side.shutdown()
    assert asked == {"kv_producer": False, "kv_both": True}


def test_keep_alive_outcome_reaches_the_scheduler_thread_only(scheduler: SchedulerSide) -> None:
    """A KeepAlive answered "the producer no longer holds it" on a gRPC callback thread makes the
    scheduler recompute the request; the request set is touched by the scheduler thread only
    (the module's threading rule; before the fix the callback thread added to it)."""
    real_client = scheduler.client
    real_client.unsubscribe_connectivity(scheduler._on_connectivity)
    scheduler._down = False  # as if the sidecar were up: only KeepAlive is exercised
    fake = KeepAliveClient()
    scheduler.client = fake  # type: ignore[assignment]
    lost = ThreadRecordingSet()
    scheduler.receiver._producer_lost = lost
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": 50151,
        "remote_request_id": "req-1-p",
    }
    request = SimpleNamespace(request_id="req-1", kv_transfer_params=params, prompt_token_ids=list(range(40)))
    try:
        scheduler.on_new_request(request)  # type: ignore[arg-type]
        assert scheduler.get_num_new_matched_tokens(request, 0) == (40, True)  # type: ignore[arg-type]
        scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))  # type: ignore[arg-type]  # not scheduled: keep it alive
        assert len(fake.futures) == 1
        callback_thread = threading.Thread(
            target=fake.futures[0].set_result, args=(SimpleNamespace(producer_holds=False),)
        )
        callback_thread.start()
        callback_thread.join(timeout=5)
        assert not lost.mutators or set(lost.mutators) == {threading.get_ident()}, "mutated off the scheduler thread"
        # The next scheduling attempt recomputes instead of waiting for a failed load.
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]
        assert set(lost.mutators) == {threading.get_ident()}
    finally:
        real_client.subscribe_connectivity(scheduler._on_connectivity)
        scheduler.client = real_client


def test_only_a_pull_into_an_idle_engine_loads_inline(scheduler: SchedulerSide) -> None:
    """inline_load_max_tokens (opt-in): a pull of at most that many tokens into an engine whose
    last step computed nothing loads inside the step of its first token (vLLM's synchronous load:
    all but the last prompt token counted as computed, load_kv_async False), one request per
    step; a busy engine, a push, or a larger prompt load asynchronously (the whole prompt,
    load_kv_async True)."""
    scheduler._down = False  # as if the sidecar were up
    step = SimpleNamespace(total_num_scheduled_tokens=0)

    def request(name: str, tokens: int, mode: str = "pull") -> Any:
        params = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_host": "127.0.0.1",
                  "remote_port": 50151, "remote_request_id": f"{name}-p", "transfer_mode": mode}  # fmt: skip
        return SimpleNamespace(request_id=name, kv_transfer_params=params, prompt_token_ids=list(range(tokens)))

    matched = scheduler.get_num_new_matched_tokens
    assert matched(request("off", 100), 0) == (100, True)  # off by default
    scheduler.config = replace(scheduler.config, inline_load_max_tokens=8192)
    scheduler.receiver._inline_possible = True  # as an engine built with it (one KV cache group, no async scheduling)
    assert matched(request("a", 100), 32) == (67, False)  # 100 - 32 local - the last one
    assert matched(request("b", 100), 0) == (100, True)  # one inline load per step
    scheduler.receiver._new_inline["a"] = scheduler.receiver._inline.pop("a")  # as its allocation and Pull do
    assert matched(request("b", 100), 0) == (100, True)  # still one per step once allocated
    scheduler.build_connector_meta(step)  # type: ignore[arg-type]
    assert matched(request("push", 100, "push"), 0) == (100, True)
    assert matched(request("large", 9000), 0) == (9000, True)  # over inline_load_max_tokens
    assert matched(request("b", 100), 0) == (99, False)
    scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1))  # type: ignore[arg-type]
    assert matched(request("c", 100), 0) == (100, True)  # the last step computed: the engine is busy
    scheduler.build_connector_meta(step)  # type: ignore[arg-type]
    assert matched(request("c", 100), 0) == (99, False)


def test_an_inline_pull_the_sidecar_refuses_fails_in_the_same_step(scheduler: SchedulerSide) -> None:
    """The workers wait for an inline load before the step's forward, and a refused Pull sends no
    event: the refusal must reach them in the same step's metadata. Here the Pull really goes to a
    socket with no sidecar (UNAVAILABLE)."""
    scheduler._down = False
    scheduler.config = replace(scheduler.config, inline_load_max_tokens=8192)
    scheduler.receiver._inline_possible = True
    params = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_host": "127.0.0.1",
              "remote_port": 50151, "remote_request_id": "r-p", "remote_block_ids": [[5, 6, 7]]}  # fmt: skip
    request = SimpleNamespace(request_id="r", kv_transfer_params=params, prompt_token_ids=list(range(70)))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (69, False)  # type: ignore[arg-type]
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13],))  # one ahead for the first output token
    scheduler.update_state_after_alloc(request, blocks, 69)  # type: ignore[arg-type]
    meta = scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1))  # type: ignore[arg-type]
    assert meta.recv_started["r"][1] == [10, 11, 12]  # the prompt's blocks only
    assert "r" in meta.recv_inline
    assert "UNAVAILABLE" in meta.recv_failed["r"], meta.recv_failed


def registration(tmp_path: Path, layout: str) -> Any:
    """The RegisterWorker request a worker builds for a KV cache of ``layout`` (in a shm file under tmp)."""
    config = kv_cache_config(None, num_blocks=4, layout=layout)
    shim = ShimConfig(sidecar_socket=str(tmp_path / "no-sidecar.sock"), shm_dir=str(tmp_path))
    worker = WorkerSide(vllm_config(), config, shim)
    try:
        context = worker.get_mem_pool_context()
        assert context is not None
        (tensor_config,) = config.kv_cache_tensors
        with context:
            whole = torch.zeros(tensor_config.size, dtype=torch.int8)
        per_layer = whole.view(torch.float32).view(2, config.num_blocks, 2, 32, 2, 32)
        kv_caches = {name: per_layer[index] for index, name in enumerate(tensor_config.layers)}
        return worker._build_registration(kv_caches)
    finally:
        worker.shutdown()


def test_layout_travels_in_the_geometry_not_in_the_compatibility_factors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines that differ only in KV layout have the same compatibility factors (so the
    sidecar can plan or convert per transfer instead of refusing the peer at the handshake), and
    each worker's geometry carries the layout it really has, with its head size and dtype. vLLM's
    CPU attention has its own layout inside a head (by ISA): on the CPU the geometry names it."""
    cpu = registration(tmp_path, "LBHNC")
    assert cpu.geometry.kv_layout == "CPU_VEC_LBHNC"  # fp32, head size 32, block size 32, x86 without AMX
    assert (cpu.geometry.head_size, cpu.geometry.dtype) == (32, "float32")
    monkeypatch.setattr(compat, "is_cpu", lambda config: False)  # as a GPU engine reports it
    lbhnc = registration(tmp_path, "LBHNC")
    hnd = registration(tmp_path, "HND")
    assert lbhnc.geometry.kv_layout == "LBHNC" and hnd.geometry.kv_layout == "HND"
    assert dict(lbhnc.compat_factors) == dict(hnd.compat_factors)
    assert not any("layout" in key for key in compat_factors(vllm_config()))
    assert list(tmp_path.glob("kvsvllm-*")) == [], "the workers' KV files outlived their shutdown"


def test_the_old_module_path_still_names_the_connector() -> None:
    """Existing settings say ``kv_connector_module_path: engine_shim.vllm_connector``."""
    alias = importlib.import_module("engine_shim.vllm_connector")
    package = importlib.import_module("engine_shim.vllm.connector")
    assert alias.SidecarConnector is package.SidecarConnector
    assert alias.ShimConfig is ShimConfig


def test_a_producer_vouches_once_it_has_the_key_and_holds_vouched_blocks_if_the_submit_fails(
    tmp_path: Path, sidecars: Any, engines: Any
) -> None:
    """P's shim signs its offered blocks (kvsidecar.voucher) with the key from its sidecar's last
    SubmitBlocks answer; a consumer may then read them without asking P's sidecar, so if that
    request's own SubmitBlocks fails, vLLM gets the blocks back only after the voucher ran out.
    A real sidecar (vouchers of 2 s, 0.5 s skew allowance) and a registered simulated engine."""
    from vllm.v1.request import RequestStatus

    from kvsidecar import voucher
    from kvsidecar.voucher import PARAM_VOUCHED_UNTIL_MS, PARAM_VOUCHER

    side = sidecars(env={"KVSIDECAR_VOUCHER_SECONDS": "2", "KVSIDECAR_VOUCHER_CLOCK_SKEW_SECONDS": "0.5"})
    engines(side, "decode-0", "producer", blocks=64, block_size=32)
    kv_cache_config = SimpleNamespace(transfer_group_ids=(0,), kv_cache_groups=[object()])
    config = ShimConfig(sidecar_socket=str(side.socket), rpc_timeout=5.0)
    scheduler = SchedulerSide(vllm_config(), kv_cache_config, config)  # type: ignore[arg-type]
    submitted: list[concurrent.futures.Future[Any]] = []
    held_until_ms: list[int] = []  # what each SubmitBlocks told the sidecar to hold vouched blocks until
    submit = scheduler.client.submit_blocks_async

    def record(*args: Any, **kwargs: Any) -> Any:  # the real call; the test waits for its answer
        held_until_ms.append(kwargs.get("vouched_until_ms", 0))
        submitted.append(submit(*args, **kwargs))
        return submitted[-1]

    scheduler.client.submit_blocks_async = record  # type: ignore[method-assign]

    def finish(request_id: str, blocks: list[int]) -> dict[str, Any]:
        request = SimpleNamespace(request_id=request_id, kv_transfer_params={"do_remote_decode": True},
                                  status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=64)  # fmt: skip
        delay, params = scheduler.request_finished(request, (blocks,))  # type: ignore[arg-type]
        assert delay and params is not None
        return params

    def abandoned() -> dict[str, str]:
        meta = scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))  # type: ignore[arg-type]
        return meta.send_abandoned

    try:
        scheduler._refresh_address()
        deadline = time.monotonic() + 10
        while scheduler._address is None:  # the sidecar's peer address, returned to routers
            assert time.monotonic() < deadline, "the shim never learned its sidecar's address"
            time.sleep(0.05)
        first = finish("r1", [3, 4])  # no key yet: offered unvouched (consumers confirm with P's sidecar)
        assert PARAM_VOUCHER not in first and held_until_ms[0] == 0
        key = submitted[0].result(timeout=10).voucher_key
        deadline = time.monotonic() + 10
        while scheduler.sender._voucher_terms[0] != key:  # set by the answer's callback thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # Blocks past the engine's 64: the sidecar refuses this submission, after the shim signed it.
        second = finish("r2", [100, 101])
        until_ms = second[PARAM_VOUCHED_UNTIL_MS]
        assert held_until_ms[1] == until_ms  # the sidecar is told to hold them as long
        assert voucher.verify(key, bytes.fromhex(second[PARAM_VOUCHER]), "decode-0", "r2", [[100, 101]], until_ms)
        offered = time.monotonic()
        assert submitted[1].exception(timeout=10) is not None  # INVALID_ARGUMENT from the real sidecar
        assert abandoned() == {}  # a consumer may be reading them on the voucher
        assert scheduler.has_pending_push_work()  # the engine keeps stepping to deliver it later
        while "r2" not in (gone := abandoned()):
            assert time.monotonic() - offered < 10
            time.sleep(0.05)
        assert time.monotonic() - offered >= 2.5 - 0.1  # voucher (2 s) + skew (0.5 s), less the call's age
        assert "block_ids" in gone["r2"], gone
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("when", ["prefix_hit_after_the_submission", "aborted_before_the_submission"])
def test_a_push_consumer_that_fetches_nothing_frees_the_producers_blocks(
    sidecars: Any, engines: Any, when: str
) -> None:
    """D's shim in push mode fetches nothing for a request: its prompt is all in D's prefix cache
    (after P submitted), or the request is aborted before it was scheduled (during P's prefill, both
    legs dispatched at once). P's engine must get its blocks back then, not when its lease (60 s
    here) runs out. Real sidecars; a simulated engine stands for P and registers D's engine id."""
    p_side = sidecars("p", args=["--lease-seconds", "60"])
    d_side = sidecars("d")
    producer = engines(p_side, "prefill-0", "producer", blocks=64, block_size=32)
    engines(d_side, "decode-0", "consumer", blocks=64, block_size=32)
    kv_cache_config = SimpleNamespace(transfer_group_ids=(0,), kv_cache_groups=[object()])
    config = ShimConfig(sidecar_socket=str(d_side.socket), rpc_timeout=5.0)
    scheduler = SchedulerSide(vllm_config(kv_role="kv_consumer"), kv_cache_config, config)  # type: ignore[arg-type]
    host, _, port = producer.peer_address.rpartition(":")
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": producer.engine_id,
              "remote_host": host, "remote_port": int(port), "tp_size": 1, "transfer_mode": "push",
              "transfer_id": "t-nothing"}  # fmt: skip
    request = SimpleNamespace(request_id="d-1", kv_transfer_params=params, prompt_token_ids=list(range(64)))

    def submit() -> None:
        reply = producer.command("submit", request_id="p-1", blocks=[[3, 4]], transfer_id="t-nothing", mode=2)
        assert reply["ok"], reply

    try:
        if when == "prefix_hit_after_the_submission":
            submit()
            assert scheduler.get_num_new_matched_tokens(request, 64) == (0, False)  # type: ignore[arg-type]
            no_blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: ([],))
            scheduler.update_state_after_alloc(request, no_blocks, 0)  # type: ignore[arg-type]
        else:
            assert scheduler.request_finished(request, ([],)) == (False, None)  # type: ignore[arg-type]
            time.sleep(0.5)  # P's prefill ends after D's abort reached its sidecar
            submit()
        event = producer.wait_event("p-1", 10)[0]
        assert event["event"] == "FINISHED_SENDING", event
    finally:
        scheduler.shutdown()
