"""A prefill/decode proxy for vLLM engines that exchange KV through kvsidecar.

An OpenAI-compatible front (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``) that splits every request into two legs:

- the **prefill leg** goes to a prefill engine (P) with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": true, "transfer_id": ...}``; P answers with the
  ``kv_transfer_params`` the decode engine needs (``remote_engine_id``, ``remote_host``/
  ``remote_port`` = P's sidecar, ``remote_block_ids``, ...);
- the **decode leg** goes to a decode engine (D) with those parameters and produces the answer
  the client sees (streamed if the client asked for a stream).

Flows (``--mode``):
- ``pull``: prefill, then decode with P's parameters; D's sidecar reads P's blocks;
- ``push``: the same order, but D registers its blocks and P's sidecar writes into them;
- ``push --concurrent``: both legs are dispatched at once with the same ``transfer_id``; D learns
  P's engine id and sidecar address from ``--prefill-kv`` instead of P's answer, so decode blocks
  are registered while P computes. If the prefill leg fails, the decode leg is cancelled (vLLM
  aborts it and the sidecar releases its registration) and re-sent as a plain request, which D
  computes itself.

Every dispatch gets a fresh ``transfer_id`` (the sidecars' primary match key) and both legs carry
the same ``X-Request-Id``. Engines are picked round-robin. If P returns no parameters (its sidecar
was down), D gets a plain request and computes the prompt itself.

Multi-turn chats (engines started with ``"multi_turn": true``): the proxy keeps no state. A client
may name its conversation with a top-level ``conversation_id`` (as vLLM's multi-turn proxy
expects); it is removed from the body and passed to both legs in ``kv_transfer_params``. D then
holds each finished turn under that id, and on the next turn P's sidecar finds it on D's sidecar
and P loads the history instead of computing it. Without an id P finds the hold by its prompt's
block hashes among the sidecars its own sidecar knows. Either way only the prefix whose block
hashes match is reused, so a client that edits the history gets correct answers.

Run: ``python examples/pd_proxy.py --prefill http://p:8100 --decode http://d:8200 --port 8000``.
Threads: one asyncio loop (aiohttp server and client); nothing blocks it.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("pd_proxy")


@dataclass(frozen=True)
class Prefill:
    url: str
    # For concurrent push: the engine's kv_transfer_config.engine_id and its sidecar's PeerService address.
    engine_id: str = ""
    sidecar: str = ""


@dataclass
class ProxyConfig:
    prefill: list[Prefill]
    decode: list[str]
    mode: str = "pull"
    concurrent: bool = False
    timeout: float = 600.0
    _prefill_cycle: Iterator[Prefill] = field(init=False, repr=False)
    _decode_cycle: Iterator[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("at least one --prefill and one --decode engine are needed")
        if self.mode not in ("pull", "push"):
            raise ValueError(f"--mode must be pull or push, not {self.mode!r}")
        if self.concurrent and (self.mode != "push" or not all(p.engine_id and p.sidecar for p in self.prefill)):
            raise ValueError("--concurrent needs --mode push and --prefill-kv ENGINE_ID@HOST:PORT for every --prefill")
        self._prefill_cycle = itertools.cycle(self.prefill)
        self._decode_cycle = itertools.cycle(self.decode)

    def pick(self) -> tuple[Prefill, str]:
        return next(self._prefill_cycle), next(self._decode_cycle)


class LegError(Exception):
    """An engine answered a leg with an error; carries its status and body for the client."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status
        self.body = body


def prefill_body(body: dict[str, Any], transfer_id: str, mode: str, conversation_id: str = "") -> dict[str, Any]:
    """The prefill leg: one token, no stream, and the request to keep the KV for a decoder."""
    leg = copy.deepcopy(body)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": transfer_id,
        "transfer_mode": mode,
    }
    if conversation_id:
        leg["kv_transfer_params"]["conversation_id"] = conversation_id
    return leg


def decode_body(
    body: dict[str, Any], kv_transfer_params: dict[str, Any] | None, conversation_id: str = ""
) -> dict[str, Any]:
    leg = copy.deepcopy(body)
    params = dict(kv_transfer_params or {})
    if conversation_id:
        params["conversation_id"] = conversation_id  # D holds the finished turn under it
    if params:
        leg["kv_transfer_params"] = params
    else:
        leg.pop("kv_transfer_params", None)  # the decoder computes the prompt itself
    return leg


def take_conversation_id(body: dict[str, Any]) -> str:
    """The client's top-level ``conversation_id`` (vLLM's multi-turn proxy convention), removed
    from the body the engines see; ``""`` if there is none."""
    value = body.pop("conversation_id", None)
    return str(value) if value else ""


def concurrent_push_params(prefill: Prefill, transfer_id: str) -> dict[str, Any]:
    """What D needs to register for a push before P has answered (vLLM's push proxy fields)."""
    host, _, port = prefill.sidecar.rpartition(":")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": prefill.engine_id,
        "remote_host": host.strip("[]"),
        "remote_port": int(port),
        "transfer_id": transfer_id,
        "transfer_mode": "push",
    }


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    async def start(self, _: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout, sock_connect=10.0)
        # Idle connections are dropped before vLLM's server (uvicorn: 5 s) closes them, so a leg is
        # not sent on a connection the engine is closing at that moment.
        connector = aiohttp.TCPConnector(keepalive_timeout=4.0)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def close(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy is not started"
        return self._session

    def app(self) -> web.Application:
        app = web.Application()
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, _: web.Request) -> web.Response:
        decode = self.config.pick()[1]
        async with self.session.get(f"{decode}/v1/models") as response:
            return web.Response(body=await response.read(), status=response.status, content_type="application/json")

    async def _post(self, url: str, body: dict[str, Any], request_id: str) -> aiohttp.ClientResponse:
        """POST a leg. A connection error before any answer is retried once: a pooled keep-alive
        connection the engine closed meanwhile (its idle timeout, or a restart on the same port) is
        reset at first use, and the request never reached the engine."""
        for attempt in (1, 2):
            try:
                return await self.session.post(url, json=body, headers={"X-Request-Id": request_id})
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt == 2:
                    raise
                log.info("request %s to %s: %r; retrying on a fresh connection", request_id, url, exc)
        raise AssertionError("unreachable")

    async def _post_json(self, url: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        async with await self._post(url, body, request_id) as response:
            payload = await response.read()
            if response.status != 200:
                raise LegError(response.status, payload)
            result: dict[str, Any] = json.loads(payload)
            return result

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        path = request.path
        conversation_id = take_conversation_id(body)
        prefill, decode = self.config.pick()
        transfer_id = uuid.uuid4().hex
        request_id = request.headers.get("X-Request-Id") or f"pd-{transfer_id}"
        mode = self.config.mode
        prefill_leg = prefill_body(body, transfer_id, mode, conversation_id)
        try:
            if self.config.concurrent:
                return await self._concurrent(
                    request, body, prefill, decode, path, transfer_id, request_id, prefill_leg, conversation_id
                )
            answer = await self._post_json(f"{prefill.url}{path}", prefill_leg, request_id)
            params = answer.get("kv_transfer_params")
            if params:
                params.setdefault("transfer_id", transfer_id)
                if mode == "push":
                    # The decoder's blocks are written by P: it names none of P's (as vLLM's push proxy).
                    params.pop("remote_block_ids", None)
            else:
                log.warning("prefill %s returned no kv_transfer_params; the decoder computes the prompt", prefill.url)
            leg = decode_body(body, params, conversation_id)
            return await self._decode(request, f"{decode}{path}", leg, request_id)
        except LegError as exc:
            return web.Response(body=exc.body, status=exc.status, content_type="application/json")
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("request %s failed: %r", request_id, exc)
            return web.json_response({"error": f"upstream failure: {exc!r}"}, status=502)

    async def _concurrent(
        self,
        request: web.Request,
        body: dict[str, Any],
        prefill: Prefill,
        decode: str,
        path: str,
        transfer_id: str,
        request_id: str,
        prefill_leg: dict[str, Any],
        conversation_id: str,
    ) -> web.StreamResponse:
        decode_leg = decode_body(body, concurrent_push_params(prefill, transfer_id), conversation_id)
        # The decode leg starts first so its blocks are registered when P finishes; it cannot
        # produce a token before P's KV arrived, so nothing reaches the client before P answered.
        ready = asyncio.Event()
        decoding = asyncio.ensure_future(self._decode(request, f"{decode}{path}", decode_leg, request_id, ready))
        try:
            await self._post_json(f"{prefill.url}{path}", prefill_leg, request_id)
        except (LegError, aiohttp.ClientError, TimeoutError) as exc:
            if ready.is_set():
                log.warning("prefill leg of %s failed after decoding started: %r", request_id, exc)
                return await decoding
            log.warning("prefill leg of %s failed (%r); the decoder computes the prompt", request_id, exc)
            decoding.cancel()  # closes the connection: vLLM aborts it, the sidecar releases it
            await asyncio.gather(decoding, return_exceptions=True)
            plain = decode_body(body, None, conversation_id)
            return await self._decode(request, f"{decode}{path}", plain, request_id)
        return await decoding

    async def _decode(
        self,
        request: web.Request,
        url: str,
        body: dict[str, Any],
        request_id: str,
        started: asyncio.Event | None = None,
    ) -> web.StreamResponse:
        async with await self._post(url, body, request_id) as response:
            if not body.get("stream"):
                payload = await response.read()
                if started is not None:
                    started.set()
                return web.Response(body=payload, status=response.status, content_type="application/json")
            first = await response.content.readany()
            if started is not None:
                started.set()
            stream = web.StreamResponse(status=response.status, headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            if first:
                await stream.write(first)
            async for chunk in response.content.iter_any():
                await stream.write(chunk)
            await stream.write_eof()
            return stream


def _prefills(urls: list[str], kv: list[str]) -> list[Prefill]:
    if kv and len(kv) != len(urls):
        raise SystemExit("give one --prefill-kv per --prefill, in the same order")
    result = []
    for index, url in enumerate(urls):
        engine_id, sidecar = "", ""
        if kv:
            engine_id, _, sidecar = kv[index].partition("@")
        result.append(Prefill(url.rstrip("/"), engine_id, sidecar))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--prefill", action="append", required=True, help="prefill engine base URL (repeatable)")
    parser.add_argument("--decode", action="append", required=True, help="decode engine base URL (repeatable)")
    parser.add_argument(
        "--prefill-kv",
        action="append",
        default=[],
        metavar="ENGINE_ID@HOST:PORT",
        help="per --prefill: its engine_id and its sidecar's peer address (needed by --concurrent)",
    )
    parser.add_argument("--mode", choices=["pull", "push"], default="pull")
    parser.add_argument("--concurrent", action="store_true", help="push: dispatch both legs at once")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on one leg, seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = ProxyConfig(
        prefill=_prefills(args.prefill, args.prefill_kv),
        decode=[url.rstrip("/") for url in args.decode],
        mode=args.mode,
        concurrent=args.concurrent,
        timeout=args.timeout,
    )
    web.run_app(Proxy(config).app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
