"""The vLLM connector with a KV cache in GPU memory, on a machine without a GPU.

vLLM 0.32's own code does what a GPU worker does: ``allocate_kv_cache`` (one ``torch.zeros(n, int8,
device=cuda)`` inside the connector's ``get_mem_pool_context()``, then ``create_kv_cache_views`` in
the resolved KV cache layout) and the views go to the connector's ``register_kv_caches``, as
``GPUModelRunner.initialize_kv_cache`` passes them. Only CUDA is faked, and named so:

- ``FakeCudaAllocator`` stands in for the private-pool allocation (``kv_cuda.zeros_in_private_pool``):
  it records what it was asked for and returns host memory;
- ``FakeCudaStorage`` / ``FakeCudaTensor``: vLLM's views over that host memory, reporting a CUDA
  device, whose export (``_share_cuda_``) yields a fake CUDA IPC handle.

The views are real tensors, so the tests check bytes: every (layer, block) the registration
describes is exactly the bytes of that block in the layout it names. The GPU itself is exercised by
``tests/daemon/test_gpu_vllm_hooks.py``. No vLLM engine runs (these are not ``vllm``-marker tests).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from engine_shim.vllm import compat, kv_cuda, worker  # noqa: E402
from engine_shim.vllm.connector import SidecarConnector  # noqa: E402
from engine_shim.vllm.kv_cuda import CudaKvAllocation, with_conf_flag  # noqa: E402
from engine_shim.vllm.kv_layout import KvLayoutError  # noqa: E402
from kvsidecar.v1 import common_pb2  # noqa: E402
from tests.support.tiny_models import build_tiny_llama  # noqa: E402
from tests.support.vllm_kv_views import LAYOUTS, kv_cache_views  # noqa: E402
from tests.support.vllm_shaped_worker import CASES, VllmShapedWorker, move  # noqa: E402

FAKE_HANDLE = bytes(range(64))
SEGMENT_OFFSET = 8192  # where the fake allocation sits inside its (fake) cudaMalloc segment
BLOCKS, LAYERS = 6, 2
DEVICE = torch.device("cuda", 0)


class FakeCudaStorage:
    """Stands in for the CUDA storage of vLLM's KV buffer (host memory underneath); its export
    yields a fake CUDA IPC handle in PyTorch's format (version byte, segment type, 64 bytes)."""

    def __init__(self, host: Any, segment_type: bytes = b"c") -> None:
        self.host = host
        self.segment_type = segment_type
        self.device = DEVICE

    def data_ptr(self) -> int:
        return int(self.host.data_ptr())

    def nbytes(self) -> int:
        return int(self.host.nbytes())

    def _share_cuda_(self) -> tuple[Any, ...]:
        handle = b"\x02" + self.segment_type + FAKE_HANDLE
        return (0, handle, self.nbytes() + SEGMENT_OFFSET, SEGMENT_OFFSET, b"", 0, b"", False)


class FakeCudaTensor:
    """A KV cache view reporting a CUDA device: shape, strides and offset of a real (host) view."""

    is_cuda = True
    device = DEVICE

    def __init__(self, view: Any, storage: FakeCudaStorage) -> None:
        self.view = view
        self.storage = storage
        self.shape = view.shape
        self.dtype = view.dtype

    def stride(self) -> Any:
        return self.view.stride()

    def storage_offset(self) -> int:
        return int(self.view.storage_offset())

    def element_size(self) -> int:
        return int(self.view.element_size())

    def dim(self) -> int:
        return int(self.view.dim())

    def untyped_storage(self) -> FakeCudaStorage:
        return self.storage


class FakeCudaAllocator:
    """Stands in for ``zeros_in_private_pool``: records each (size, device) and hands out zeroed
    host memory in its place."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.device]] = []
        self.memory: Any = None

    def __call__(self, size: int, device: torch.device) -> tuple[Any, Any]:
        self.calls.append((size, device))
        self.memory = torch.zeros(size, dtype=torch.int8)
        return self.memory, "fake-pool"


@pytest.fixture(scope="module")
def real_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real VllmConfig (tiny Llama: 2 KV heads of 32, float16, block size 32) with this connector."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    transfer = KVTransferConfig(
        kv_connector="SidecarConnector",
        kv_connector_module_path="engine_shim.vllm.connector",
        kv_role="kv_both",
        engine_id="gpu-engine",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"sidecar_socket": str(tmp_path_factory.mktemp("run") / "no-sidecar.sock")},
    )
    args = EngineArgs(
        model=str(model), dtype="float16", block_size=32, max_model_len=1024, enforce_eager=True,
        kv_transfer_config=transfer,
    )  # fmt: skip
    return args.create_engine_config()


@pytest.fixture
def on_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudaAllocator]:
    """The worker believes it runs on a CUDA platform; its allocations go to a FakeCudaAllocator."""
    monkeypatch.setattr(compat, "is_cpu", lambda config: False)
    monkeypatch.setattr(worker, "is_cpu", lambda config: False)
    allocator = FakeCudaAllocator()
    monkeypatch.setattr(kv_cuda, "zeros_in_private_pool", allocator)
    yield allocator


def kv_config(spec: Any, layout: KVCacheLayout, num_blocks: int = BLOCKS) -> KVCacheConfig:
    """Two layers of ``spec`` placed as vLLM's ``get_kv_cache_config_from_groups`` places them."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, LAYERS, layout)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * spec.page_size_bytes * LAYERS,
                layers=layers,
                layer_stride=layer_stride,
                block_stride=block_stride,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)],
        kv_cache_layout=layout.name,
    )


def register(connector: SidecarConnector, config: KVCacheConfig, layout: KVCacheLayout, segment: bytes = b"c") -> Any:
    """What vLLM's GPU worker does with the connector: allocate inside its context, register the
    views. Returns the views (real, over the host memory standing in for the GPU)."""
    context = connector.get_mem_pool_context()
    assert isinstance(context, CudaKvAllocation)
    with context:
        views = allocate_kv_cache(config, DEVICE, layout)
    raw = next(iter(views.values()))
    storage = FakeCudaStorage(raw.untyped_storage(), segment)
    connector.register_kv_caches({name: FakeCudaTensor(view, storage) for name, view in views.items()})  # type: ignore[misc]
    return views


def gpu_connector(vllm_config: Any, config: KVCacheConfig) -> SidecarConnector:
    return SidecarConnector(vllm_config, KVConnectorRole.WORKER, config)


def check_blocks_described(registration: Any, views: dict[str, Any], kind: str) -> None:
    """Every (layer, block) the registration describes holds exactly that block of the view, in
    the order the layout name says (HND: heads, tokens, C; NHD: tokens, heads, C)."""
    raw = next(iter(views.values())).untyped_storage()
    memory = torch.empty(0, dtype=torch.uint8).set_(raw)  # the whole allocation, as bytes
    torch.manual_seed(0)
    memory.copy_(torch.randint(0, 256, memory.shape, dtype=torch.uint8))
    (export,) = registration.exports
    for region in registration.regions:
        view = views[region.name]
        for block in range(registration.geometry.num_blocks):
            start = region.offset + block * region.block_stride
            described = memory[start : start + region.block_len]
            expected = view[block] if kind == "HND" else view[block].transpose(0, 1)
            assert torch.equal(described, expected.contiguous().view(torch.uint8).flatten()), (region.name, block)
    assert export.length == memory.numel()


# (vLLM layout, the backends that take it, what the sidecar is told, block stride in pages)
GPU_LAYOUTS = [
    (KVCacheLayout.LBHNC, "FlashInfer (HND; SM100's only), FlashAttention", "HND", 1),
    (KVCacheLayout.LBNHC, "FlashAttention (NHD, vLLM's default)", "NHD", 1),
    (KVCacheLayout.BLHNC, "FlashInfer on SM100, layers interleaved per block", "HND", LAYERS),
    (KVCacheLayout.BLNHC, "FlashAttention, layers interleaved per block", "NHD", LAYERS),
]


@pytest.mark.parametrize(("layout", "backends", "kind", "pages"), GPU_LAYOUTS, ids=[c[0].name for c in GPU_LAYOUTS])
def test_a_gpu_kv_cache_is_allocated_exportable_and_described_in_its_layout(
    real_config: Any, on_gpu: FakeCudaAllocator, layout: KVCacheLayout, backends: str, kind: str, pages: int
) -> None:
    """vLLM's one KV allocation goes through the hook, once, at the announced size on the device
    vLLM named (nothing else, so vLLM's memory accounting sees what it asked for); the storage is
    exported over CUDA IPC; each layer is one region whose blocks are exactly vLLM's blocks."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float16)
    config = kv_config(spec, layout)
    connector = gpu_connector(real_config, config)
    try:
        views = register(connector, config, layout)
        registration = connector.worker_side._registration  # type: ignore[union-attr]
    finally:
        connector.shutdown()
    (size,) = {tensor.size for tensor in config.kv_cache_tensors}
    assert on_gpu.calls == [(size, DEVICE)]
    assert registration is not None
    (export,) = registration.exports
    assert export.kind == common_pb2.MEMORY_KIND_VRAM and export.cuda_ipc_handle == FAKE_HANDLE
    assert (export.offset, export.length, export.device_id) == (SEGMENT_OFFSET, size, 0)
    geometry = registration.geometry
    assert geometry.kv_layout == kind, backends
    assert (geometry.num_blocks, geometry.num_kv_heads, geometry.head_size, geometry.dtype) == (
        BLOCKS,
        2,
        32,
        "float16",
    )
    assert not geometry.is_mla and dict(registration.compat_factors)["device"] == "gpu"
    page = spec.page_size_bytes
    assert [region.name for region in registration.regions] == list(views)
    assert {(region.block_len, region.block_stride) for region in registration.regions} == {(page, pages * page)}
    check_blocks_described(registration, views, kind)


def test_mla_latent_cache_is_one_head_per_block(on_gpu: FakeCudaAllocator, tmp_path: Path) -> None:
    """MLA's single latent tensor ([B, 1, N, latent]) is described as one head: HND, is_mla."""
    spec = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=96, dtype=torch.bfloat16)
    layout = KVCacheLayout.LBNHC  # what vLLM resolves for MLA (the connector asks for no layout)
    config = kv_config(spec, layout)
    connector = gpu_connector(mla_config(tmp_path), config)
    try:
        views = register(connector, config, layout)
        registration = connector.worker_side._registration  # type: ignore[union-attr]
    finally:
        connector.shutdown()
    assert SidecarConnector.get_required_kvcache_layout(mla_config(tmp_path)) is None
    assert registration is not None and registration.geometry.is_mla
    assert registration.geometry.kv_layout == "HND"
    assert {region.block_len for region in registration.regions} == {32 * 96 * 2}
    check_blocks_described(registration, views, "HND")


@pytest.mark.parametrize("layout", [KVCacheLayout.LHBNC, KVCacheLayout.BHLNC], ids=lambda layout: layout.name)
def test_a_layout_whose_blocks_are_not_contiguous_is_refused_with_the_reason(
    real_config: Any, on_gpu: FakeCudaAllocator, layout: KVCacheLayout
) -> None:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float16)
    config = kv_config(spec, layout)
    connector = gpu_connector(real_config, config)
    try:
        with pytest.raises(KvLayoutError) as refused:
            register(connector, config, layout)
        assert connector.worker_side._registration is None  # type: ignore[union-attr]
    finally:
        connector.shutdown()
    message = str(refused.value)
    assert "model.layers.0.self_attn.attn" in message and "attention backend" in message
    assert "shape (6, 2, 32, 64)" in message and "LHBNC or BHLNC" in message, message
    assert "VLLM_KV_CACHE_LAYOUT=LBHNC" in message


def test_head_slots_that_are_not_the_workers_kv_heads_are_refused(real_config: Any, on_gpu: FakeCudaAllocator) -> None:
    """A packed page (num_head_slots) cannot be split by head for another TP size: refused."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float16, num_head_slots=4)
    config = kv_config(spec, KVCacheLayout.LBHNC)
    connector = gpu_connector(real_config, config)
    try:
        with pytest.raises(KvLayoutError, match="4 head slots per block, but this worker has 2 KV heads"):
            register(connector, config, KVCacheLayout.LBHNC)
    finally:
        connector.shutdown()


def test_older_vllms_kv_split_shape_is_refused(real_config: Any, on_gpu: FakeCudaAllocator) -> None:
    """FlashAttention's (2, blocks, block_size, heads, head_size) of older vLLM releases: K and V of
    one block are far apart; refused, not registered as two huge "blocks"."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float16)
    config = kv_config(spec, KVCacheLayout.LBHNC)
    connector = gpu_connector(real_config, config)
    memory = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
    storage = FakeCudaStorage(memory.untyped_storage())
    per_layer = memory.view(torch.float16).view(LAYERS, 2, BLOCKS, 32, 2, 32)
    caches = {f"model.layers.{i}.self_attn.attn": FakeCudaTensor(per_layer[i], storage) for i in range(LAYERS)}
    try:
        with pytest.raises(KvLayoutError, match="holds 2 blocks, not a multiple of vLLM's 6 blocks"):
            connector.register_kv_caches(caches)  # type: ignore[arg-type]
    finally:
        connector.shutdown()


def test_an_expandable_segment_is_refused_saying_so(real_config: Any, on_gpu: FakeCudaAllocator) -> None:
    """PyTorch's expandable segments cannot be exported over CUDA IPC: the registration says how
    to turn them off instead of handing the sidecar a handle it cannot open."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float16)
    config = kv_config(spec, KVCacheLayout.LBHNC)
    connector = gpu_connector(real_config, config)
    try:
        with pytest.raises(RuntimeError, match=re.escape("expandable_segments:True")):
            register(connector, config, KVCacheLayout.LBHNC, segment=b"e")
    finally:
        connector.shutdown()


def test_the_hook_takes_only_vllms_kv_allocation() -> None:
    """Other sizes, dtypes and devices pass to PyTorch; the KV allocation is taken once."""
    allocator = FakeCudaAllocator()
    hook = CudaKvAllocation({4096}, allocate=allocator)
    with hook:
        other = torch.zeros(4096, dtype=torch.int8)  # host memory: not the GPU KV cache
        wrong_dtype = torch.zeros(1024, dtype=torch.float32)
        kv = torch.zeros(4096, dtype=torch.int8, device=DEVICE)
    assert allocator.calls == [(4096, DEVICE)]
    assert other.device.type == "cpu" and wrong_dtype.dtype == torch.float32
    assert kv is allocator.memory and hook.holds(kv.untyped_storage())
    assert not hook.holds(other.untyped_storage())
    assert (hook.nbytes, hook.device) == (4096, DEVICE)


def test_turning_expandable_segments_off_keeps_the_rest_of_the_allocator_settings() -> None:
    conf = "expandable_segments:True,max_split_size_mb:512,garbage_collection_threshold:0.6"
    assert with_conf_flag(conf, "expandable_segments", False) == (
        "expandable_segments:False,max_split_size_mb:512,garbage_collection_threshold:0.6"
    )
    assert with_conf_flag("max_split_size_mb:512", "expandable_segments", False) == (
        "max_split_size_mb:512,expandable_segments:False"
    )


def test_memory_export_settings_on_a_gpu(
    real_config: Any, on_gpu: FakeCudaAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "torch_shm" leaves vLLM's allocation alone (no hook; its storage is exported as PyTorch made
    it); "mem_pool" refuses a KV cache the hook did not allocate."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float16)
    config = kv_config(spec, KVCacheLayout.LBHNC)
    extra = real_config.kv_transfer_config.kv_connector_extra_config
    for memory_export, expected in (("torch_shm", None), ("mem_pool", "did not allocate the KV cache")):
        monkeypatch.setitem(extra, "memory_export", memory_export)
        connector = gpu_connector(real_config, config)
        try:
            if memory_export == "torch_shm":
                assert connector.get_mem_pool_context() is None
            views = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)  # as vLLM made it
            storage = FakeCudaStorage(next(iter(views.values())).untyped_storage())
            caches = {name: FakeCudaTensor(view, storage) for name, view in views.items()}
            if expected is None:
                connector.register_kv_caches(caches)  # type: ignore[arg-type]
                registration = connector.worker_side._registration  # type: ignore[union-attr]
                assert registration is not None and registration.exports[0].cuda_ipc_handle == FAKE_HANDLE
            else:
                with pytest.raises(RuntimeError, match=expected):
                    connector.register_kv_caches(caches)  # type: ignore[arg-type]
        finally:
            connector.shutdown()
    assert on_gpu.calls == []


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
@pytest.mark.parametrize("mla", [False, True], ids=["attention", "mla"])
def test_the_gpu_harness_makes_the_views_vllm_makes(layout: KVCacheLayout, mla: bool) -> None:
    """tests/daemon/test_gpu_vllm_hooks.py builds vLLM's views without vLLM (it is not on the GPU
    machine): they must be vLLM 0.32's own, layout by layout."""
    if mla:
        spec: Any = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=96, dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float16)
    config = kv_config(spec, layout)
    theirs = allocate_kv_cache(config, torch.device("cpu"), layout)
    raw = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
    ours = kv_cache_views(
        raw,
        layout.name,
        LAYERS,
        BLOCKS,
        spec.num_kv_heads,
        32,
        spec.page_size_bytes // (32 * spec.num_kv_heads),
        spec.dtype,
    )
    assert LAYOUTS[layout.name] == layout.value
    for view, (name, vllm_view) in zip(ours, theirs.items(), strict=True):
        assert (view.shape, view.stride(), view.storage_offset(), view.dtype) == (
            vllm_view.shape, vllm_view.stride(), vllm_view.storage_offset(), vllm_view.dtype
        ), name  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_vllms_gpu_layouts_move_intact_through_real_sidecars_on_host_memory(sidecars: Any, case: str) -> None:
    """The GPU harness's cases (tests/daemon/test_gpu_vllm_hooks.py) with the KV in shared memory: the
    descriptions (NHD -> HND conversion, interleaved layers' block strides, MLA's one head) move
    every token intact through two real sidecars."""
    p_layout, d_layout, heads, head_size, mla, mode = CASES[case]
    p_side, d_side = sidecars("p"), sidecars("d")
    roles = (common_pb2.ENGINE_ROLE_PRODUCER, common_pb2.ENGINE_ROLE_CONSUMER)
    producer = VllmShapedWorker(p_side, "P", roles[0], p_layout, heads, head_size, mla, memory="shm")
    consumer = VllmShapedWorker(d_side, "D", roles[1], d_layout, heads, head_size, mla, memory="shm")
    try:
        assert (producer.described.kind, consumer.described.kind) == (
            "HND" if mla or p_layout[2] == "H" else "NHD",
            "HND" if mla or d_layout[2] == "H" else "NHD",
        )
        move(producer, consumer, mode, case)
    finally:
        producer.close()
        consumer.close()


def mla_config(tmp_path: Path) -> Any:
    """The fields of a VllmConfig the worker reads, for an MLA model (one latent head of 96)."""
    transfer = SimpleNamespace(
        engine_id="mla-engine", kv_role="kv_both", kv_load_failure_policy="recompute", is_kv_consumer=True,
        kv_connector_extra_config={"sidecar_socket": str(tmp_path / "no-sidecar.sock")},
    )  # fmt: skip
    model = SimpleNamespace(
        model="tiny-mla",
        revision=None,
        dtype=torch.bfloat16,
        use_mla=True,
        get_total_num_kv_heads=lambda: 1,
        get_num_kv_heads=lambda parallel: 1,
        get_head_size=lambda: 96,
        get_total_num_hidden_layers=lambda: LAYERS,
    )
    return SimpleNamespace(
        kv_transfer_config=transfer,
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=model,
        device_config=SimpleNamespace(device_type="cuda"),
    )
