"""Logging: a debug line is written at level debug and skipped below it (cheaply: the hot paths
have debug lines), with the call's bound context either way."""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = """
import structlog, sys
from sidecar.logs import configure_logging, get_logger
configure_logging("json", sys.argv[1])
log = get_logger("kvsidecar.test")
structlog.contextvars.bind_contextvars(rpc="EngineService/Pull")
log.debug("quiet_unless_debug", n=1)
log.info("always", n=2)
"""


def _lines(level: str) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, level], capture_output=True, text=True, timeout=60, check=True
    )
    return [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]


def test_debug_lines_appear_only_at_debug_level() -> None:
    info = _lines("info")
    assert [line["event"] for line in info] == ["always"]
    debug = _lines("debug")
    assert [line["event"] for line in debug] == ["quiet_unless_debug", "always"]
    assert debug[0]["level"] == "debug" and debug[0]["rpc"] == "EngineService/Pull" and debug[0]["n"] == 1
