"""The target side of the benchmark's cross-process raw-NIXL path: a NIXL agent in its own process
over a shared-memory file (or, given ``cuda:N`` instead of a path, over GPU memory it allocates
itself, as a GPU engine would), driving progress by polling, as a consumer engine's agent would.

Protocol: started with the file path (or ``cuda:N``), its length and optionally the poll period in seconds
(default 0.0001; over TCP the target's progress moves the bytes, so a cross-host run polls as
often as a sidecar's owner thread does after activity); prints one line "<mapping address> <agent
metadata as hex>" and polls until stdin closes. Used by ``sidecar.tools.bench`` only.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time


def main() -> int:
    path, length = sys.argv[1], int(sys.argv[2])
    period = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0001
    from sidecar.dataplane.transport import load_nixl

    api, _ = load_nixl()
    keep: object  # the memory, alive until this process ends
    if path.startswith("cuda:"):
        import torch

        keep = torch.zeros(length, dtype=torch.uint8, device=path)
        address, mem_type, device = keep.data_ptr(), "VRAM", keep.device.index or 0
    else:
        fd = os.open(path, os.O_RDWR)
        keep = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        address, mem_type, device = ctypes.addressof(ctypes.c_char.from_buffer(keep)), "DRAM", 0
    agent = api.nixl_agent(
        f"bench-target-{os.getpid()}", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    )
    agent.register_memory([(address, length, device, "")], mem_type)
    print(address, agent.get_agent_metadata().hex(), flush=True)
    done = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not done.is_set():
        agent.get_new_notifs()  # progress: wire-up and notifications
        time.sleep(period)
    return 0


if __name__ == "__main__":
    sys.exit(main())
