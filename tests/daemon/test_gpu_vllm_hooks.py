"""The vLLM shim's GPU KV path on a real GPU: KV caches in vLLM 0.32's shapes, allocated, described
and exported by the shim's own code, registered with real sidecar daemons, moved P -> D and checked
byte for byte.

vLLM itself is not on the GPU machine (too large to carry without a registry), so the harness does
what the connector's hooks do with vLLM's tensors, through the same functions
(``tests/support/vllm_shaped_worker.py``): ``get_mem_pool_context()`` is ``kv_cuda.CudaKvAllocation``
around vLLM's one ``torch.zeros(n, int8, device=cuda)``; vLLM's per-layer views come from
``tests/support/vllm_kv_views.py`` (checked against vLLM's ``allocate_kv_cache`` for every layout by
``tests/daemon/test_vllm_gpu_kv.py``); ``register_kv_caches`` is ``kv_layout.describe_caches`` with
``cuda_memory.export_cuda_storage`` (the worker passes ``kv_memory.export_storage``, which exports a
CUDA storage the same way) and the geometry ``WorkerSide`` states. Where vLLM is importable, the
connector's hooks themselves run with CUDA tensors in ``test_the_connectors_hooks_on_a_gpu``. The
same cases run on host memory in ``tests/daemon/test_vllm_gpu_kv.py`` (no GPU needed).

Skipped, with the reason, where PyTorch sees no CUDA GPU. Run on a GPU machine with
``pytest tests/daemon/test_gpu_vllm_hooks.py`` (beside ``tests/daemon/test_gpu.py`` in ``bench/gpu_run.sh``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_shim.cuda_memory import cuda_available
from kvsidecar.v1 import common_pb2
from tests.support.vllm_shaped_worker import CASES, VllmShapedWorker, move

NO_GPU = cuda_available()
pytestmark = pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU: {NO_GPU}")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", list(CASES))
def test_kv_in_vllms_gpu_layouts_moves_intact(sidecars, case: str) -> None:
    p_layout, d_layout, heads, head_size, mla, mode = CASES[case]
    p_side, d_side = sidecars("p"), sidecars("d")
    producer = VllmShapedWorker(p_side, "P", common_pb2.ENGINE_ROLE_PRODUCER, p_layout, heads, head_size, mla)
    consumer = VllmShapedWorker(d_side, "D", common_pb2.ENGINE_ROLE_CONSUMER, d_layout, heads, head_size, mla)
    try:
        assert producer.described.exports[0].kind == common_pb2.MEMORY_KIND_VRAM
        for serial in range(2):
            move(producer, consumer, mode, f"{case}-{serial}")
    finally:
        producer.close()
        consumer.close()


_ACCOUNTING = r"""
import json, torch
from engine_shim.cuda_memory import export_cuda_storage
from engine_shim.vllm.kv_cuda import EXPANDABLE, CudaKvAllocation, allocator_conf, conf_flag
SIZE = 48 << 20
torch.zeros(1, device="cuda")  # the CUDA context first: its memory is not the KV cache's
torch.cuda.synchronize()
allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
free = torch.cuda.mem_get_info()[0]
hook = CudaKvAllocation({SIZE})
with hook:
    kv = torch.zeros(SIZE, dtype=torch.int8, device=torch.device("cuda", 0))
torch.cuda.synchronize()
report = {
    "allocated": torch.cuda.memory_allocated() - allocated,
    "reserved": torch.cuda.memory_reserved() - reserved,
    "free_drop": free - torch.cuda.mem_get_info()[0],
    "held": hook.holds(kv.untyped_storage()),
    "export_length": export_cuda_storage(kv.untyped_storage()).length,
    "expandable_after": conf_flag(allocator_conf(), EXPANDABLE),
}
plain = torch.zeros(SIZE, dtype=torch.int8, device="cuda")  # vLLM's call without the hook
try:
    export_cuda_storage(plain.untyped_storage())
    report["plain"] = "exported"
except Exception as exc:
    report["plain"] = str(exc)
print(json.dumps(report))
"""


def test_the_hook_allocates_an_exportable_kv_cache_that_pytorch_counts() -> None:
    """With ``expandable_segments:True`` (where vLLM's own allocation cannot be exported), the
    hook's KV cache exports over CUDA IPC, PyTorch counts exactly its bytes (what vLLM's memory
    accounting reads), and the allocator setting is back on afterwards."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _ACCOUNTING], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    size = 48 << 20
    assert report["allocated"] == size, report
    assert size <= report["reserved"] < size + (2 << 20), report
    assert report["free_drop"] >= size, report
    assert report["held"] and report["export_length"] == size, report
    assert report["expandable_after"], report
    # vLLM's allocation without the hook sits in an expandable segment: not exportable (what the hook avoids).
    assert report["plain"] != "exported", report


def test_the_connectors_hooks_on_a_gpu(sidecars, tmp_path: Path) -> None:
    """Where vLLM is installed on the GPU machine: the real connector's get_mem_pool_context and
    register_kv_caches with vLLM's own allocate_kv_cache on the GPU, registered with a sidecar."""
    pytest.importorskip("vllm", reason="vLLM is not installed on this GPU machine")
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from engine_shim.vllm.connector import SidecarConnector
    from tests.daemon.test_vllm_gpu_kv import kv_config, mla_config

    side = sidecars("p")
    config = mla_config(tmp_path)
    config.kv_transfer_config.kv_connector_extra_config["sidecar_socket"] = str(side.socket)
    config.model_config.use_mla = False
    config.model_config.get_num_kv_heads = lambda parallel: 2
    config.model_config.get_total_num_kv_heads = lambda: 2
    config.model_config.get_head_size = lambda: 64
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv = kv_config(spec, KVCacheLayout.LBHNC)
    connector = SidecarConnector(config, KVConnectorRole.WORKER, kv)
    try:
        with connector.get_mem_pool_context():  # type: ignore[union-attr]
            caches = allocate_kv_cache(kv, torch.device("cuda", 0), KVCacheLayout.LBHNC)
        connector.register_kv_caches(caches)
        worker = connector.worker_side
        assert worker is not None and worker._watcher is not None, "not registered with the sidecar"
        registration = worker._registration
        assert registration is not None and registration.geometry.kv_layout == "HND"
        assert registration.exports[0].kind == common_pb2.MEMORY_KIND_VRAM
    finally:
        connector.shutdown()
