"""A simulated engine process driven over its JSON-lines protocol from an asyncio loop: the test
engines of ``kvsidecar selftest`` (the command's own, on this node's sidecar) and the one a
sidecar hosts for a self-test run from another node (``sidecar.app.selftest_host``).

The process (``python -m engine_shim.simulated``) is started, not imported, so the daemon that
hosts one imports nothing of the shim. Every wait is bounded. Runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

START_TIMEOUT_SECONDS = 30.0
COMMAND_TIMEOUT_SECONDS = 60.0


class TestEngineFailed(RuntimeError):
    """The test engine could not start, or exited; the message says why (its last stderr line)."""


class TestEngineProcess:
    """One test engine process and what it said; ``start`` makes one."""

    __test__ = False  # not a pytest class

    def __init__(self, process: asyncio.subprocess.Process, engine_id: str) -> None:
        self.process = process
        self.engine_id = engine_id
        self.session_id = uuid.uuid4().hex
        self.ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Condition()
        self.stderr = b""  # its last few KiB (why it failed to start, if it did)
        self._next_id = 0
        self.reader = asyncio.ensure_future(self._read())
        self._stderr_reader = asyncio.ensure_future(self._read_stderr())
        self.expiry: asyncio.TimerHandle | None = None  # a host's TTL

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            if "ready" in message and not self.ready.done():
                self.ready.set_result(message["ready"])
            elif "event" in message:
                async with self.changed:
                    self.events.append(message)
                    self.changed.notify_all()
            elif isinstance(message.get("id"), int) and message["id"] in self.replies:
                future = self.replies.pop(message["id"])
                if not future.done():
                    future.set_result(message)
        exited = "the test engine exited"
        if not self.ready.done():
            self.ready.set_exception(TestEngineFailed(exited))
        for future in self.replies.values():
            if not future.done():
                future.set_exception(TestEngineFailed(exited))
        async with self.changed:
            self.changed.notify_all()

    async def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        async for line in self.process.stderr:
            self.stderr = (self.stderr + line)[-4096:]

    async def command(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self._next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.replies[self._next_id] = future
        self.process.stdin.write((json.dumps({**command, "id": self._next_id}) + "\n").encode())
        await self.process.stdin.drain()
        try:
            return await asyncio.wait_for(future, COMMAND_TIMEOUT_SECONDS)
        except TimeoutError:
            self.replies.pop(self._next_id, None)
            return {"ok": False, "error": f"the test engine did not answer within {COMMAND_TIMEOUT_SECONDS:g}s"}

    async def wait_event(self, request_id: str, timeout: float) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((e for e in self.events if e.get("request_id") == request_id), None)

        try:
            async with self.changed:
                await asyncio.wait_for(
                    self.changed.wait_for(lambda: found() is not None or self.reader.done()), timeout
                )
        except TimeoutError:
            return {"ok": False, "error": f"no event for {request_id} within {timeout:g}s"}
        event = found()
        if event is None:
            return {"ok": False, "error": "the test engine exited"}
        return {"ok": True, **event}

    async def stop(self) -> None:
        if self.expiry is not None:
            self.expiry.cancel()
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), 10.0)
        self.reader.cancel()
        self._stderr_reader.cancel()
        # Its shared-memory files (kvsidecar-<pid>-...): the process was killed before removing them.
        for path in Path("/dev/shm").glob(f"kvsidecar-{self.process.pid}-*"):
            path.unlink(missing_ok=True)

    def failure_reason(self) -> str:
        """Why it did not start: the status details of the call that failed (its registration, as
        a gRPC error's traceback shows them), else its last stderr line."""
        text = self.stderr.decode(errors="replace").strip()
        details = re.findall(r'details = "(.*)"', text)
        if details:
            return details[-1]
        return text.splitlines()[-1] if text else f"it did not register within {START_TIMEOUT_SECONDS:g}s"

    @classmethod
    async def start(
        cls, socket: Path, engine_id: str, layers: int, blocks: int, block_len: int, block_size: int
    ) -> tuple[TestEngineProcess, dict[str, Any]]:
        """Start a test engine on the sidecar at ``socket``; returns it and its ready message
        (``peer_address``, ``buffers``), or raises TestEngineFailed with the reason."""
        command = [
            sys.executable, "-m", "engine_shim.simulated", "--socket", str(socket), "--engine-id", engine_id,
            "--role", "both", "--layers", str(layers), "--blocks", str(blocks), "--block-len", str(block_len),
            "--block-size", str(block_size), "--model", "kvsidecar-selftest",
        ]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        engine = cls(process, engine_id)
        try:
            ready = await asyncio.wait_for(asyncio.shield(engine.ready), START_TIMEOUT_SECONDS)
        except (TimeoutError, TestEngineFailed):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), 2.0)  # its last words, if it is exiting
            await engine.stop()
            raise TestEngineFailed(engine.failure_reason()) from None
        return engine, ready
