"""The GPU fault cells' copy hold (``tests/chaos/gpu_hold/sitecustomize.py``) on ``FakeCudaDriver``:
its fallback (hiding a copy's completion, used where the driver refuses stream memory
operations, and here where there is no driver) holds exactly the armed copies, until released,
and the sidecar's ``wait_copy`` bound ends a held one. On a GPU the hold waits on the device
instead; the cells themselves run there (``tests/chaos/test_gpu_faults.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.dataplane import cuda_ipc
from sidecar.errors import DeadlineExceeded
from tests.chaos.gpu_hold.sitecustomize import HoldingDriver
from tests.support.fake_cuda import FakeCudaDriver


def test_armed_copies_are_held_until_released_and_the_bound_ends_them(tmp_path: Path) -> None:
    arm, release = tmp_path / "arm", tmp_path / "release"
    with FakeCudaDriver() as fake:
        held = HoldingDriver(lambda: fake, str(arm), str(release), batches=2, seconds=0, on_device=False)
        cuda_ipc.set_driver_for_tests(held)  # type: ignore[arg-type]
        try:
            source, target = fake.allocate(4096), fake.allocate(4096)
            source.view()[:] = 7
            copy = [(target.pointer, source.pointer, 4096)]
            cuda_ipc.wait_copy(cuda_ipc.batch_copy(0, copy), 1.0)  # not armed: it runs
            arm.touch()
            first = cuda_ipc.batch_copy(0, copy)
            with pytest.raises(DeadlineExceeded):
                cuda_ipc.wait_copy(first, 0.2)  # held: the sidecar's bound ends the wait
            second = cuda_ipc.batch_copy(0, copy)
            assert not cuda_ipc.copy_done(second)
            release.touch()
            cuda_ipc.wait_copy(second, 2.0)  # released: it completes
            cuda_ipc.wait_copy(cuda_ipc.batch_copy(0, copy), 1.0)  # two holds used: no more
            assert (target.view() == 7).all()
        finally:
            cuda_ipc.set_driver_for_tests(fake)  # type: ignore[arg-type]
