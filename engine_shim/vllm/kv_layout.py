"""How one vLLM worker's KV cache tensors are described to the sidecar: one region per layer (offset,
block length, block stride), the layout inside a block, and one export per storage. It reads shapes
and strides only and exports through the function it is given (no vLLM, no CUDA), so the GPU
harness runs it where vLLM is not installed. Called on vLLM's worker thread by ``WorkerSide``
during ``register_kv_caches``.

What vLLM 0.32 hands a connector (``vllm/v1/kv_cache_interface.py: create_kv_cache_views``): for
every attention backend the same per-layer view ``[B, H, N, C]`` (kernel blocks, KV heads, tokens
per kernel block, C = one token of one head: K then V, ``head_size + head_size_v`` elements; MLA
has one latent "head", C = the latent) over one int8 allocation, with strides set by the resolved
``KVCacheLayout``. The backends read it through those strides: FlashAttention as (B, N, H, D) K
and V (``kv_cache.transpose(1, 2).split(head_size, -1)``: any layout; vLLM prefers LBNHC),
FlashInfer head-major (its trtllm-gen kernels on SM100 accept LBHNC and BLHNC only), MLA with
H = 1. The older per-backend shapes (``(2, B, N, H, D)`` for FlashAttention, ``(B, 2, N, H, D)``
for FlashInfer, 3-D MLA) belong to vLLM releases whose connector API this shim does not speak.

So the description follows the strides, whatever the backend:

=============  ===========================  ==================================  =================
vLLM layout    inside one block             block stride                        described as
=============  ===========================  ==================================  =================
LBHNC          H, N, C dense                one page                            ``HND``
LBNHC          N, H, C dense                one page                            ``NHD``
BLHNC, BLNHC   as above                     every layer's page (interleaved)    ``HND`` / ``NHD``
LHBNC, BHLNC   heads of a block lie apart   -                                   refused
=============  ===========================  ==================================  =================

``HND`` and ``NHD`` are the sidecar's names for a block's interior (``KvGeometry.kv_layout``: heads
x tokens x C, or tokens x heads x C); the region's block stride carries the rest, so an LBHNC and
a BLHNC engine exchange KV with each other. With one head per block (MLA, or one KV head per TP
rank) both orders are the same bytes and the description says ``HND``. Anything else (heads that
are not the worker's KV heads, a block whose bytes are not one dense run) is refused with the
layer, the backend, the shape and the strides, because moving such blocks byte for byte would
corrupt the peer's cache.

A tensor that is not 4-D (a test's hand-made cache, vLLM's CPU layout before 0.32) is accepted as
an opaque block-contiguous slab when every block is one dense run, and named by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvsidecar.v1 import engine_pb2

HEAD_MAJOR = "HND"
TOKEN_MAJOR = "NHD"
SUPPORTED = "vLLM's [blocks, heads, tokens, C] views in layout LBHNC, LBNHC, BLHNC or BLNHC"


class TensorLike(Protocol):
    """What the description reads of a tensor (a torch tensor, a meta tensor, a test's fake)."""

    @property
    def shape(self) -> Any: ...

    def stride(self) -> Any: ...

    def storage_offset(self) -> Any: ...

    def element_size(self) -> int: ...

    def dim(self) -> int: ...

    def untyped_storage(self) -> Any: ...


class KvLayoutError(NotImplementedError):
    """A KV cache tensor this shim cannot describe to the sidecar; the message says why."""


@dataclass(frozen=True)
class LayerKv:
    """One layer's KV as the sidecar addresses it (bytes, relative to the start of its storage)."""

    offset: int
    block_len: int
    block_stride: int
    num_blocks: int
    kind: str | None  # HEAD_MAJOR / TOKEN_MAJOR; None: opaque block-contiguous (named by the caller)


@dataclass
class DescribedKv:
    """A worker's KV caches as a registration lists them."""

    exports: list[engine_pb2.MemoryExport] = field(default_factory=list)
    regions: list[engine_pb2.KvRegion] = field(default_factory=list)
    num_blocks: int = 0
    kind: str | None = None


def describe_caches(
    kv_caches: Mapping[str, TensorLike],
    group_of: Mapping[str, int],
    export: Callable[[Any], engine_pb2.MemoryExport],
    *,
    logical_blocks: int,
    num_kv_heads: int,
    is_mla: bool,
    backend: str,
) -> DescribedKv:
    """The regions of the layers in ``group_of`` (name -> KV cache group index), in ``kv_caches``'
    order, and one export per storage (``export(storage)``); a layer sharing another's KV is listed
    once. Every layer holds the same number of kernel blocks, a multiple of vLLM's
    ``logical_blocks``. ``KvLayoutError`` or ``NotImplementedError`` with the reason when the sidecar cannot
    address them."""
    described = DescribedKv()
    export_of: dict[int, int] = {}
    seen: set[tuple[int, int]] = set()
    kinds: set[str | None] = set()
    for name, tensor in kv_caches.items():
        if name not in group_of:
            continue
        # Described before anything is exported: a layout the sidecar cannot address is refused
        # with the reason before the torch shm fallback would copy the cache.
        layer = describe_layer(name, tensor, num_kv_heads=num_kv_heads, is_mla=is_mla, backend=backend)
        if layer.num_blocks % logical_blocks:
            raise KvLayoutError(
                f"SidecarConnector: the KV cache of {name} holds {layer.num_blocks} blocks, not a multiple of "
                f"vLLM's {logical_blocks} blocks (attention backend {backend}, shape {tuple(tensor.shape)})"
            )
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in export_of:
            export_of[key] = len(described.exports)
            described.exports.append(export(storage))
            key = storage.data_ptr()  # the torch shm fallback moves the storage
            export_of[key] = len(described.exports) - 1
        view = (key, layer.offset)
        if view in seen:
            continue  # a layer sharing another layer's KV cache
        seen.add(view)
        if described.num_blocks and layer.num_blocks != described.num_blocks:
            raise NotImplementedError("SidecarConnector needs the same number of blocks in every layer")
        described.num_blocks = layer.num_blocks
        kinds.add(layer.kind)
        described.regions.append(
            engine_pb2.KvRegion(
                name=name,
                export_index=export_of[key],
                offset=layer.offset,
                block_len=layer.block_len,
                block_stride=layer.block_stride,
                group_id=group_of[name],
            )
        )
    if not described.regions:
        raise RuntimeError("SidecarConnector: vLLM registered no transferable KV cache layers")
    if len(kinds) > 1:
        raise NotImplementedError(
            f"SidecarConnector: the layers' KV caches are laid out differently ({sorted(map(str, kinds))}, "
            f"attention backend {backend})"
        )
    (described.kind,) = kinds
    return described


def describe_layer(name: str, tensor: TensorLike, *, num_kv_heads: int, is_mla: bool, backend: str) -> LayerKv:
    """The region of one layer's KV cache tensor; ``KvLayoutError`` with the reason if there is none."""
    shape = tuple(int(size) for size in tensor.shape)
    strides = tuple(int(stride) for stride in tensor.stride())
    element = int(tensor.element_size())

    def refuse(reason: str) -> KvLayoutError:
        return KvLayoutError(
            f"SidecarConnector cannot describe the KV cache of {name} (attention backend {backend}): shape "
            f"{shape}, strides {strides} (elements of {element} bytes): {reason}. Supported: {SUPPORTED} "
            "(set VLLM_KV_CACHE_LAYOUT=LBHNC if another layout was forced)"
        )

    if len(shape) < 2 or shape[0] < 1:
        raise refuse("not a tensor of blocks")
    offset = int(tensor.storage_offset()) * element
    block_stride = strides[0] * element
    if len(shape) != 4:
        if not _dense(shape[1:], strides[1:]):
            raise refuse("a block's bytes are not one dense run")
        return LayerKv(offset, _product(shape[1:]) * element, block_stride, shape[0], None)
    _, heads, tokens, chunk = shape
    expected = 1 if is_mla else num_kv_heads
    if heads != expected:
        raise refuse(f"{heads} head slots per block, but this worker has {expected} KV heads")
    head_major = _dense((heads, tokens, chunk), strides[1:])
    token_major = _dense((tokens, heads, chunk), (strides[2], strides[1], strides[3]))
    if not (head_major or token_major):
        raise refuse("a block's heads and tokens are not one dense run (layout LHBNC or BHLNC)")
    block_len = heads * tokens * chunk * element
    if block_stride < block_len:
        raise refuse(f"blocks overlap ({block_stride}-byte stride, {block_len}-byte blocks)")
    return LayerKv(offset, block_len, block_stride, shape[0], HEAD_MAJOR if head_major else TOKEN_MAJOR)


def _dense(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True if dims of ``sizes`` (outermost first) with ``strides`` cover one dense run in row-major
    order. Dims of size 1 are skipped: their stride is never used (vLLM leaves it arbitrary)."""
    expected = 1
    for size, stride in reversed(tuple(zip(sizes, strides, strict=True))):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _product(sizes: tuple[int, ...]) -> int:
    result = 1
    for size in sizes:
        result *= size
    return result
