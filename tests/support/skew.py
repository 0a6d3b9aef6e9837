"""An older kvsidecar, pinned by commit, run next to this checkout (the version-skew tests).

``OldCheckout.create(commit, into)`` makes, under ``into``:
- ``src/``: the commit's tree (``git archive``; the generated stubs are committed);
- ``venv/``: a venv made ``--without-pip`` whose one ``.pth`` puts ``src/`` first and then this
  interpreter's site-packages, so the old code runs on the same installed packages (NIXL, grpc,
  numpy) and nothing is downloaded; this checkout's editable install is not in it (its finder is
  installed by a ``.pth`` of the other venv, which this one does not process);
- ``python``: a script that runs that venv's Python in ``src/`` without this checkout's
  PYTHONPATH. ``DaemonProcess`` and ``EngineProcess`` put their own interpreter after their
  ``wrapper``; with ``wrapper=[checkout.python]`` the script drops it, so the sidecar or the
  simulated engine runs the old code.

The caller removes ``into`` (the tests' fixture does, whatever happens).
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

from sidecar.tools.proto_compat import require_commit
from tests.support.processes import REPO

_LAUNCHER = """#!/bin/sh
# Runs kvsidecar {commit}: the caller's interpreter ($1) is dropped for the old tree's venv.
shift
unset PYTHONPATH
cd "{src}" || exit 1
exec "{python}" "$@"
"""


@dataclass(frozen=True)
class OldCheckout:
    commit: str
    root: Path

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def python(self) -> Path:
        return self.root / "python"

    @classmethod
    def create(cls, commit: str, into: Path, repo: Path = REPO) -> OldCheckout:
        require_commit(commit, repo, "the version-skew tests cannot build the older sidecar")
        checkout = cls(commit, into)
        checkout.src.mkdir(parents=True)
        archive = into / "src.tar"
        with archive.open("wb") as out:
            subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit], stdout=out, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(checkout.src, filter="data")
        archive.unlink()
        venv = into / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        python = venv / "bin" / "python"
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        (Path(site) / "kvsidecar-skew.pth").write_text("\n".join([str(checkout.src), *ours]) + "\n")
        checkout.python.write_text(_LAUNCHER.format(commit=commit, src=checkout.src, python=python))
        checkout.python.chmod(0o755)
        return checkout

    def imports_from(self) -> dict[str, str]:
        """Where the old interpreter finds each of the project's packages (to prove it is the old tree)."""
        code = (
            "import json, kvsidecar, sidecar, engine_shim; "
            "print(json.dumps({m.__name__: m.__file__ for m in (kvsidecar, sidecar, engine_shim)}))"
        )
        result = subprocess.run(
            [str(self.python), sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
        )
        found: dict[str, str] = json.loads(result.stdout)
        return found
