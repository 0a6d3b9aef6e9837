"""vLLM 0.32's per-layer KV cache views, made without vLLM (for the GPU harness, where vLLM is not
installed). ``tests/daemon/test_vllm_gpu_kv.py`` checks them against vLLM's own ``allocate_kv_cache`` for
every layout, so the harness's tensors are the ones a vLLM GPU worker registers.

vLLM (``vllm/v1/kv_cache_interface.py: compute_layout_strides, create_kv_cache_views``): the
backing int8 allocation is viewed as ``[L, B, H, N, C]`` (C in bytes) with strides that follow the
layout's permutation, outermost first, and each layer's ``[B, H, N, C]`` is viewed in the cache dtype.
"""

from __future__ import annotations

from typing import Any

# vllm.v1.kv_cache_layout.KVCacheLayout: logical [L, B, H, N, C] axes in physical order.
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def kv_cache_views(
    raw: Any, layout: str, layers: int, num_blocks: int, heads: int, tokens: int, content_bytes: int, dtype: Any
) -> list[Any]:
    """One ``[num_blocks, heads, tokens, content_bytes / itemsize]`` view per layer of the int8
    tensor ``raw`` (``layers * num_blocks * heads * tokens * content_bytes`` bytes), as vLLM lays
    them out for ``layout`` with unpadded pages."""
    import torch

    shape = (layers, num_blocks, heads, tokens, content_bytes)
    strides = [0] * 5
    current = 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = current
        current *= shape[dim]
    if raw.numel() != current:
        raise ValueError(f"{raw.numel()} bytes do not hold {shape}")
    whole = torch.as_strided(raw, shape, strides, raw.storage_offset())
    return [whole[layer].view(dtype) for layer in range(layers)]
