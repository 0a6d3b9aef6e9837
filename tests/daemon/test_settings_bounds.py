"""Small things an operator meets from outside: every duration setting has a sane range, hints
name only flags and settings that exist, and a sidecar that is still starting is not reported as
a problem on every readiness poll."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.app.cli import _SERVE_FLAGS, build_parser
from sidecar.config import ConfigError, NixlSettings, Settings, load_settings, setting_names
from sidecar.tools.launcher import DaemonProcess
from tests.support.processes import python_env

# Every duration setting, with a value below its floor and one above its ceiling.
DURATIONS = {
    "lease_seconds": (0.01, 90000),
    "heartbeat_interval_seconds": (0.0001, 3601),
    "producer_unknown_grace_seconds": (0.001, 601),
    "voucher_seconds": (0.001, 3601),
    "voucher_clock_skew_seconds": (0.0001, 601),
    "engine_arrival_wait_seconds": (0.001, 601),
    "push_registration_timeout_seconds": (0.01, 90000),
    "transfer_timeout_seconds": (0.01, 3601),
    "hold_ttl_seconds": (0.01, 90000),
    "peer_call_timeout_seconds": (0.01, 601),
    "worker_attach_timeout_seconds": (0.01, 3601),
    "shutdown_grace_seconds": (0.001, 3601),
    "admission_max_queue_delay_ms": (0.5, 60001),
    "nixl.poll_interval_max_ms": (0.001, 101),
    "nixl.probe_interval_seconds": (0.001, 3601),
    "nixl.stall_seconds": (0.01, 90000),
}


def _override(name: str, value: object) -> dict[str, object]:
    group, _, inner = name.rpartition(".")
    return {group: {inner: value}} if group else {name: value}


def test_every_duration_setting_is_listed_here() -> None:
    """A new *_seconds / *_ms setting must get a range (and a row above)."""
    durations = {name for name in setting_names() if re.search(r"(_seconds|_ms)$", name)}
    assert durations == set(DURATIONS)


@pytest.mark.parametrize("name", sorted(DURATIONS))
def test_a_duration_outside_its_range_is_refused_naming_the_setting_and_the_range(name: str) -> None:
    low, high = DURATIONS[name]
    for value in (low, high, -1.0):
        with pytest.raises(ConfigError) as error:
            load_settings(_override(name, value))
        message = str(error.value)
        assert f"invalid setting {name!r}" in message, message
        assert re.search(r"must be between [0-9.]+ and [0-9.]+ (s|ms)", message), message


def test_a_0_0001_s_heartbeat_interval_is_refused_and_0_still_means_the_default() -> None:
    with pytest.raises(ConfigError) as error:
        load_settings({"heartbeat_interval_seconds": "0.0001"})
    assert "must be between 0.01 and 3600 s, or 0 (lease_seconds / 6)" in str(error.value)
    settings = load_settings({"heartbeat_interval_seconds": 0, "lease_seconds": 6})
    assert settings.heartbeat_interval == 1.0
    # The values the tests and the defaults use stay valid.
    assert load_settings({"heartbeat_interval_seconds": 0.02, "lease_seconds": 0.2}).heartbeat_interval == 0.02
    assert Settings().lease_seconds == 30.0 and NixlSettings().poll_interval_max_ms == 1.0


def test_errors_cite_only_flags_that_exist() -> None:
    flags = {setting: flag for flag, (setting, _, _) in _SERVE_FLAGS.items()}
    real_flags = set(_SERVE_FLAGS) | {"--set", "--config", "--parent-pid"}
    cases = [
        ({"nosuch": "1"}, None),
        ({"lease_secs": "3"}, "'lease_seconds' (--lease-seconds, KVSIDECAR_LEASE_SECONDS)"),
        ({"heartbeat_interval_seconds": "-1"}, "--set heartbeat_interval_seconds=..."),
        ({"nixl": {"stall_second": "3"}}, "'nixl.stall_seconds' (--set nixl.stall_seconds=..."),
        ({"lease_seconds": "-1"}, "[from --lease-seconds, KVSIDECAR_LEASE_SECONDS]"),
    ]
    for overrides, expected in cases:
        with pytest.raises(ConfigError) as error:
            load_settings(overrides, flags=flags)
        message = str(error.value)
        cited = set(re.findall(r"--[a-z][a-z-]*", message))
        assert cited <= real_flags, (message, cited - real_flags)
        if expected is not None:
            assert expected in message
    with pytest.raises(ConfigError) as error:
        load_settings({"nosuch": "1"}, flags=flags)
    assert str(error.value) == "unknown setting 'nosuch' (got '1') [from --set nosuch=...]"


def test_every_serve_flag_names_a_real_setting() -> None:
    assert {setting for setting, _, _ in _SERVE_FLAGS.values()} <= set(setting_names())
    parser_flags = {
        option for action in build_parser()._subparsers._group_actions[0].choices["serve"]._actions  # type: ignore[union-attr]
        for option in action.option_strings
    }  # fmt: skip
    assert set(_SERVE_FLAGS) <= parser_flags


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar.app.cli", "serve", "--engine-socket", "/nonexistent/kvs.sock", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=python_env(),
    )


def test_the_cli_suggests_real_flags_for_mistyped_ones() -> None:
    result = _serve("--lease-secs", "3")
    assert result.returncode == 2 and "(did you mean --lease-seconds?)" in result.stderr
    result = _serve("--heartbeat-interval-seconds", "1")
    assert result.returncode == 2
    assert "no flag --heartbeat-interval-seconds; use --set heartbeat_interval_seconds=VALUE" in result.stderr
    result = _serve("--set", "heartbeat_interval_seconds=0.0001")
    assert result.returncode == 2
    assert "'heartbeat_interval_seconds'" in result.stderr and "between 0.01 and 3600 s" in result.stderr
    assert "--heartbeat-interval-seconds" not in result.stderr
    result = _serve("--set", "lease_secs=3")
    assert result.returncode == 2 and "--lease-secs" not in result.stderr
    assert "did you mean 'lease_seconds' (--lease-seconds," in result.stderr


def _stale_socket(path: Path) -> None:
    """A socket file nobody listens on: what a killed sidecar leaves (connections are refused)."""
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))


def test_a_starting_sidecar_is_not_a_warning_on_every_readiness_poll(
    workdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = DaemonProcess(workdir, "restarting")
    # As on a restart: the sockets of the sidecar before are still there while this one starts.
    _stale_socket(daemon.socket)
    _stale_socket(Path(f"{daemon.socket}.auth"))
    caplog.set_level(logging.DEBUG)
    try:
        daemon.start(timeout=60.0)
    finally:
        daemon.kill()
    refused = [r for r in caplog.records if "no session token" in r.getMessage()]
    assert refused, "the stale sockets were not polled (nothing tested)"
    assert all(r.levelno == logging.DEBUG for r in refused), [(r.levelname, r.getMessage()) for r in refused]


def test_a_sidecar_not_ready_within_the_bound_is_one_warning_with_the_reason(
    workdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The "sidecar" waits far longer than the bound before it would start.
    daemon = DaemonProcess(workdir, "slow", wrapper=["sh", "-c", 'sleep 60; exec "$@"', "sh"])
    _stale_socket(daemon.socket)
    _stale_socket(Path(f"{daemon.socket}.auth"))
    caplog.set_level(logging.DEBUG)
    with pytest.raises(TimeoutError, match=r"not ready within 1.5s \(no session token: .*Connection refused"):
        daemon.start(timeout=1.5)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "Connection refused" in warnings[0].getMessage()
    assert daemon.process is not None and daemon.process.poll() is not None  # killed, not left behind
