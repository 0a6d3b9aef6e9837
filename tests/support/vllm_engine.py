"""A real vLLM engine (offline ``LLMEngine``, CPU) in a child process, driven by JSON lines.

Used by the end-to-end tests: ``python -m tests.support.vllm_engine --model DIR [--sidecar-socket S
--engine-id E --role kv_producer|kv_consumer|kv_both]``. Without ``--sidecar-socket`` the engine has
no KV connector (the baseline).

Threads: a reader thread turns stdin lines into a queue; the main thread owns vLLM and steps the
engine whenever it has work, handling commands between steps (so ``corrupt`` never races a step).

stdin, one JSON object per line (``id`` is echoed in the reply):
- ``{"op": "generate", "id", "prompt" (text or token ids), "max_tokens", "kv_transfer_params"?}``: the reply comes
  when the request finishes: token ids, text, kv_transfer_params, num_cached_tokens, the
  engine's internal request id, what the shim recorded about its transfer and how many tokens
  the scheduler was told to load from outside;
- ``{"op": "corrupt", "id", "blocks"}``: zero these KV blocks in every layer (negative control);
- ``{"op": "abort", "id", "generate_id"}``: abort the request of that generate command, whose
  reply then comes at once with ``"aborted": true``;
- ``{"op": "transfer", "id", "request_id"}``: what the shim recorded about that request's transfer;
- ``{"op": "status", "id"}``: the shim's connection state, the requests vLLM still holds and its
  free KV blocks; ``{"op": "exit"}``.
stdout: ``{"ready": {...}}`` once the engine is up, then one reply per command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sidecar.tools.launcher import kill_group
from tests.support.processes import python_env


def sidecar_kv_transfer_config(
    engine_id: str, role: str, socket_path: str | Path, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for the SidecarConnector, as a user writes it (README)."""
    return {
        "kv_connector": "SidecarConnector",
        # The old path on purpose: existing settings name it, and the e2e tests keep the alias working.
        "kv_connector_module_path": "engine_shim.vllm_connector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"sidecar_socket": str(socket_path), **(extra or {})},
    }


def _emit(payload: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


def _read_stdin(commands: queue.SimpleQueue[dict[str, Any] | None]) -> None:
    for line in sys.stdin:
        if line.strip():
            try:
                commands.put(json.loads(line))
            except ValueError:
                _emit({"reply": "error", "ok": False, "error": f"not JSON: {line[:80]!r}"})
    commands.put(None)  # stdin closed: the test runner is gone


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests.support.vllm_engine")
    parser.add_argument("--model", required=True)
    parser.add_argument("--sidecar-socket")
    parser.add_argument("--engine-id")
    parser.add_argument("--role", default="kv_both")
    parser.add_argument("--transfer-mode", default="pull")
    parser.add_argument("--extra", default="{}", help="more kv_connector_extra_config, as JSON")
    parser.add_argument("--kv-bytes", type=int, default=64 << 20)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args(argv)

    from vllm import LLM, SamplingParams

    kv_transfer_config = None
    if args.sidecar_socket:
        extra = {"transfer_mode": args.transfer_mode, **json.loads(args.extra)}
        kv_transfer_config = sidecar_kv_transfer_config(args.engine_id, args.role, args.sidecar_socket, extra)
    started = time.monotonic()
    llm = LLM(
        model=args.model,
        dtype="float32",
        block_size=args.block_size,
        max_model_len=1024,
        enforce_eager=True,
        distributed_executor_backend="uni",
        seed=0,
        kv_cache_memory_bytes=args.kv_bytes,
        max_num_seqs=args.max_num_seqs,
        kv_transfer_config=kv_transfer_config,
    )
    # vLLM internals reached through the in-process client (VLLM_ENABLE_V1_MULTIPROCESSING=0).
    engine: Any = llm.llm_engine
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    model_runner = core.model_executor.driver_worker.worker.model_runner
    worker_connector: Any = None
    if kv_transfer_config is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker_connector = get_kv_transfer_group()
    scheduler_connector = scheduler.connector

    def shim_status() -> dict[str, Any]:
        if worker_connector is None:
            return {}
        side = worker_connector.worker_side
        side.poll()  # this thread is vLLM's worker thread (uni executor)
        return {
            "connected": side.connected,
            "sidecar_id": side.sidecar_id,
            "peer_address": side.peer_address,
            "shm_paths": [str(path) for path in side.shm_paths()],
            "vllm_requests": len(scheduler.requests),
            "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            "offers_kv": scheduler_connector.scheduler_side.offers_kv,
        }

    _emit({"ready": {"pid": os.getpid(), "startup_s": time.monotonic() - started, **shim_status()}})

    commands: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
    threading.Thread(target=_read_stdin, args=(commands,), daemon=True).start()
    pending: dict[str, tuple[str, Any]] = {}  # external request id -> (internal id, command id)
    counter = 0
    while True:
        busy = engine.has_unfinished_requests() or scheduler.has_requests()
        try:
            # Idle: wait for a command (bounded, so a closed stdin is noticed). Busy: only peek.
            command = commands.get_nowait() if busy else commands.get(timeout=0.05)
        except queue.Empty:
            command = {}
        if command is None:
            break  # stdin closed: the driver is gone
        if command:
            op = command.get("op")
            ident = command.get("id")
            if op == "exit":
                break
            try:
                if op == "generate":
                    counter += 1
                    extra_args = {}
                    if command.get("kv_transfer_params") is not None:
                        extra_args["kv_transfer_params"] = command["kv_transfer_params"]
                    params = SamplingParams(
                        max_tokens=int(command.get("max_tokens", 16)),
                        temperature=0.0,
                        ignore_eos=True,
                        extra_args=extra_args or None,
                    )
                    external = f"req-{counter}"
                    prompt = command["prompt"]
                    if isinstance(prompt, list):  # token ids
                        prompt = {"prompt_token_ids": [int(token) for token in prompt]}
                    pending[external] = (engine.add_request(external, prompt, params), ident)
                elif op == "corrupt":
                    blocks = [int(block) for block in command["blocks"]]
                    for layer in model_runner.kv_caches:
                        layer[blocks] = 0
                    _emit({"reply": op, "id": ident, "ok": True})
                elif op == "abort":
                    target = next(
                        key for key, (_, generate_id) in pending.items() if generate_id == command["generate_id"]
                    )
                    internal, generate_id = pending.pop(target)
                    engine.abort_request([internal], internal=True)
                    _emit({"reply": "generate", "id": generate_id, "ok": True, "aborted": True, "request_id": internal})
                    _emit({"reply": op, "id": ident, "ok": True})
                elif op == "transfer":
                    if worker_connector is not None:
                        worker_connector.worker_side.poll()
                    record = (
                        worker_connector.worker_side.transfers.get(command["request_id"]) if worker_connector else None
                    )
                    _emit({"reply": op, "id": ident, "ok": True, "transfer": record})
                elif op == "status":
                    _emit({"reply": op, "id": ident, "ok": True, **shim_status()})
                else:
                    raise ValueError(f"unknown op {op!r}")
            except Exception as exc:
                _emit({"reply": op, "id": ident, "ok": False, "error": repr(exc)})
            continue
        if not busy:
            continue
        for output in engine.step():
            if not output.finished or output.request_id not in pending:
                continue
            internal, ident = pending.pop(output.request_id)
            completion = output.outputs[0]
            transfer = external_tokens = None
            if worker_connector is not None:
                transfer = worker_connector.worker_side.transfers.get(internal)
                external_tokens = scheduler_connector.scheduler_side.external_tokens.get(internal)
            _emit(
                {
                    "reply": "generate",
                    "id": ident,
                    "ok": True,
                    "request_id": internal,
                    "token_ids": list(completion.token_ids),
                    "text": completion.text,
                    "finish_reason": completion.finish_reason,
                    "kv_transfer_params": output.kv_transfer_params,
                    "num_cached_tokens": output.num_cached_tokens,
                    "transfer": transfer,
                    "external_tokens": external_tokens,
                }
            )
    del llm
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())


# --- the driver side (in the test process) ---------------------------------------------------------


class VllmEngineProcess:
    """Parent-side handle of ``python -m tests.support.vllm_engine``: start, send commands, wait
    for replies (every wait bounded), kill by PID and remove the engine's shared-memory files."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        model: Path,
        *,
        cpu: int,
        sidecar: Path | None = None,
        engine_id: str | None = None,
        role: str = "kv_both",
        transfer_mode: str = "pull",
        extra: dict[str, Any] | None = None,
        max_num_seqs: int = 8,
        block_size: int = 32,
    ) -> None:
        self.name = name
        self.log_path = workdir / f"vllm-{name}.log"
        command = [
            sys.executable,
            "-m",
            "tests.support.vllm_engine",
            "--model",
            str(model),
            "--max-num-seqs",
            str(max_num_seqs),
            "--block-size",
            str(block_size),
        ]
        if sidecar is not None:
            command += [
                "--sidecar-socket",
                str(sidecar),
                "--engine-id",
                engine_id or name,
                "--role",
                role,
                "--transfer-mode",
                transfer_mode,
                "--extra",
                json.dumps(extra or {}),
            ]
        env = python_env(
            {
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
                "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_LOGGING_LEVEL": "WARNING",
                **private_tmp(workdir),
            }
        )
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            start_new_session=True,
        )
        log.close()
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._next_id = 0
        self._lock = threading.Lock()
        self.ready: dict[str, Any] = {}
        self._exit_requested = False

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            try:
                self._replies.put(json.loads(raw))
            except ValueError:
                continue

    def wait_ready(self, timeout: float = 120.0) -> VllmEngineProcess:
        self.ready = self._wait(lambda m: "ready" in m, timeout)["ready"]
        return self

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _wait(self, predicate: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        kept: list[dict[str, Any]] = []
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"vLLM {self.name}: no answer within {timeout}s; log:\n{self.log_tail()}")
                try:
                    message = self._replies.get(timeout=min(remaining, 0.5))
                except queue.Empty:
                    if self.process.poll() is not None:
                        raise RuntimeError(
                            f"vLLM {self.name} exited with {self.process.returncode}; log:\n{self.log_tail()}"
                        ) from None
                    continue
                if predicate(message):
                    return message
                kept.append(message)
        finally:
            for message in kept:
                self._replies.put(message)

    def send(self, op: str, **fields: Any) -> int:
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            assert self.process.stdin is not None
            self.process.stdin.write((json.dumps({"op": op, "id": ident, **fields}) + "\n").encode())
            self.process.stdin.flush()
        return ident

    def reply(self, ident: int, timeout: float = 60.0) -> dict[str, Any]:
        message = self._wait(lambda m: m.get("id") == ident, timeout)
        if not message.get("ok"):
            raise RuntimeError(f"vLLM {self.name}: {message}")
        return message

    def command(self, op: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        return self.reply(self.send(op, **fields), timeout)

    def generate(
        self,
        prompt: str | list[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        return self.command(
            "generate", timeout, prompt=prompt, max_tokens=max_tokens, kv_transfer_params=kv_transfer_params
        )

    def shm_paths(self) -> list[Path]:
        return [Path(path) for path in self.ready.get("shm_paths", [])]

    def request_exit(self) -> None:
        """Ask the engine to shut down (without waiting)."""
        if self.process.poll() is None and not self._exit_requested:
            self._exit_requested = True
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(b'{"op": "exit"}\n')
                self.process.stdin.flush()
            except OSError:
                pass

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down gracefully (bounded), then make sure the process group is gone."""
        self.request_exit()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        kill_group(self.process)
        remove_shm_files(self.process.pid)


def private_tmp(workdir: Path, name: str = "") -> dict[str, str]:
    """TMPDIR inside the test's work directory: vLLM puts its IPC sockets and ``vllm_dist_*``
    directories in the temp dir, and they go when the work directory is removed."""
    tmp = workdir / (f"tmp-{name}" if name else "tmp")
    tmp.mkdir(exist_ok=True)
    return {"TMPDIR": str(tmp)}


def remove_shm_files(pid: int) -> list[Path]:
    """Remove the KV files of the shim in process ``pid`` (kvsvllm-<engine>-<rank>-<pid>-<random>),
    left behind when the process was killed; returns what was removed."""
    removed = []
    for path in Path("/dev/shm").glob(f"kvsvllm-*-{pid}-*"):
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def remove_orphaned_shm(before: set[str]) -> list[str]:
    """Shared-memory files that appeared during the run, that no process maps any more and that look
    like Python multiprocessing's (``psm_*``, ``sem.mp-*``: vLLM's queues when a process was killed)."""
    new = [
        path
        for path in Path("/dev/shm").iterdir()
        if path.name not in before and path.name.startswith(("psm_", "sem.mp-"))
    ]
    if not new:
        return []
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped.update(name for name in (p.name for p in new) if name in maps.read_text())
    removed = []
    for path in new:
        if path.name not in mapped:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def remove_engine_shm_files(engine_id: str) -> list[Path]:
    """Remove every KV file the shim made for ``engine_id`` (any rank, any process)."""
    removed = []
    for path in Path("/dev/shm").glob(f"kvsvllm-{engine_id}-pp*"):
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def free_port() -> int:
    """A free loopback port *below* the ephemeral range: a port taken from the ephemeral range can
    be handed to another socket (vLLM opens many) before the server that was told to use it binds
    it, which killed vLLM's NIXL handshake listener in a trial run."""
    low, high = 20000, 32000
    with contextlib.suppress(OSError, ValueError):
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        high = min(high, ephemeral_low)
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")


class VllmServer:
    """vLLM's OpenAI API server (``python -m vllm.entrypoints.openai.api_server``) in its own
    session: the API process plus its EngineCore process, as users deploy it. Killed by process
    group; the shim's KV files are removed by engine id. The benchmark (``bench/vllm_pd.py``) starts
    its servers with this class too."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        model: Path,
        *,
        cpu: int,
        kv_transfer_config: dict[str, Any] | None = None,
        max_model_len: int = 1024,
        kv_cache_bytes: int | None = 64 << 20,
        kv_space_gib: int = 1,
        extra_env: dict[str, str] | None = None,
        pythonpath: Sequence[Path] = (),
        extra_args: Sequence[str] = (),
        port: int | None = None,
    ) -> None:
        self.name = name
        self.port = port or free_port()  # a restarted server may keep its predecessor's port
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_id = str((kv_transfer_config or {}).get("engine_id") or "")
        self.log_path = workdir / f"vllm-server-{name}.log"
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", "tiny",
            "--dtype", "float32", "--block-size", "32", "--max-model-len", str(max_model_len),
            "--enforce-eager", "--seed", "0", "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        if kv_cache_bytes is not None:
            command += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        if kv_transfer_config is not None:
            command += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        command += list(extra_args)  # e.g. --no-enable-prefix-caching
        env = python_env(
            {
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
                "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
                "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                **private_tmp(workdir, name),
                **(extra_env or {}),
            }
        )
        for directory in reversed(pythonpath):  # e.g. a sitecustomize that patches vLLM
            env["PYTHONPATH"] = str(directory) + os.pathsep + env["PYTHONPATH"]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()

    def wait_ready(self, timeout: float = 180.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server {self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM server {self.name} not ready within {timeout}s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (vLLM shuts down its EngineCore and worker, and the multiprocessing resource
        tracker unlinks their shared-memory queues), then SIGKILL to whatever of the group is left
        after ``timeout``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Reap the API server first: an exited but unreaped group leader is a zombie, and
            # signalling its group still succeeds, so without this every stop waited the whole
            # timeout (30 s a server).
            self.process.poll()
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        self.kill()

    def kill(self) -> None:
        kill_group(self.process)  # also the EngineCore child, if it outlived the API
        if self.engine_id:
            remove_engine_shm_files(self.engine_id)
