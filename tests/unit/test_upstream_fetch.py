"""``tests/support/upstream.py``: vLLM's files fetched from an sdist on pip's index, checked and
extracted, against a real HTTP index on loopback (pip's ``PIP_INDEX_URL`` points at it) serving
the JSON simple API and a small sdist made here; no network."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.upstream import FILES, UpstreamUnavailable, fetch

VERSION = "9.9.9"


def sdist(missing: str = "") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, inside in [*FILES.items(), ("README", "README.md")]:
            if name == missing:
                continue
            content = f"# {name} of vLLM {VERSION}\n".encode()
            info = tarfile.TarInfo(f"vllm-{VERSION}/{inside}")
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


class Index:
    def __init__(self) -> None:
        self.archive = sdist()
        self.digest = hashlib.sha256(self.archive).hexdigest()
        self.requests: list[tuple[str, str]] = []


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch) -> Iterator[Index]:
    state = Index()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.requests.append((self.path, self.headers.get("Accept", "")))
            if self.path == "/simple/vllm/":
                name = f"vllm-{VERSION}.tar.gz"
                body = json.dumps(
                    {"files": [{"filename": name, "url": f"../../files/{name}", "hashes": {"sha256": state.digest}}]}
                ).encode()
                content_type = "application/vnd.pypi.simple.v1+json"
            elif self.path == f"/files/vllm-{VERSION}.tar.gz":
                body, content_type = state.archive, "application/gzip"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/simple")
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_files_come_from_the_sdist_the_index_names_checked_and_cached(index: Index, tmp_path: Path) -> None:
    target = fetch(VERSION, tmp_path)
    for name in FILES:
        assert (target / name).read_text() == f"# {name} of vLLM {VERSION}\n"
    assert sorted(path.name for path in target.iterdir()) == sorted([*FILES, "manifest.json"])  # nothing else
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["sdist_sha256"] == index.digest
    assert index.requests[0] == ("/simple/vllm/", "application/vnd.pypi.simple.v1+json")
    fetched = len(index.requests)
    assert fetch(VERSION, tmp_path) == target and len(index.requests) == fetched  # the cache is reused
    (target / next(iter(FILES))).write_text("edited")
    fetch(VERSION, tmp_path)  # a changed file is fetched again
    assert len(index.requests) > fetched and (target / next(iter(FILES))).read_text().startswith("# ")


def test_a_file_that_cannot_be_fetched_says_why(index: Index, tmp_path: Path) -> None:
    with pytest.raises(UpstreamUnavailable, match=r"lists no vllm-0\.0\.1\.tar\.gz"):
        fetch("0.0.1", tmp_path)
    index.archive = sdist() + b"tampered"
    with pytest.raises(UpstreamUnavailable, match="sha256"):
        fetch(VERSION, tmp_path)
    index.archive = sdist(missing="toy_proxy_server.py")
    index.digest = hashlib.sha256(index.archive).hexdigest()
    with pytest.raises(UpstreamUnavailable, match=r"toy_proxy_server\.py"):
        fetch(VERSION, tmp_path)
    assert not (tmp_path / f"vllm-{VERSION}" / "manifest.json").exists()  # never taken for complete
