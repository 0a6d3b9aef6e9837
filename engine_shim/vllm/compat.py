"""What this vLLM engine is, as the sidecar needs to know it: versions, ranks, the KV layout the
worker really has, and the compatibility factors whose hash must match between two engines
before their KV blocks are exchanged.

Pure reads of vLLM's configuration (and of vLLM's process-wide parallel state); no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

CONNECTOR_VERSION = "1"
# The layout the connector asks vLLM for (block-contiguous per layer, so one block of one layer is
# one NIXL descriptor); vLLM's CPU backend reports it under this name.
REQUIRED_LAYOUT = "LBHNC"


def vllm_version() -> str:
    try:
        from vllm import __version__

        return str(__version__)
    except Exception:
        return "unknown"


def is_cpu(vllm_config: VllmConfig) -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.device_type == "cpu")
    except Exception:
        return str(getattr(vllm_config.device_config, "device_type", "")) == "cpu"


def parallel_ranks(vllm_config: VllmConfig) -> tuple[int, int, int, int]:
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


def data_parallel_rank(vllm_config: VllmConfig) -> int:
    """This engine's data-parallel rank (0 where the config has none)."""
    return int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)


def attention_backends(vllm_config: VllmConfig) -> str:
    """The names of the worker's attention backends (for the compatibility factors and errors)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        return ",".join(sorted({backend.get_name() for backend in get_current_attn_backends(vllm_config)}))
    except Exception:
        return "unknown"


def compat_factors(vllm_config: VllmConfig) -> dict[str, str]:
    """What decides whether two engines' KV blocks are interchangeable byte for byte.

    Like vLLM's NIXL compatibility hash, TP size and block size are left out (the sidecar checks
    them per transfer); the transfer mode too, because one sidecar serves both flows; and the KV
    layout, which travels in the worker's geometry (``kv_layout_of``) and is checked per transfer,
    so that the sidecar can convert between layouts without the hash refusing the peer first."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    factors = {
        "connector": f"SidecarConnector/{CONNECTOR_VERSION}",
        "engine": f"vllm {vllm_version()}",
        "model": str(model.model),
        "revision": str(model.revision or ""),
        "dtype": str(model.dtype),
        "num_kv_heads": str(model.get_total_num_kv_heads()),
        "head_size": str(model.get_head_size()),
        "num_layers": str(model.get_total_num_hidden_layers()),
        "attention_backend": attention_backends(vllm_config),
        "cache_dtype": str(cache.cache_dtype),
        "device": "cpu" if is_cpu(vllm_config) else "gpu",
    }
    if factors["device"] == "cpu":
        # The CPU attention kernels' block-internal layout depends on the ISA (AVX-512 vs AMX).
        factors["cpu_isa"] = str(torch.backends.cpu.get_cpu_capability())
    return factors


def kv_layout_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """The layout of the KV cache this worker was given: what the engine core resolved and every
    worker adopted (``kv_cache_config.kv_cache_layout``); an older vLLM that does not say used the
    layout this connector requires. Sent in the worker's geometry, where the sidecar plans and
    converts per transfer; it is not a compatibility factor. On a GPU the worker names vLLM 0.32's
    [B, H, N, C] views by what their strides show instead (``kv_layout``: HND or NHD), and uses
    this name only for a cache that is not such a view.

    vLLM's CPU attention lays out each (block, head) by its ISA (with "vec", K is stored
    transposed, [head_size, tokens], then V as [tokens, head_size]): heads are contiguous, but it
    is not LBHNC token by token, so it is named "CPU_<ISA>_LBHNC". The sidecar treats every such
    name as head-major (TP slices) and converts block sizes of "CPU_VEC_LBHNC" only."""
    if not is_cpu(vllm_config):
        return str(getattr(kv_cache_config, "kv_cache_layout", None) or REQUIRED_LAYOUT)
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model, cache = vllm_config.model_config, vllm_config.cache_config
        if not isinstance(model.dtype, torch.dtype):
            raise TypeError(f"unresolved model dtype {model.dtype!r}")
        isa = _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    except Exception:
        isa = "unknown"
    return f"CPU_{str(isa).upper()}_LBHNC"


def cache_dtype(vllm_config: VllmConfig) -> str:
    """The KV cache's element type as the worker states it in its geometry."""
    dtype = str(vllm_config.cache_config.cache_dtype)
    if dtype != "auto":
        return dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def check_groups(kv_cache_config: KVCacheConfig) -> None:
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
