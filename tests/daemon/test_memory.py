"""Registration of exported memory: what is accepted, what is refused and why, and what happens to
the mapping when a worker goes."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from engine_shim.client import SidecarClient
from engine_shim.cuda_memory import cuda_available, ipc_handle
from engine_shim.memory import ORPHAN_AGE_S, KvLayout, SharedBuffer, kv_registration
from engine_shim.simulated import make_buffer
from kvsidecar.shm import remove_if_orphaned
from kvsidecar.v1 import common_pb2, engine_pb2
from sidecar.dataplane.cuda_ipc import handle_struct
from sidecar.dataplane.memory import ExportSpec, MemoryImporter
from sidecar.dataplane.transport import nixl_package
from sidecar.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from tests.support.processes import EngineProcess, wait_until

LAYOUT = KvLayout(num_layers=2, num_blocks=16, block_len=4096)


def mapping_of(address: int) -> str:
    """The /proc/self/maps line covering ``address``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(part, 16) for part in line.split()[0].split("-"))
        if start <= address < end:
            return line
    return ""


def test_release_leaves_an_inaccessible_tombstone_in_place() -> None:
    importer = MemoryImporter([Path("/dev/shm")])
    with SharedBuffer(LAYOUT.total_bytes) as buffer:
        buffer.array[:5] = [1, 2, 3, 4, 5]
        mapped = importer.map(ExportSpec("DRAM", str(buffer.path), b"", 0, LAYOUT.total_bytes, 0), "exports[0]")
        assert bytes(mapped.view()[:5]) == b"\x01\x02\x03\x04\x05"
        assert str(buffer.path) in mapping_of(mapped.address)
        importer.release(mapped)
        line = mapping_of(mapped.address)
        # Still reserved (no other mapping can land there), but no longer the shared file, and
        # neither readable nor writable: a late remote write faults instead of corrupting.
        assert line and "---p" in line.split()[1] and str(buffer.path) not in line
        assert importer.tombstoned_bytes >= LAYOUT.total_bytes


def test_mapping_outside_the_allowed_directories_or_past_the_file_is_refused(tmp_path: Path) -> None:
    importer = MemoryImporter([Path("/dev/shm")])
    outside = tmp_path / "kv.bin"
    outside.write_bytes(b"\0" * 8192)
    with pytest.raises(InvalidArgument, match="outside the allowed shm dirs"):
        importer.map(ExportSpec("DRAM", str(outside), b"", 0, 8192, 0), "exports[0]")
    with pytest.raises(InvalidArgument, match="does not exist"):
        importer.map(ExportSpec("DRAM", "/dev/shm/kvsidecar-no-such-file", b"", 0, 10, 0), "exports[0]")
    with SharedBuffer(8192) as buffer, pytest.raises(InvalidArgument, match="exceeds the size"):
        importer.map(ExportSpec("DRAM", str(buffer.path), b"", 4096, 8192, 0), "exports[0]")


def test_a_file_of_another_user_is_refused_when_the_caller_must_own_it() -> None:
    importer = MemoryImporter([Path("/dev/shm")])
    with SharedBuffer(8192) as buffer:
        spec = ExportSpec("DRAM", str(buffer.path), b"", 0, 8192, 0)
        stranger = os.getuid() + 1
        with pytest.raises(
            PermissionDenied, match=f"belongs to uid {os.getuid()}, not to the caller \\(uid {stranger}\\)"
        ):
            importer.map(spec, "exports[0]", owner_uid=stranger)
        importer.release(importer.map(spec, "exports[0]", owner_uid=os.getuid()))  # its own file maps


@pytest.mark.skipif(cuda_available() is None, reason="a GPU is present here: tests/daemon/test_gpu.py covers VRAM")
def test_vram_without_a_gpu_is_failed_precondition_with_a_clear_message() -> None:
    importer = MemoryImporter([Path("/dev/shm")])
    with pytest.raises(FailedPrecondition, match="GPU"):
        importer.map(ExportSpec("VRAM", "", b"\0" * 64, 0, 1 << 20, 0), "exports[0]")
    with pytest.raises(InvalidArgument, match="must be 64 bytes, got 16"):
        importer.map(ExportSpec("VRAM", "", b"\0" * 16, 0, 1 << 20, 0), "exports[0]")


@pytest.mark.skipif(cuda_available() is None, reason="a GPU is present here: tests/daemon/test_gpu.py covers VRAM")
def test_a_simulated_engine_asked_for_gpu_memory_without_a_gpu_says_why() -> None:
    with pytest.raises(RuntimeError, match="a CUDA KV buffer needs a GPU: "):
        make_buffer("cuda", 4096, populate=False, cuda_device=0)


def test_a_sidecar_checking_integrity_refuses_vram_exports_before_opening_them(sidecars) -> None:
    """Digests read KV from the CPU: a VRAM export under integrity=digest would crash the sidecar
    at the first digest, so it is refused at registration, on any machine."""
    sidecar = sidecars(args=["--integrity", "digest"])
    export = engine_pb2.MemoryExport(kind=common_pb2.MEMORY_KIND_VRAM, cuda_ipc_handle=b"\0" * 64, length=1 << 20)
    with SidecarClient(sidecar.socket) as client, pytest.raises(grpc.RpcError) as error:
        client.register_worker(kv_registration("E", common_pb2.ENGINE_ROLE_PRODUCER, LAYOUT, [export]))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "integrity=digest" in error.value.details() and "integrity=off" in error.value.details()


def test_a_cuda_ipc_handle_reaches_the_driver_with_every_byte() -> None:
    """A handle is passed by value as a 64-byte struct; ctypes copies bytes into a c_char array
    only up to the first NUL, so a handle with zeros in it (they all have) once reached the driver
    truncated: cuIpcOpenMemHandle said 'invalid argument' on an H100."""
    handle = bytes([0, 7, 0, 0, 255, 1, 0, 9] * 8)
    struct = handle_struct(handle)
    assert ctypes.sizeof(struct) == 64 and bytes(struct) == handle
    # Bytes, not chars: a c_char array field takes a bytes value only up to its first NUL.
    ((_name, field_type),) = type(struct)._fields_
    assert field_type._type_ is ctypes.c_ubyte and field_type._length_ == 64


def test_the_ipc_handle_inside_pytorchs_shareable_handle_is_found() -> None:
    raw = bytes(range(64))
    assert ipc_handle(raw) == raw  # older PyTorch: the bare handle
    assert ipc_handle(b"\x02c" + raw) == raw  # version byte, 'c' (cudaMalloc segment), handle
    assert ipc_handle(b"\x03c" + raw) == raw
    with pytest.raises(RuntimeError, match="expandable_segments"):
        ipc_handle(b"\x02e" + raw)
    with pytest.raises(RuntimeError, match="66 bytes in a format not known"):
        ipc_handle(b"\x02x" + raw)


def test_nixl_loads_with_ucxs_memory_type_cache_off_unless_the_operator_set_it() -> None:
    """With the cache on, GPU memory mapped from a second engine's IPC handle read as host memory
    to UCX and its registration failed (H100, docs/bench-history.md "The GPU path")."""
    probe = (
        "import os; from sidecar.dataplane.transport import load_nixl; load_nixl(); "
        "print(os.environ['UCX_MEMTYPE_CACHE'])"
    )
    for preset, expected in ((None, "n"), ("y", "y")):
        env = {k: v for k, v in os.environ.items() if k != "UCX_MEMTYPE_CACHE"}
        if preset is not None:
            env["UCX_MEMTYPE_CACHE"] = preset
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-1] == expected


@pytest.mark.parametrize(
    ("installed", "cuda_major", "chosen"),
    [
        (["nixl_cu12"], 13, "nixl_cu12"),  # the only one installed, whatever the node has
        (["nixl_cu13"], None, "nixl_cu13"),
        (["nixl_cu12", "nixl_cu13"], 13, "nixl_cu13"),  # both: the node's CUDA decides
        (["nixl_cu12", "nixl_cu13"], 12, "nixl_cu12"),
        (["nixl_cu12", "nixl_cu13"], None, "nixl_cu12"),
    ],
)
def test_the_nixl_wheel_matching_the_nodes_cuda_is_used(installed: list[str], cuda_major: int | None, chosen: str):
    assert nixl_package(installed, cuda_major) == chosen


def test_registration_errors_over_grpc(sidecars) -> None:
    sidecar = sidecars()
    with SidecarClient(sidecar.socket) as client, SharedBuffer(LAYOUT.total_bytes) as buffer:
        good = kv_registration("E", common_pb2.ENGINE_ROLE_PRODUCER, LAYOUT, [buffer.export()])

        too_many_blocks = engine_pb2.RegisterWorkerRequest()
        too_many_blocks.CopyFrom(good)
        too_many_blocks.geometry.num_blocks = LAYOUT.num_blocks * 4
        with pytest.raises(grpc.RpcError) as error:
            client.register_worker(too_many_blocks)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "regions[" in error.value.details() and "past the export" in error.value.details()

        vram = engine_pb2.RegisterWorkerRequest()
        vram.CopyFrom(good)
        del vram.exports[:]
        vram.exports.append(
            engine_pb2.MemoryExport(
                kind=common_pb2.MEMORY_KIND_VRAM, cuda_ipc_handle=b"\0" * 64, length=LAYOUT.total_bytes
            )
        )
        with pytest.raises(grpc.RpcError) as error:
            client.register_worker(vram)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "GPU" in error.value.details()

        # The good one registers; the same content again is idempotent; nothing leaked meanwhile.
        first = client.register_worker(good)
        again = client.register_worker(good)
        assert first.agent_name == again.agent_name and first.registered_bytes == LAYOUT.total_bytes
        status = client.status()
        assert [engine.engine_id for engine in status.engines] == ["E"]
        client.unregister_worker("E")
        assert not client.status().engines


def test_a_worker_that_never_watches_is_dropped(sidecars) -> None:
    sidecar = sidecars(args=["--set", "worker_attach_timeout_seconds=0.5"])
    with SidecarClient(sidecar.socket) as client, SharedBuffer(LAYOUT.total_bytes) as buffer:
        client.register_worker(kv_registration("E", common_pb2.ENGINE_ROLE_PRODUCER, LAYOUT, [buffer.export()]))
        wait_until(lambda: not client.status().engines, 5, 0.1, "the unattached worker is dropped")


def test_a_worker_whose_stream_closes_is_dropped(sidecars) -> None:
    sidecar = sidecars()
    with SidecarClient(sidecar.socket) as client, SharedBuffer(LAYOUT.total_bytes) as buffer:
        client.register_worker(kv_registration("E", common_pb2.ENGINE_ROLE_PRODUCER, LAYOUT, [buffer.export()]))
        watcher = client.watch("E")
        watcher.wait_connected(5)
        assert client.status().engines[0].workers[0].watching
        watcher.cancel()
        wait_until(lambda: not client.status().engines, 5, 0.1, "the worker is dropped when its stream ends")


def _creator_process(directory: Path) -> subprocess.Popen[str]:
    """A process that creates a SharedBuffer in ``directory``, prints its path and waits."""
    code = (
        "import sys, time; from pathlib import Path; from engine_shim.memory import SharedBuffer; "
        f"buffer = SharedBuffer(8192, directory=Path({str(directory)!r})); buffer.array[:3] = [7, 8, 9]; "
        "print(buffer.path, flush=True); time.sleep(60)"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_killed_creators_file_is_recognised_as_orphaned(workdir: Path) -> None:
    """The lock tells a live creator's file from one whose creator was killed; the killed one's file
    is removed, and memory mapped from it before stays readable."""
    directory = Path(tempfile.mkdtemp(prefix="kvs-orphans-", dir="/dev/shm"))
    creator = _creator_process(directory)
    try:
        assert creator.stdout is not None
        path = Path(creator.stdout.readline().strip())
        assert path.parent == directory and path.exists()
        assert not remove_if_orphaned(path), "the file of a live creator was taken for an orphan"
        assert path.exists()
        fd = os.open(path, os.O_RDWR)
        mapped = mmap.mmap(fd, 8192)
        os.close(fd)
        creator.kill()
        creator.wait(10)
        assert path.exists(), "nothing removes a killed creator's file by itself"
        assert remove_if_orphaned(path)
        assert not path.exists() and not os.listdir(directory)
        assert mapped[:3] == b"\x07\x08\x09"
        mapped.close()
    finally:
        creator.kill()
        creator.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


def test_the_next_buffer_removes_what_a_killed_process_left_once_it_is_a_minute_old(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A demo or benchmark killed with its sidecars leaves its engines' files; nothing else would
    remove them before a reboot. The next default-named buffer does, but not a live creator's file
    however old, and not a fresh orphan (left to the sidecar that watched its engine die)."""
    directory = Path(tempfile.mkdtemp(prefix="kvs-orphans-", dir="/dev/shm"))
    doomed, alive = _creator_process(directory), _creator_process(directory)
    try:
        assert doomed.stdout is not None and alive.stdout is not None
        orphan, kept = Path(doomed.stdout.readline().strip()), Path(alive.stdout.readline().strip())
        doomed.kill()
        doomed.wait(10)
        with SharedBuffer(8192, directory=directory) as fresh_one:
            assert orphan.exists(), "an orphan younger than a minute was taken from the sidecar"
            assert fresh_one.path.exists()
        old = time.time() - ORPHAN_AGE_S - 5
        for path in (orphan, kept):
            os.utime(path, (old, old))
        with caplog.at_level("WARNING", logger="engine_shim.memory"), SharedBuffer(8192, directory=directory) as buffer:
            assert not orphan.exists(), "a killed process's file stayed"
            assert kept.exists(), "a live creator's file was taken for an orphan"
            assert sorted(directory.iterdir()) == sorted([kept, buffer.path])
        assert any(str(orphan) in record.getMessage() for record in caplog.records), caplog.text
    finally:
        for creator in (doomed, alive):
            creator.kill()
            creator.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


def test_the_sidecar_removes_the_file_of_a_killed_engine_and_keeps_a_live_ones(sidecars, engines) -> None:
    sidecar = sidecars()
    doomed = engines(sidecar, "P", "producer")
    survivor = engines(sidecar, "D", "consumer")

    def files_of(engine: EngineProcess) -> list[Path]:
        return sorted(Path("/dev/shm").glob(f"kvsidecar-{engine.process.pid}-*"))

    assert files_of(doomed) and files_of(survivor)
    kept = files_of(survivor)
    os.kill(doomed.process.pid, signal.SIGKILL)  # no chance to remove its own file
    doomed.process.wait(10)
    wait_until(lambda: not files_of(doomed), 15, 0.1, "the killed engine's shm file is removed")
    # The file goes first, then the line that says so: the line may come a moment later.
    wait_until(
        lambda: any(event.get("event") == "orphaned_shm_file_removed" for event in sidecar.log_events()),
        5,
        0.1,
        "the sidecar logs the removal",
    )
    assert files_of(survivor) == kept
    assert survivor.command("fill", blocks=[1], seed=1)["ok"]  # the live engine is untouched
