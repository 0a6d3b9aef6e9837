"""The floor under kvsidecar's control path on this machine: what one hop of each kind costs with
nothing else in it, measured the way the sidecar makes it (Python 3.11, grpcio aio, no sidecar
code).

- ``unary sync->aio``: a blocking grpc client (the engine shim, the benchmark's simulated engine)
  calls a grpc.aio server in another process over loopback TCP and gets a 30-byte answer.
- ``unary aio->aio``: the same from a grpc.aio client (sidecar -> peer sidecar: heartbeat, PushReg).
- ``bidi aio->aio``: one request and its answer as two messages on a bidirectional stream that
  stays open (what a per-peer heartbeat stream would cost instead of a unary call).
- ``bidi sync->aio``: the same from a blocking client (what an engine <-> sidecar session stream
  would cost the shim instead of a unary call): requests from a queue-fed iterator, which grpc
  sends from a thread of its own, answers read by the calling thread.
- ``stream aio->sync``: a grpc.aio server-streaming call delivers one message to a blocking client's
  reading thread (an event on ``WatchEvents``): from the server's write to the client's receipt.
- ``loop->thread->loop``: an asyncio coroutine hands a command to a thread blocked on a
  ``queue.SimpleQueue`` and awaits its ``concurrent.futures.Future`` (the NIXL owner thread's
  hand-off, without NIXL).
- ``thread->loop``: ``loop.call_soon_threadsafe`` from a thread until the callback runs (a NIXL
  notification reaching the loop).

Each figure is the median over ``--count`` sequential round trips after a warm-up.

Then the CPU each hop costs, per call, in the server process and in the caller, back to back and
paced at ``--rate`` calls/s (the control rows' rate): ``unary sync->aio``, ``bidi sync->aio`` and,
under both, a plain asyncio TCP echo (``socket sync->asyncio``: no gRPC). Paced calls find every
thread asleep and its caches cold, which is what a request at 100/s pays; back to back they do not.

    python -m bench.grpc_floor [--count 2000] [--rate 100] [--cpu-count 300]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import multiprocessing.synchronize
import queue
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable

import grpc
import psutil  # type: ignore[import-untyped]

_ECHO = "/floor.Floor/Echo"
_STREAM = "/floor.Floor/Stream"
_BIDI = "/floor.Floor/Bidi"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(port: int, socket_port: int, ready: multiprocessing.synchronize.Event, count: int) -> None:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        # One message per 2 ms, stamped with the wall clock at the write.
        for _ in range(count + 50):
            await asyncio.sleep(0.002)
            yield struct.pack("d", time.time())

    async def bidi(requests, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        async for request in requests:
            yield request

    async def echo_socket(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(64):
            writer.write(data)
            await writer.drain()

    async def main() -> None:
        plain = await asyncio.start_server(echo_socket, "127.0.0.1", socket_port)
        server = grpc.aio.server()
        handlers = {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", handlers),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        async with plain:
            await server.wait_for_termination()

    asyncio.run(main())


def _ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"p50 {statistics.median(samples) * 1000:.3f} ms, p99 {p99 * 1000:.3f} ms"


def unary_sync(target: str, count: int) -> list[float]:
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(_ECHO)
        payload = b"x" * 30
        samples = []
        for index in range(count + 100):
            started = time.perf_counter()
            call(payload, timeout=5)
            if index >= 100:
                samples.append(time.perf_counter() - started)
        return samples


def unary_aio(target: str, count: int) -> list[float]:
    async def main() -> list[float]:
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.unary_unary(_ECHO)
            samples = []
            for index in range(count + 100):
                started = time.perf_counter()
                await call(b"x" * 30, timeout=5)
                if index >= 100:
                    samples.append(time.perf_counter() - started)
            return samples

    return asyncio.run(main())


def bidi_aio(target: str, count: int) -> list[float]:
    async def main() -> list[float]:
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.stream_stream(_BIDI)()
            samples = []
            for index in range(count + 100):
                started = time.perf_counter()
                await call.write(b"x" * 30)
                await call.read()
                if index >= 100:
                    samples.append(time.perf_counter() - started)
            await call.done_writing()
            return samples

    return asyncio.run(main())


def bidi_sync(target: str, count: int) -> list[float]:
    outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def requests():  # type: ignore[no-untyped-def]
        while (message := outgoing.get()) is not None:
            yield message

    with grpc.insecure_channel(target) as channel:
        answers = channel.stream_stream(_BIDI)(requests())
        samples = []
        for index in range(count + 100):
            started = time.perf_counter()
            outgoing.put(b"x" * 30)
            next(answers)
            if index >= 100:
                samples.append(time.perf_counter() - started)
        outgoing.put(None)
        return samples


def stream_sync(target: str, count: int) -> list[float]:
    with grpc.insecure_channel(target) as channel:
        samples = []
        for index, message in enumerate(channel.unary_stream(_STREAM)(b"", timeout=60)):
            received = time.time()
            if index >= 50:
                samples.append(received - struct.unpack("d", message)[0])
            if len(samples) >= count:
                break
        return samples


def thread_handoff(count: int) -> list[float]:
    commands: queue.SimpleQueue[concurrent.futures.Future[None] | None] = queue.SimpleQueue()

    def owner() -> None:
        while (future := commands.get()) is not None:
            future.set_result(None)

    thread = threading.Thread(target=owner, daemon=True)
    thread.start()

    async def main() -> list[float]:
        samples = []
        for index in range(count + 100):
            await asyncio.sleep(0.0005)  # the owner thread is asleep on its queue, as between requests
            future: concurrent.futures.Future[None] = concurrent.futures.Future()
            started = time.perf_counter()
            commands.put(future)
            await asyncio.wrap_future(future)
            if index >= 100:
                samples.append(time.perf_counter() - started)
        return samples

    samples = asyncio.run(main())
    commands.put(None)
    thread.join(5)
    return samples


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def cpu_per_call(server: psutil.Process, call: Callable[[], object], rate: float, count: int) -> tuple[float, float]:
    """(server, caller) CPU ms per ``call()``, ``count`` calls back to back (``rate`` 0) or paced
    at ``rate`` per second, after a warm-up."""
    for _ in range(100):
        call()
    caller = psutil.Process()
    server_before, own_before = _cpu_s(server), _cpu_s(caller)
    for _ in range(count):
        call()
        if rate:
            time.sleep(1.0 / rate)
    return (
        (_cpu_s(server) - server_before) / count * 1000,
        (_cpu_s(caller) - own_before) / count * 1000,
    )


def cpu_rows(target: str, socket_port: int, server: psutil.Process, rate: float, count: int) -> None:
    payload = b"x" * 30
    outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def requests():  # type: ignore[no-untyped-def]
        while (message := outgoing.get()) is not None:
            yield message

    with grpc.insecure_channel(target) as channel, socket.create_connection(("127.0.0.1", socket_port)) as plain:
        unary = channel.unary_unary(_ECHO)
        answers = channel.stream_stream(_BIDI)(requests())

        def bidi() -> None:
            outgoing.put(payload)
            next(answers)

        def echo_socket() -> None:
            plain.sendall(payload)
            plain.recv(64)

        hops = {
            "unary sync->aio": lambda: unary(payload, timeout=5),
            "bidi sync->aio": bidi,
            "socket sync->asyncio": echo_socket,
        }
        print(f"CPU ms per call (server / caller), {count} calls: back to back | paced at {rate:g}/s")
        for name, call in hops.items():
            tight = cpu_per_call(server, call, 0.0, count)
            paced = cpu_per_call(server, call, rate, count)
            print(f"{name:<20} {tight[0]:.2f} / {tight[1]:.2f} | {paced[0]:.2f} / {paced[1]:.2f}")
        outgoing.put(None)


def _fire(loop: asyncio.AbstractEventLoop, done: asyncio.Future[float]) -> None:
    time.sleep(0.0005)  # the loop is idle in epoll when the call comes
    sent = time.perf_counter()
    loop.call_soon_threadsafe(lambda: done.set_result(time.perf_counter() - sent))


def loop_wake(count: int) -> list[float]:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        samples = []
        for index in range(count + 100):
            done: asyncio.Future[float] = loop.create_future()
            threading.Thread(target=_fire, args=(loop, done)).start()
            elapsed = await done
            if index >= 100:
                samples.append(elapsed)
        return samples

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=100.0, help="calls/s of the paced CPU rows")
    parser.add_argument("--cpu-count", type=int, default=300, help="calls per CPU row")
    args = parser.parse_args()
    port, socket_port = _free_port(), _free_port()
    ready = multiprocessing.get_context("spawn").Event()
    server = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(port, socket_port, ready, args.count), daemon=True
    )
    server.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the echo server did not start")
        target = f"127.0.0.1:{port}"
        print(f"unary sync->aio      {_ms(unary_sync(target, args.count))}")
        print(f"unary aio->aio       {_ms(unary_aio(target, args.count))}")
        print(f"bidi aio->aio        {_ms(bidi_aio(target, args.count))}")
        print(f"bidi sync->aio       {_ms(bidi_sync(target, args.count))}")
        print(f"stream aio->sync     {_ms(stream_sync(target, args.count))}")
        print(f"loop->thread->loop   {_ms(thread_handoff(args.count))}")
        print(f"thread->loop         {_ms(loop_wake(args.count))}")
        cpu_rows(target, socket_port, psutil.Process(server.pid), args.rate, args.cpu_count)
    finally:
        server.terminate()
        server.join(10)


if __name__ == "__main__":
    main()
