"""The agent tables: what each local NIXL agent holds (owner thread only).

One ``Agent`` per local agent: its NIXL object, its memory registrations (the engine's KV, the
staging pool, host memory registered for host staging), the remote agents loaded into it (by the
metadata a handshake gave) and the descriptor lists prepared on it, local and per remote agent,
with each list's descriptor lengths (the chunk scheduler cuts posts by bytes). ``NixlTransport``
keeps them by agent name and fails whatever still uses a remote agent or list before it goes here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from sidecar.dataplane.contract import DlistSpec, RemoteAgent, Staging
from sidecar.logs import get_logger

log = get_logger("kvsidecar.transport")

# The name NIXL gives an agent's own (local) side when a descriptor list is prepared.
LOCAL = "NIXL_INIT_AGENT"


class Agent:
    """One local NIXL agent and its tables."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.registrations: list[Any] = []
        self.dlists: dict[tuple[str, Hashable], Any] = {}
        # Byte length of each descriptor of a prepared list (same keys as ``dlists``): splits posts.
        self.lengths: dict[tuple[str, Hashable], np.ndarray] = {}
        self.remotes: dict[str, bytes] = {}
        self.staging: list[Staging] = []
        self.hosted: set[tuple[int, int]] = set()  # register_host ranges

    def register(self, regions: list[tuple[int, int, int]], mem_type: str) -> None:
        """Register (address, length, device) regions, once per backing storage."""
        if regions:
            self.registrations.append(self.agent.register_memory([(a, n, d, "") for a, n, d in regions], mem_type))

    # --- remote agents ----------------------------------------------------------------------------

    def knows(self, remote: RemoteAgent) -> bool:
        """Whether ``remote`` is loaded with exactly this metadata."""
        return self.remotes.get(remote.name) == remote.metadata

    def load_remote(self, remote: RemoteAgent) -> None:
        """Load a remote agent (``unload_remote`` a stale one of the same name first)."""
        loaded = self.agent.add_remote_agent(remote.metadata)
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != remote.name:
            quietly(self.agent.remove_remote_agent, loaded_name)
            raise ValueError(f"agent metadata names {loaded_name!r}, expected {remote.name!r}")
        self.remotes[remote.name] = remote.metadata

    def unload_remote(self, remote_name: str) -> None:
        """Release the lists prepared against ``remote_name`` and unload it (no post may use them)."""
        for key in [key for key in self.dlists if key[0] == remote_name]:
            self.lengths.pop(key, None)
            quietly(self.dlists.pop(key).release)
        quietly(self.agent.remove_remote_agent, remote_name)
        self.remotes.pop(remote_name, None)

    # --- prepared descriptor lists ----------------------------------------------------------------

    def dlist(self, target: str, spec: DlistSpec) -> Any:
        """The list ``spec`` prepared against ``target`` (``LOCAL`` or a remote agent), prepared on
        first use and reused by every later transfer."""
        slot = (target, spec.key)
        handle = self.dlists.get(slot)
        if handle is None:
            descriptors = spec.build()
            handle = self.agent.prep_xfer_dlist(target, descriptors, spec.mem_type)
            self.dlists[slot] = handle
            self.lengths[slot] = np.asarray(descriptors[:, 1], dtype=np.int64) if len(descriptors) else np.zeros(0)
        return handle

    def local_lengths(self, key: Hashable) -> np.ndarray:
        """Byte length of each descriptor of the local list ``key`` (prepared)."""
        return self.lengths[(LOCAL, key)]

    # --- registered host memory ---------------------------------------------------------------------

    def lend_staging(self, nbytes: int) -> Staging:
        for staging in self.staging:
            if not staging.busy and staging.array.size >= nbytes:
                staging.busy = True
                return staging
        size = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
        array = np.zeros(size, dtype=np.uint8)
        array[::4096] = 1  # fault every page in now, not during the first transfer
        self.registrations.append(self.agent.register_memory([(int(array.ctypes.data), size, 0, "")], "DRAM"))
        staging = Staging(array, busy=True)
        self.staging.append(staging)
        return staging

    def register_host(self, address: int, nbytes: int) -> None:
        if (address, nbytes) in self.hosted:
            return
        self.registrations.append(self.agent.register_memory([(address, nbytes, 0, "")], "DRAM"))
        self.hosted.add((address, nbytes))

    def close(self) -> None:
        """Release every list, unload every remote agent, deregister every registration."""
        for handle in self.dlists.values():
            quietly(handle.release)
        self.dlists.clear()
        self.lengths.clear()
        for remote in list(self.remotes):
            quietly(self.agent.remove_remote_agent, remote)
        for registration in self.registrations:
            quietly(self.agent.deregister_memory, registration)
        self.registrations.clear()
        self.staging.clear()  # deregistered above with the other registrations
        self.hosted.clear()


def quietly(function: Callable[..., Any], *args: Any) -> None:
    try:
        function(*args)
    except Exception as exc:
        log.debug("nixl_cleanup_failed", call=getattr(function, "__name__", "?"), error=str(exc))
