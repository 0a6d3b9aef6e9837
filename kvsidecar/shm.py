"""The shared-memory contract between an engine and its sidecar: where KV files live, how they are
named, and the lock rule that tells a live engine's file from one a killed engine left behind.

Both sides import this module. The engine side (``engine_shim``) creates and owns files with
``create_locked``, and before it makes new ones removes what killed engines left with
``remove_orphans``; the daemon (``sidecar``) removes the files of engines it saw die with
``remove_if_orphaned``. It has no side effects on import and depends on the standard library
only (docs/design.md section 8: the shim imports nothing of the daemon, the daemon's core nothing of
the shim).

The rule: the creating process holds an exclusive ``flock`` on the file for the file's whole life
and unlinks it before it drops the lock. A process that dies without closing (SIGKILL, OOM) drops
the lock with it; whoever then takes the lock may remove the file. The file is created nameless
(``O_TMPFILE``), locked, and only then linked under its name, so no one ever sees it named and
unlocked. An export sets ``MemoryExport.owner_locked`` to say its file follows this rule.

Callable from any thread; every function is a few system calls.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
# File name prefixes of the two kinds of owners (never the same, so one never removes the other's
# files by prefix): simulated engines, demo and benchmark (engine_shim.memory) and vLLM workers
# (engine_shim.vllm.kv_memory).
SIMULATED_PREFIX = "kvsidecar-"
VLLM_PREFIX = "kvsvllm-"


def create_locked(directory: Path, name: str, size: int) -> int:
    """A new file ``directory/name`` of ``size`` bytes (zeros on tmpfs), mode 0600, locked by this
    process: the returned descriptor holds the lock; close it only after unlinking the name."""
    try:
        # Without O_EXCL: a nameless file may be linked once, below.
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create a shared-memory file in {directory}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, size)
        _link(fd, directory / name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _link(fd: int, path: Path) -> None:
    """Give the nameless file ``fd`` the name ``path``: linkat(AT_SYMLINK_FOLLOW) on its /proc
    magic link. os.link uses linkat only when a dir_fd is given; plain link() would link the
    symlink itself."""
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=directory, follow_symlinks=True)
    finally:
        os.close(directory)


def remove_if_orphaned(path: Path) -> bool:
    """Remove ``path`` if it is a file made by ``create_locked`` whose creator died without closing
    it: the creator's lock is gone, so this process can take it. True if it removed the file.

    Only for files that follow the rule (``owner_locked`` exports): any other file is never locked
    and would look orphaned."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # gone already, or not ours to open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its creator is alive
        try:
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                return False  # the name now belongs to another file
            os.unlink(path)
        except OSError:
            return False  # gone meanwhile, or a directory we may not remove names from
        return True
    finally:
        os.close(fd)


def remove_orphans(directory: Path, prefix: str, unchanged_for_s: float = 0.0) -> list[Path]:
    """Remove every ``directory/prefix*`` file whose creator died without removing it (see
    ``remove_if_orphaned``) and that has not changed for ``unchanged_for_s`` seconds; the removed
    paths. Run by an engine before it creates its own files, so what a killed engine left (its
    sidecar killed with it, or never told) goes with the next start rather than at reboot. The age
    leaves a file that just lost its creator to the sidecar that saw it die (it counts and logs
    the removal)."""
    removed = []
    now = time.time()
    for path in directory.glob(f"{prefix}*"):
        try:
            if unchanged_for_s > 0 and now - path.stat(follow_symlinks=False).st_mtime < unchanged_for_s:
                continue
        except OSError:
            continue  # gone meanwhile
        if remove_if_orphaned(path):
            removed.append(path)
    return removed
