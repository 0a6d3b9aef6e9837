"""A vLLM 0.32 worker's KV cache without vLLM: made, described and registered as the connector's
hooks do, with real sidecars, and a request moved between two of them and checked (used by
``tests/daemon/test_gpu_vllm_hooks.py`` on a GPU and ``tests/daemon/test_vllm_gpu_kv.py`` on host memory).

In GPU memory (``memory="cuda"``), ``get_mem_pool_context()`` is ``kv_cuda.CudaKvAllocation``
around vLLM's one ``torch.zeros(n, int8, device=cuda)`` and the storage is exported with
``cuda_memory.export_cuda_storage``; in host memory (``"shm"``) the same views lie in a
``SharedBuffer``. vLLM's per-layer views come from ``vllm_kv_views`` and ``register_kv_caches`` is
``kv_layout.describe_caches`` with the geometry ``WorkerSide`` states.
"""

from __future__ import annotations

import os
from typing import Any

from engine_shim.client import SidecarClient, remote
from engine_shim.cuda_memory import export_cuda_storage
from engine_shim.memory import SharedBuffer
from kvsidecar.v1 import common_pb2, engine_pb2
from tests.support.processes import SidecarProcess
from tests.support.vllm_kv_views import kv_cache_views

LAYERS, BLOCKS, BLOCK_SIZE = 4, 64, 16


class VllmShapedWorker:
    """One vLLM 0.32 GPU worker's KV cache (``layout``, bfloat16), made, described and registered as
    the connector's hooks do; its event stream watched."""

    def __init__(
        self,
        side: SidecarProcess,
        engine_id: str,
        role: int,
        layout: str,
        heads: int,
        head_size: int,
        mla: bool,
        memory: str = "cuda",
    ) -> None:
        import torch

        from engine_shim.vllm.kv_cuda import CudaKvAllocation
        from engine_shim.vllm.kv_layout import describe_caches

        self.engine_id = engine_id
        self.device = memory
        content = head_size * (1 if mla else 2) * 2  # bytes of one token of one head: K and V (MLA: the latent)
        size = LAYERS * BLOCKS * heads * BLOCK_SIZE * content
        self.buffer: SharedBuffer | None = None
        export: Any = export_cuda_storage
        if memory == "cuda":
            self.hook = CudaKvAllocation({size})
            with self.hook:  # vLLM's allocate_kv_cache inside get_mem_pool_context()
                raw = torch.zeros(size, dtype=torch.int8, device=torch.device("cuda", 0))
        else:
            self.buffer = buffer = SharedBuffer(size)
            raw = torch.from_numpy(buffer.array).view(torch.int8)
            export = lambda storage: buffer.export()  # noqa: E731
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        views = kv_cache_views(raw, layout, LAYERS, BLOCKS, heads, BLOCK_SIZE, content, torch.bfloat16)
        self.views = dict(zip(names, views, strict=True))
        described = describe_caches(
            self.views,
            dict.fromkeys(names, 0),
            export,
            logical_blocks=BLOCKS,
            num_kv_heads=heads,
            is_mla=mla,
            backend="FLASH_ATTN" if layout.endswith("NHC") else "FLASHINFER",
        )
        self.described = described
        registration = engine_pb2.RegisterWorkerRequest(
            engine_id=engine_id,
            role=role,  # type: ignore[arg-type]
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            geometry=common_pb2.KvGeometry(
                block_size=BLOCK_SIZE,
                physical_blocks_per_logical=1,
                kv_layout=described.kind or "",
                num_blocks=described.num_blocks,
                num_kv_heads=heads,
                total_num_kv_heads=heads,
                is_mla=mla,
                head_size=head_size,
                dtype="bfloat16",
            ),
            exports=described.exports,
            regions=described.regions,
            compat_factors={"model": "vllm-shaped", "device": "gpu", "mla": str(mla)},
            engine_version="vllm 0.32.0",
            pid=os.getpid(),
        )
        self.client = SidecarClient(side.socket)
        self.peer_address = self.client.register_worker(registration).peer_address
        self.watcher = self.client.watch(engine_id)
        self.watcher.wait_connected(10)

    def fill(self, blocks: list[int], seed: int) -> None:
        import torch

        generator = torch.Generator(device="cuda" if self.device == "cuda" else "cpu").manual_seed(seed)
        for view in self.views.values():
            for block in blocks:
                bits = view[block].view(torch.int16)
                words = torch.randint(
                    -(2**15), 2**15, bits.shape, dtype=torch.int16, generator=generator, device=bits.device
                )
                bits.copy_(words)
        self._sync()

    def _sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def blocks(self, blocks: list[int]) -> list[Any]:
        """The logical content ([blocks, heads, tokens, C] per layer) of ``blocks``, as 16-bit words."""
        import torch

        self._sync()
        return [view[blocks].view(torch.int16) for view in self.views.values()]

    def outcome(self, request_id: str) -> engine_pb2.Event:
        found = self.watcher.wait_for([request_id], 60)
        assert request_id in found, f"no outcome for {request_id} within 60s"
        return found[request_id]

    def close(self) -> None:
        self.watcher.cancel()
        self.client.close()
        self.views = {}
        if self.buffer is not None:
            self.buffer.close()


def move(producer: VllmShapedWorker, consumer: VllmShapedWorker, mode: str, request: str) -> None:
    """One request of 12 full blocks P -> D; D's blocks must then hold P's, token by token."""
    p_blocks, d_blocks = list(range(3, 15)), list(range(40, 52))
    tokens = len(p_blocks) * BLOCK_SIZE
    producer.fill(p_blocks, seed=len(request))
    if mode == "pull":
        producer.client.submit_blocks(producer.engine_id, request, [p_blocks], num_tokens=tokens)
        target = remote(producer.peer_address, producer.engine_id, request, [p_blocks], num_tokens=tokens)
        consumer.client.pull(consumer.engine_id, f"{request}-d", [d_blocks], target)
    else:
        target = remote(producer.peer_address, producer.engine_id, request)
        consumer.client.expect_push(consumer.engine_id, f"{request}-d", [d_blocks], target)
        producer.client.submit_blocks(
            producer.engine_id, request, [p_blocks], num_tokens=tokens, mode=common_pb2.TRANSFER_MODE_PUSH
        )
    received = consumer.outcome(f"{request}-d")
    assert received.kind == engine_pb2.FINISHED_RECEIVING, received
    assert producer.outcome(request).kind == engine_pb2.FINISHED_SENDING
    import torch

    for layer, (sent, arrived) in enumerate(zip(producer.blocks(p_blocks), consumer.blocks(d_blocks), strict=True)):
        assert torch.equal(sent, arrived), f"layer {layer}: D's blocks differ from P's"


# (P's vLLM layout, D's, heads, head size, MLA, mode): what the description must get right.
CASES = {
    # FlashAttention's NHD (vLLM's default layout) to FlashInfer's HND: the sidecar converts.
    "flashattention-nhd-to-flashinfer-hnd": ("LBNHC", "LBHNC", 4, 64, False, "pull"),
    # FlashInfer on SM100 with layers interleaved per block (block stride = every layer's page).
    "flashinfer-blhnc-to-lbhnc": ("BLHNC", "LBHNC", 4, 64, False, "push"),
    "flashattention-nhd-both": ("LBNHC", "BLNHC", 2, 128, False, "push"),
    # MLA's single latent (kv_lora_rank 512 + rope 64) per token: one head.
    "mla-latent": ("LBNHC", "BLNHC", 1, 576, True, "pull"),
}
