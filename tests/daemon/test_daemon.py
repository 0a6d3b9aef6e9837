"""Operating the daemon: settings, graceful shutdown, systemd notify, metrics, status, the unit."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvsidecar.engine_auth import auth_socket_for
from tests.support.processes import REPO, SidecarProcess, python_env, wait_until


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar.app.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=python_env(env),
    )


def test_bad_settings_fail_at_start_naming_the_setting(workdir: Path) -> None:
    result = run_cli("serve", "--engine-socket", str(workdir / "s.sock"), "--peer-listen", "no-port")
    assert result.returncode == 2
    assert "peer_listen" in result.stderr and "--peer-listen" in result.stderr
    result = run_cli("serve", "--engine-socket", str(workdir / "s.sock"), env={"KVSIDECAR_LEASE_SECONDS": "-3"})
    assert result.returncode == 2
    assert "lease_seconds" in result.stderr and "KVSIDECAR_LEASE_SECONDS" in result.stderr
    config = workdir / "bad.toml"
    config.write_text("lease_secondz = 4\n")
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2
    assert "lease_secondz" in result.stderr and str(config) in result.stderr


def test_flags_beat_environment_beat_toml(workdir: Path, sidecars) -> None:
    config = workdir / "settings.toml"
    config.write_text("lease_seconds = 11\ntransfer_timeout_seconds = 12\n[nixl]\npoll_interval_max_ms = 3\n")
    sidecar = sidecars(
        args=["--config", str(config), "--lease-seconds", "13"],
        env={"KVSIDECAR_TRANSFER_TIMEOUT_SECONDS": "14", "KVSIDECAR_LEASE_SECONDS": "15"},
    )
    from sidecar.config import load_settings

    os.environ["KVSIDECAR_TRANSFER_TIMEOUT_SECONDS"] = "14"
    try:
        settings = load_settings({"lease_seconds": 13}, config)
    finally:
        del os.environ["KVSIDECAR_TRANSFER_TIMEOUT_SECONDS"]
    assert (settings.lease_seconds, settings.transfer_timeout_seconds, settings.nixl.poll_interval_max_ms) == (
        13,
        14,
        3,
    )
    assert sidecar.process is not None and sidecar.process.poll() is None


def test_sigterm_exits_zero_within_grace_and_removes_the_socket(sidecars) -> None:
    sidecar = sidecars(args=["--shutdown-grace-seconds", "3"])
    assert sidecar.socket.exists()
    assert oct(sidecar.socket.stat().st_mode & 0o777) == "0o600"
    started = time.monotonic()
    assert sidecar.terminate(timeout=10) == 0
    assert time.monotonic() - started < 3 + 2
    assert not sidecar.socket.exists()
    assert not auth_socket_for(sidecar.socket).exists()  # the credential socket goes with it
    assert any(event.get("event") == "sidecar_stopped" for event in sidecar.log_events())


def test_systemd_notify_ready_watchdog_stopping_in_order(workdir: Path) -> None:
    notify_path = workdir / "notify.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(notify_path))
    receiver.settimeout(0.2)
    sidecar = SidecarProcess(workdir, env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "400000"})
    try:
        sidecar.start()
        messages: list[str] = []

        def collect() -> list[str]:
            try:
                while True:
                    messages.append(receiver.recv(4096).decode())
            except TimeoutError:
                pass
            return messages

        wait_until(lambda: any("WATCHDOG=1" in m for m in collect()), 10, what="a WATCHDOG=1 ping")
        assert sidecar.terminate(timeout=15) == 0
        collect()
    finally:
        sidecar.kill()
        receiver.close()
    kinds = [m.splitlines()[0] for m in messages]
    assert kinds[0] == "READY=1", kinds
    assert "WATCHDOG=1" in kinds
    assert kinds[-1] == "STOPPING=1", kinds
    assert kinds.index("WATCHDOG=1") < kinds.index("STOPPING=1")


def test_no_notify_socket_means_no_notifications(workdir: Path, sidecars) -> None:
    # Nothing to observe but that it starts and serves without NOTIFY_SOCKET.
    sidecar = sidecars(env={"NOTIFY_SOCKET": ""})
    assert sidecar.process is not None and sidecar.process.poll() is None


def test_metrics_endpoint_has_build_info_and_rpc_counts(workdir: Path) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    # The later flag wins over SidecarProcess's default "--metrics-listen off".
    sidecar = SidecarProcess(workdir, args=["--metrics-listen", f"127.0.0.1:{port}"])
    try:
        sidecar.start()
        result = run_cli("status", "--socket", str(sidecar.socket))
        assert result.returncode == 0, result.stderr
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        sidecar.kill()
    assert "kvsidecar_build_info{" in body and 'nixl="nixl-cu12' in body and "grpc=" in body
    counted = re.search(
        r'kvsidecar_rpc_requests_total\{code="OK",method="GetStatus",service="EngineService"\} (\d+)', body
    )
    assert counted is not None and int(counted.group(1)) >= 1, body
    assert "kvsidecar_rpc_duration_seconds_bucket" in body
    assert "request_id" not in body


def test_status_prints_a_table_and_json(sidecars) -> None:
    sidecar = sidecars()
    table = run_cli("status", "--socket", str(sidecar.socket))
    assert table.returncode == 0, table.stderr
    assert "ENGINES" in table.stdout and "PEERS" in table.stdout and sidecar.address in table.stdout
    as_json = run_cli("status", "--socket", str(sidecar.socket), "--json")
    data = json.loads(as_json.stdout)
    assert data["sidecar"]["sidecar_id"] == sidecar.sidecar_id
    missing = run_cli("status", "--socket", str(sidecar.workdir / "nobody.sock"), "--timeout", "1")
    assert missing.returncode == 1 and "no sidecar answered" in missing.stderr


def test_a_second_daemon_refuses_a_live_socket_and_replaces_a_stale_one(workdir: Path, sidecars) -> None:
    first = sidecars(name="first")
    clash = run_cli(
        "serve",
        "--engine-socket",
        str(first.socket),
        "--peer-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "off",
        timeout=60,
    )
    assert clash.returncode == 1
    assert "already serves the engine socket" in clash.stderr
    first.kill()  # SIGKILL leaves the socket file behind
    assert first.socket.exists()
    again = sidecars(name="first")
    assert again.process is not None and again.process.poll() is None


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_verifies() -> None:
    unit = REPO / "systemd" / "kvsidecar.service"
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    text = unit.read_text()
    for line in (
        "Type=notify",
        "WatchdogSec=",
        "EnvironmentFile=",
        "ReadWritePaths=/dev/shm /run/kvsidecar",
        "LimitRTPRIO=",
        "CPUWeight=",
    ):
        assert line in text


def test_kubernetes_pod_shares_socket_dir_and_dev_shm_and_probes_health() -> None:
    import yaml

    pod = yaml.safe_load((REPO / "deploy" / "kubernetes" / "pod.yaml").read_text())
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    containers = {container["name"]: container for container in pod["spec"]["containers"]}
    sidecar = containers["kvsidecar"]
    for container in containers.values():
        mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
        assert {"/dev/shm", "/run/kvsidecar"} <= mounts
    assert any(port.get("name") == "kv-peer" for port in sidecar["ports"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["grpc"]["port"] == 50151


def test_every_settings_source_is_validated_the_same_and_exits_2(workdir: Path) -> None:
    socket_arg = ["--engine-socket", str(workdir / "s.sock"), "--peer-listen", "127.0.0.1:0", "--metrics-listen", "off"]
    config = workdir / "c.toml"
    cases: list[tuple[list[str], dict[str, str], str, str]] = [
        (["--config", str(config)], {}, '[nixl]\nbackends = ["NOPE"]\n', "NOPE"),
        (["--config", str(config)], {}, "[nixl]\nbackends = []\n", "nixl.backends"),
        (["--config", str(config)], {}, 'shm_dirs = ["/nonexistent"]\n', "/nonexistent"),
        ([], {"KVSIDECAR_NIXL__BACKENDS": "NOPE"}, "", "NOPE"),
        (["--set", "x"], {}, "", "NAME=VALUE"),
        (["--lease-seconds", "nan"], {}, "", "is not a number"),
        (["--set", "peer_tls_cert=/etc/hostname"], {}, "", "peer_tls_key, peer_tls_ca"),
        (["--config", str(workdir)], {}, "", "is a directory"),
        (["--set", "engine_socket_mode=0777"], {}, "", "a socket mode gives read/write only"),
        (["--set", "engine_socket_mode=rw"], {}, "", "is not an octal file mode"),
        ([], {"KVSIDECAR_ENGINE_ALLOWED_UIDS": "1000,x"}, "", "engine_allowed_uids"),
    ]
    for args, env, toml, expected in cases:
        config.write_text(toml)
        result = run_cli("serve", *socket_arg, *args, env=env)
        assert result.returncode == 2, (args, env, toml, result.stderr[-2000:])
        assert expected in result.stderr, (args, result.stderr[-2000:])
        assert "Traceback" not in result.stderr


def test_an_unknown_environment_variable_is_logged_with_the_closest_setting(sidecars) -> None:
    sidecar = sidecars(env={"KVSIDECAR_LEASE_SECOND": "5"}, args=["--set", "shm_dirs=/dev/shm,/tmp"])
    warnings = [event for event in sidecar.log_events() if event.get("event") == "unknown_environment_variable"]
    assert [(w["variable"], w["closest_setting"]) for w in warnings] == [
        ("KVSIDECAR_LEASE_SECOND", "KVSIDECAR_LEASE_SECONDS")
    ]
