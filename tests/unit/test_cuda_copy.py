"""The CUDA copy API of ``sidecar.dataplane.cuda_ipc``: coalescing, the batch call's arguments,
one launch per batch (or one per run on an old driver), completion and its bound, pinned host
memory. Pure parts directly; the rest on ``FakeCudaDriver`` (no GPU here; ``tests/daemon/test_gpu.py``
drives the real driver on one)."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator

import numpy as np
import pytest

from sidecar.dataplane import cuda_ipc
from sidecar.dataplane.cuda_ipc import MemcpyAttributes, coalesce, pack_batch
from sidecar.errors import DeadlineExceeded, FailedPrecondition
from tests.support.fake_cuda import FakeCudaDriver


@pytest.fixture
def fake() -> Iterator[FakeCudaDriver]:
    with FakeCudaDriver() as driver:
        yield driver


def test_coalesce_merges_runs_contiguous_on_both_sides_and_drops_empty_copies() -> None:
    copies = [(1000, 5000, 100), (1100, 5100, 50), (0, 9000, 10), (1150, 7000, 20), (2000, 3000, 0)]
    assert coalesce(copies).tolist() == [[0, 9000, 10], [1000, 5000, 150], [1150, 7000, 20]]


def test_coalesce_keeps_copies_contiguous_on_one_side_only_apart() -> None:
    # The destinations follow each other but the sources do not (a layout conversion's runs).
    assert coalesce([(0, 100, 10), (10, 200, 10)]).tolist() == [[0, 100, 10], [10, 200, 10]]
    assert coalesce([]).tolist() == []


def test_the_batch_call_gets_three_contiguous_uint64_arrays_and_one_stream_ordered_attribute() -> None:
    args = pack_batch([(1 << 40, 2 << 40, 4096), (3, 4, 5)])
    assert args.count == 2
    for array, expected in ((args.dsts, [1 << 40, 3]), (args.srcs, [2 << 40, 4]), (args.sizes, [4096, 5])):
        assert array.dtype == np.uint64 and array.flags["C_CONTIGUOUS"] and array.tolist() == expected
    assert args.attrs.srcAccessOrder == 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    assert args.attrs.srcLocHint.type == 0 and args.attrs.dstLocHint.type == 0 and args.attrs.flags == 0
    assert args.attrs_idxs.tolist() == [0]  # the one entry applies from copy 0 on


def test_copy_attributes_have_cudas_layout() -> None:
    # CUmemcpyAttributes: enum (4) + CUmemLocation (8) + CUmemLocation (8) + unsigned int (4).
    assert ctypes.sizeof(MemcpyAttributes) == 24
    assert MemcpyAttributes.srcLocHint.offset == 4 and MemcpyAttributes.flags.offset == 20


def test_a_gpu_uuid_is_spelled_as_nvidia_smi_does() -> None:
    assert cuda_ipc.format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_one_batch_copy_is_one_launch_and_moves_every_byte(fake: FakeCudaDriver) -> None:
    source, dest = fake.allocate(1 << 16), fake.allocate(1 << 16)
    source.array[:] = np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)
    blocks = [(dest.pointer + i * 4096, source.pointer + (15 - i) * 4096, 4096) for i in range(16)]
    pending = cuda_ipc.batch_copy(0, blocks)
    cuda_ipc.wait_copy(pending, 1.0)
    assert fake.batch_launches == [1] and pending.launches == 1 and pending.runs == 16
    for i in range(16):
        assert np.array_equal(dest.view(i * 4096, 4096), source.view((15 - i) * 4096, 4096))
    assert cuda_ipc.copy_done(pending) and fake.destroyed_events == 1


def test_without_the_batch_call_each_coalesced_run_is_one_launch(fake: FakeCudaDriver) -> None:
    fake.has_batch = False
    source, dest = fake.allocate(8192), fake.allocate(8192)
    source.array[:] = 7
    # Four copies, two runs (the first three continue each other on both sides).
    copies = [(dest.pointer, source.pointer, 1024), (dest.pointer + 1024, source.pointer + 1024, 1024)]
    copies += [(dest.pointer + 2048, source.pointer + 2048, 1024), (dest.pointer + 4096, source.pointer, 10)]
    cuda_ipc.wait_copy(cuda_ipc.batch_copy(0, copies), 1.0)
    assert fake.batch_launches == [2]
    assert dest.view(0, 3072).min() == 7 and dest.view(4096, 10).min() == 7 and dest.view(3072, 1024).max() == 0


def test_a_copy_that_never_completes_fails_at_its_bound(fake: FakeCudaDriver) -> None:
    source, dest = fake.allocate(4096), fake.allocate(4096)
    fake.hang = True
    pending = cuda_ipc.batch_copy(0, [(dest.pointer, source.pointer, 4096)])
    assert not cuda_ipc.copy_done(pending)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="device copy of 4096 bytes"):
        cuda_ipc.wait_copy(pending, 0.05)
    assert 0.05 <= time.monotonic() - started < 5
    with pytest.raises(DeadlineExceeded):  # never reported done later
        cuda_ipc.copy_done(pending)


def test_a_copy_into_freed_memory_fails_with_the_drivers_error(fake: FakeCudaDriver) -> None:
    source, dest = fake.allocate(4096), fake.allocate(4096)
    fake.free(dest)
    pending = cuda_ipc.batch_copy(0, [(dest.pointer, source.pointer, 4096)])
    with pytest.raises(FailedPrecondition, match="illegal memory access"):
        cuda_ipc.wait_copy(pending, 1.0)


def test_one_stream_per_device_is_made_once(fake: FakeCudaDriver) -> None:
    fake.devices = 2
    source = fake.allocate(64)
    for device in (0, 1, 0, 1):
        cuda_ipc.wait_copy(cuda_ipc.batch_copy(device, [(source.pointer + 32, source.pointer, 32)]), 1.0)
    assert len(fake._streams) == 2


def test_pinned_host_memory_is_allocated_and_freed(fake: FakeCudaDriver) -> None:
    pointer = cuda_ipc.host_alloc(1 << 20)
    assert pointer
    cuda_ipc.host_free(pointer)
    with pytest.raises(FailedPrecondition):
        cuda_ipc.host_free(pointer)


def test_a_device_is_found_by_its_uuid(fake: FakeCudaDriver) -> None:
    fake.devices = 3
    assert cuda_ipc.device_for_uuid(cuda_ipc.device_uuid(2)) == 2
    assert cuda_ipc.device_for_uuid("GPU-00000000-0000-0000-0000-000000000000") is None
