"""The ``kvsidecar`` command: ``serve`` (the daemon), ``status``, ``token``, ``demo``, ``bench``,
``selftest`` (two nodes proved from one).

Subcommands import their heavy modules lazily, so ``kvsidecar status`` starts fast.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from sidecar import __version__

# Flags of `serve` that map one-to-one onto settings (flag name -> (setting, type, help)).
_SERVE_FLAGS: dict[str, tuple[str, type, str]] = {
    "--engine-socket": ("engine_socket", str, "Unix socket of EngineService"),
    "--engine-tcp-listen": ("engine_tcp_listen", str, "optional loopback HOST:PORT for EngineService"),
    "--peer-listen": ("peer_listen", str, "HOST:PORT to bind PeerService (default 127.0.0.1:50151)"),
    "--advertise": ("advertise", str, "HOST:PORT peers use to reach this sidecar"),
    "--metrics-listen": ("metrics_listen", str, "HOST:PORT of the Prometheus endpoint, or 'off'"),
    "--log-format": ("log_format", str, "auto | json | console"),
    "--log-level": ("log_level", str, "debug | info | warning | error"),
    "--lease-seconds": ("lease_seconds", float, "producer lease length"),
    "--push-registration-timeout-seconds": ("push_registration_timeout_seconds", float, "push watchdog"),
    "--transfer-timeout-seconds": ("transfer_timeout_seconds", float, "bound on one pull / one transfer"),
    "--shutdown-grace-seconds": ("shutdown_grace_seconds", float, "graceful shutdown budget"),
    "--hold-ttl-seconds": ("hold_ttl_seconds", float, "default hold time of HoldBlocks (multi-turn)"),
    "--hold-max-share": ("hold_max_share", float, "share of an engine's KV blocks its holds may occupy"),
    "--integrity": ("integrity", str, "off | digest: verify a digest of every received block's content"),
}


def _add_serve(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the daemon",
        description="Run the kvsidecar daemon. Settings: embedded defaults < --config TOML < KVSIDECAR_* "
        "environment variables < flags.",
    )
    parser.add_argument("--config", type=Path, help="TOML settings file (also $KVSIDECAR_CONFIG)")
    for flag, (_, kind, text) in _SERVE_FLAGS.items():
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="shut down when this process (the one starting the daemon) exits; for supervisors other than systemd",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other setting, e.g. --set nixl.poll_interval_max_ms=2 (repeatable)",
    )
    parser.set_defaults(func=_serve)


def _parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set a.b=v`` items as nested overrides; raises ConfigError for one without NAME=."""
    from sidecar.config import ConfigError

    overrides: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        parts = name.split(".")
        if not sep or not all(parts):
            raise ConfigError(f"--set expects NAME=VALUE (e.g. --set nixl.backends=UCX), got {item!r}")
        target = overrides
        for part in parts[:-1]:
            nested = target.setdefault(part, {})
            if not isinstance(nested, dict):
                raise ConfigError(f"--set {name}: {part} is not a group of settings")
            target = nested
        target[parts[-1]] = value
    return overrides


def _check_backends(backends: list[str]) -> None:
    """Raise ConfigError unless NIXL offers every configured backend."""
    from sidecar.config import ConfigError
    from sidecar.dataplane.transport import NixlUnavailable, available_backends

    try:
        offered = available_backends()
    except NixlUnavailable as exc:
        raise ConfigError(str(exc)) from None
    missing = [name for name in backends if name not in offered]
    if missing:
        raise ConfigError(
            f"invalid setting 'nixl.backends' (got {backends!r}): NIXL offers no backend {', '.join(missing)}; "
            f"it offers {', '.join(offered)} [from --set nixl.backends=..., KVSIDECAR_NIXL__BACKENDS or --config]"
        )


def _serve(args: argparse.Namespace) -> int:
    import os

    from sidecar.config import ConfigError, load_settings, unknown_env_variables
    from sidecar.logs import configure_logging, get_logger

    try:
        overrides = _parse_sets(args.set)
        for flag, (setting, _, _) in _SERVE_FLAGS.items():
            value = getattr(args, flag.lstrip("-").replace("-", "_"))
            if value is not None:
                overrides[setting] = value
        flags = {setting: flag for flag, (setting, _, _) in _SERVE_FLAGS.items()}
        settings = load_settings(overrides, args.config, flags)
        _check_backends(settings.nixl.backends)
    except ConfigError as exc:
        print(f"kvsidecar: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    for variable, closest in unknown_env_variables(os.environ):
        # Likely a typo: say so rather than run with the default the operator meant to change.
        get_logger("kvsidecar.config").warning(
            "unknown_environment_variable", variable=variable, closest_setting=closest, hint="no setting reads it"
        )
    from sidecar.app.server import exit_with_parent, serve

    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)

    return asyncio.run(serve(settings))


def _add_status(subparsers: Any) -> None:
    parser = subparsers.add_parser("status", help="show a running sidecar's engines, peers and transfers")
    parser.add_argument("--socket", type=Path, default=None, help="engine socket (default: the serve default)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--requests", action="store_true", help="include per-request detail")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the sidecar")
    parser.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    from sidecar.tools.status_view import fetch_status, render_json, render_tables

    try:
        response = fetch_status(args.socket, args.requests, args.timeout)
    except ConnectionError as exc:
        print(f"kvsidecar: {exc}", file=sys.stderr)
        return 1
    print(render_json(response) if args.json else render_tables(response))
    return 0


def _add_token(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "token",
        help="print a session token for calls on the engine socket by hand",
        description="Ask the sidecar's credential socket (next to the engine socket) for a session token; it "
        "checks this process's uid/gid. Use it as gRPC metadata, e.g. "
        'grpcurl -H "kvsidecar-token: $(kvsidecar token)" -unix PATH kvsidecar.v1.EngineService/GetStatus',
    )
    parser.add_argument("--socket", type=Path, default=None, help="engine socket (default: the serve default)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the sidecar")
    parser.set_defaults(func=_token)


def _token(args: argparse.Namespace) -> int:
    from kvsidecar.engine_auth import auth_socket_for, request_token

    socket_path = args.socket
    if socket_path is None:
        from sidecar.config import load_settings

        socket_path = load_settings().engine_socket
    try:
        print(request_token(auth_socket_for(socket_path), args.timeout))
    except OSError as exc:
        print(f"kvsidecar: no token: {exc}", file=sys.stderr)
        return 1
    return 0


def _add_demo(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="move real KV between two sidecars and verify every byte",
        description="Start a producer and a consumer sidecar on loopback, a simulated engine on each, move a mix "
        "of requests in push and pull mode, verify every byte and print throughput and latency.",
    )
    parser.add_argument("--requests", type=int, default=200, help="requests per mode (default 200)")
    parser.add_argument("--modes", default="push,pull", help="comma-separated: push, pull")
    parser.add_argument("--min-blocks", type=int, default=8)
    parser.add_argument("--max-blocks", type=int, default=256)
    parser.add_argument("--block-kib", type=int, default=64, help="KiB per block, all layers together")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--same-node", action="store_true", help="one sidecar serving both engines")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    # Ctrl-C stops the demo cleanly also when it was started as a shell's background job (or by
    # anything else that left SIGINT ignored, which Python then keeps: no KeyboardInterrupt).
    # Before the heavy import below: a SIGINT that arrives while it is still ignored is discarded,
    # and the demo would run all its requests (that import takes seconds on a loaded machine).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    modes = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
    if not modes or any(mode not in ("push", "pull") for mode in modes):
        print("kvsidecar: --modes takes push and/or pull", file=sys.stderr)
        return 2
    if not 1 <= args.min_blocks <= args.max_blocks:
        print("kvsidecar: need 1 <= --min-blocks <= --max-blocks", file=sys.stderr)
        return 2
    try:
        from sidecar.tools.demo import run_demo

        return run_demo(
            args.requests,
            modes,
            args.min_blocks,
            args.max_blocks,
            args.block_kib,
            args.concurrency,
            args.seed,
            args.same_node,
        )
    except KeyboardInterrupt:
        print("\ninterrupted; sidecars stopped and shared memory removed", file=sys.stderr)
        return 130


def _add_bench(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="kvsidecar push/pull vs raw NIXL vs memcpy, one invocation",
        description="Measure the same transfers through kvsidecar push and pull, raw NIXL in one process and "
        "numpy.copyto; write JSON rows (and a PNG plot).",
    )
    parser.add_argument("--json", type=Path, required=True, help="where to write the rows")
    parser.add_argument("--png", type=Path, default=None, help="also plot GB/s per scenario and path")
    parser.add_argument("--quick", action="store_true", help="a subset that runs in under a minute")
    parser.add_argument(
        "--only",
        default="transfers,control,mixed",
        help="comma-separated sections to run: transfers (paths side by side), control (open-loop 1-block "
        "requests), mixed (small requests behind large ones, split and unsplit NIXL posts); default: all",
    )
    parser.add_argument(
        "--scenarios",
        default="",
        help="comma-separated transfer scenarios to run (e.g. 16KiBx1024-adjacent-c1,1MiBx64-adjacent-c16: "
        "block size x blocks - adjacent|scattered - concurrency); default: all",
    )
    parser.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from sidecar.tools.bench import main_bench

    names = [name for name in args.scenarios.split(",") if name]
    return main_bench(args.json, args.png, args.quick, [name for name in args.only.split(",") if name], names)


def _add_selftest(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "selftest",
        help="prove two nodes: move verified KV both ways through this node's sidecar and a peer's",
        description="Against the sidecar of another node (its peer address): start a test engine on this node's "
        "sidecar, have the peer's sidecar host one, move KV both ways in pull and push mode, verify every token, "
        "and print GB/s and latency per case, or the precise reason it cannot. Uses this node's settings (engine "
        "socket, peer mTLS files) like `kvsidecar serve`. Exit status 0 only if every case passed.",
    )
    parser.add_argument("--peer", required=True, help="HOST:PORT of the other node's sidecar (its peer address)")
    parser.add_argument("--config", type=Path, help="TOML settings file (also $KVSIDECAR_CONFIG)")
    parser.add_argument("--socket", type=Path, default=None, help="this node's engine socket (default: settings)")
    parser.add_argument("--requests", type=int, default=5, help="requests per case (default 5)")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per request (default 16)")
    parser.add_argument("--block-kib", type=int, default=256, help="KiB per block and layer (default 256; 2 layers)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the peer per call")
    parser.set_defaults(func=_selftest)


def _selftest(args: argparse.Namespace) -> int:
    from sidecar.config import split_host_port

    try:
        split_host_port(args.peer, "--peer")
    except ValueError as exc:
        print(f"kvsidecar: {exc}", file=sys.stderr)
        return 2
    if args.requests < 1 or args.blocks < 1 or not 1 <= args.block_kib <= 16384:
        print("kvsidecar: need --requests >= 1, --blocks >= 1 and 1 <= --block-kib <= 16384", file=sys.stderr)
        return 2
    from sidecar.tools.selftest import main_selftest

    return main_selftest(args.peer, args.requests, args.blocks, args.block_kib, args.timeout, args.socket, args.config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsidecar", description="KV-cache transport sidecar for disaggregated LLM serving"
    )
    parser.add_argument("--version", action="version", version=f"kvsidecar {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_serve(subparsers)
    _add_status(subparsers)
    _add_token(subparsers)
    _add_demo(subparsers)
    _add_bench(subparsers)
    _add_selftest(subparsers)
    return parser


def _unknown_flag_hint(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """``unrecognized arguments`` plus the real flag or ``--set`` a mistyped one most resembles."""
    import difflib

    from sidecar.config import setting_names

    message = f"unrecognized arguments: {' '.join(unknown)}"
    flag = next((item.partition("=")[0] for item in unknown if item.startswith("--")), None)
    if flag is None:
        return message
    name = flag[2:].replace("-", "_")
    close_flag = difflib.get_close_matches(flag, [*_SERVE_FLAGS, "--config", "--set", "--parent-pid"], n=1, cutoff=0.75)
    close_setting = difflib.get_close_matches(name, setting_names(), n=1, cutoff=0.75)
    if close_setting and close_setting[0] == name:  # a setting without a flag of its own
        return f"{message} (no flag {flag}; use --set {name}=VALUE)"
    if close_flag:
        return f"{message} (did you mean {close_flag[0]}?)"
    if close_setting:
        return f"{message} (did you mean --set {close_setting[0]}=VALUE?)"
    return message


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(_unknown_flag_hint(parser, unknown))
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
