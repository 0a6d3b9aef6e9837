"""Loading NIXL and creating its agents: which NIXL wheel to import, the agent configuration
every agent of the sidecar uses (no progress or listener thread), and its backends.

``load_nixl`` and ``available_backends`` run on whichever thread asks (the process shell, the
bench, the owner thread's constructor); ``new_agent`` runs on the owner thread only
(``owner.NixlTransport``), like every other call on a NIXL object.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from sidecar.config import NixlSettings
from sidecar.dataplane import cuda_ipc
from sidecar.logs import route_foreign_loggers


class NixlUnavailable(RuntimeError):
    """NIXL could not be imported or an agent could not be created."""


# NIXL's wheels, one per CUDA major version; the ``nixl`` meta package only picks one of them.
_NIXL_PACKAGES = ("nixl_cu12", "nixl_cu13")


def nixl_package(installed: list[str], cuda_major: int | None) -> str:
    """Which installed NIXL wheel to use (pure): the only one, else the one built for ``cuda_major``."""
    if len(installed) == 1 or cuda_major is None:
        return installed[0]
    wanted = f"nixl_cu{cuda_major}"
    return wanted if wanted in installed else installed[0]


def load_nixl() -> tuple[Any, str]:
    """Import NIXL's Python API; returns (api module, version string)."""
    installed = [name for name in _NIXL_PACKAGES if importlib.util.find_spec(name) is not None]
    if not installed:
        raise NixlUnavailable(
            "NIXL is not installed. Install it with `pip install --no-deps nixl-cu12==1.5.1 numpy` "
            "(nixl-cu13 on a CUDA 13 node; its plain dependency list pulls a CUDA torch)."
        )
    cuda_major = None
    if len(installed) > 1:
        try:
            from nixl_meta_utils import detect_cuda_major  # the ``nixl`` meta package (optional)

            cuda_major = detect_cuda_major()
        except Exception:  # no meta package, or its guess failed: the first installed wheel
            pass
    package = nixl_package(installed, cuda_major)
    # UCX's memory-type cache learns of GPU memory through hooks on CUDA's allocation calls; a
    # range mapped by a call it did not see (our cuIpcOpenMemHandle, looked up before UCX loaded)
    # stays "host" in it, and NIXL then refuses to register it as VRAM ("VRAM memory is detected as
    # host by UCX"): on an H100 the second engine's KV registered on one sidecar failed so. Without
    # the cache UCX asks the driver at each registration, off the transfer path. Read when UCX
    # loads, so set before the import; an operator's own value wins.
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    try:
        api = importlib.import_module(f"{package}._api")
    except ImportError as exc:
        raise NixlUnavailable(f"NIXL ({package}) is installed but does not import: {exc}") from exc
    distribution = package.replace("_", "-")
    try:
        nixl_version = f"{distribution} {version(distribution)}"
    except PackageNotFoundError:
        nixl_version = f"{distribution} unknown"
    route_foreign_loggers()
    return api, nixl_version


def available_backends() -> list[str]:
    """The backend plugins this NIXL installation offers (a throwaway agent asks NIXL)."""
    api, _ = load_nixl()
    config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
    agent = api.nixl_agent("kvsidecar-backend-probe", config)
    return [str(name) for name in agent.get_plugin_list()]


def new_agent(api: Any, settings: NixlSettings, name: str, devices: set[int], mem_type: str) -> Any:
    """A NIXL agent with the configured backends (owner thread). NIXL's progress thread is off
    (with its hard-coded zero delay it spins a core per agent): the owner thread drives progress.
    ``devices``: the GPUs of a VRAM agent's regions."""
    if mem_type == "VRAM":
        # CUDA contexts are per thread: UCX registers (and later copies) GPU memory from this
        # one, so the device's primary context, where the IPC handles were opened, is made
        # current here too, before the backends are created.
        for device_id in sorted(devices):
            cuda_ipc.make_current(device_id)
    config = api.nixl_agent_config(
        enable_prog_thread=False,
        enable_listen_thread=False,
        capture_telemetry=True,
        num_threads=settings.num_threads,
        backends=[],
    )
    agent = api.nixl_agent(name, config)
    for backend in settings.backends:
        params: dict[str, str] = {}
        if backend == "UCX":
            params["ucx_error_handling_mode"] = settings.ucx_error_handling_mode
            if settings.num_threads:
                params["num_threads"] = str(settings.num_threads)
        agent.create_backend(backend, params)
    return agent
