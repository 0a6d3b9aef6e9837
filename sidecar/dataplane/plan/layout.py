"""Transfer planning's vocabulary: worker layouts, views, slices, pairings. Pure data, no I/O.

The ``plan`` package decides which worker pairs exchange which byte ranges (pure logic: no I/O,
no NIXL): ``layout`` (these types), ``descriptors`` (views -> NIXL descriptor arrays and
indices), ``tp`` (TP pairings and notification counts), ``compatible`` (can two engines exchange
KV at all), ``blocks`` (block-id checks and prefix trimming). Heterogeneous block-size and layout
conversion plans belong here too.

Vocabulary:
- A *worker layout* is one engine worker's KV regions (one per layer, usually), each holding
  ``num_blocks`` physical blocks of ``block_len`` bytes, ``block_stride`` bytes apart, at a base
  address in the address space of the sidecar that mapped them.
- A *view* of a worker is a descriptor list over every (region, physical block), optionally
  restricted to one slice of each block (``Slice(index, count)``): with a head-major layout one
  block of a worker with TP=1 holds the heads of two TP=2 workers back to back, so a TP=2 worker
  reads or writes half of it. NIXL prepares each view once; a transfer then selects descriptors by
  index, and NIXL merges runs of adjacent descriptors into one (checked by its telemetry).
- The *initiator* posts the transfer (the consumer in pull, the producer in push); the *target*
  is the other side.

Descriptor order is region-major: index = region_index * num_blocks + physical_block.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

# Layouts where a block's bytes are grouped by KV head, so a contiguous byte slice of a block is
# a contiguous range of heads (vLLM forces "HND" for NIXL). The shim names vLLM's CPU backend
# "CPU_<ISA>_LBHNC": head-major too, with an ISA-specific layout inside each head.
HEAD_MAJOR_LAYOUTS = frozenset({"HND", "LBHNC"})


def is_head_major(kv_layout: str) -> bool:
    return kv_layout in HEAD_MAJOR_LAYOUTS or (kv_layout.startswith("CPU_") and kv_layout.endswith("_LBHNC"))


BlockIds = tuple[tuple[int, ...], ...]


class PlanError(ValueError):
    """Two workers cannot exchange KV; the message says why."""


@dataclass(frozen=True)
class RegionLayout:
    name: str
    base: int
    block_len: int
    block_stride: int
    group_id: int


@dataclass(frozen=True)
class WorkerLayout:
    tp_rank: int
    pp_rank: int
    regions: tuple[RegionLayout, ...]
    num_blocks: int
    physical_per_logical: int
    block_size: int
    kv_layout: str
    num_kv_heads: int
    total_num_kv_heads: int
    is_mla: bool
    device_id: int = 0
    head_size: int = 0  # 0: not stated
    dtype: str = ""  # "": not stated

    # Derived once per layout (a layout is immutable; these are read on every request's plan).
    @functools.cached_property
    def num_groups(self) -> int:
        """The KV cache groups its regions hold (1 + the largest group id)."""
        return 1 + max((region.group_id for region in self.regions), default=0)

    @functools.cached_property
    def region_groups(self) -> np.ndarray:
        """Each region's group id, in region order."""
        return np.fromiter((region.group_id for region in self.regions), dtype=np.int64, count=len(self.regions))

    @functools.cached_property
    def region_starts(self) -> np.ndarray:
        """Each region's first descriptor index in a view (``region * num_blocks``), as a column."""
        return (np.arange(len(self.regions), dtype=np.int64) * self.num_blocks)[:, None]


@dataclass(frozen=True)
class Slice:
    """Part ``index`` of ``count`` equal parts of every block."""

    index: int = 0
    count: int = 1


WHOLE = Slice()


@dataclass(frozen=True)
class Pairing:
    """One initiator worker exchanging with one target worker, and the block slices involved."""

    target_rank: int
    initiator_slice: Slice
    target_slice: Slice
