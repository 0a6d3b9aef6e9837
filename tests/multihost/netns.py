"""Hosts as Linux network namespaces, for tests and benchmarks that must cross a network.

``Network`` creates one "switch" namespace holding a Linux bridge and one namespace per host,
each joined to the bridge by a veth pair created directly inside namespaces we own (no interface
ever appears in the caller's namespace). Each host gets a private address on the bridge
(``10.213.0.<n>/24``, reachable only inside these namespaces), loopback, and an ``/etc/hosts``
that names every host (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over
``/etc/hosts``), so peers can be advertised by DNS name as in a Kubernetes headless service.

Namespace names carry this process's pid and a counter, so concurrent runs never collide; ``close``
(always called, also on failure, and from ``atexit``) deletes the namespaces and their
``/etc/netns`` directories. ``unavailable()`` says why namespaces cannot be made here (not root,
no ``ip``, a kernel or sandbox that forbids ``unshare(CLONE_NEWNET)``), for a clear skip.

UCX between such hosts: the namespaces share the kernel, ``/dev/shm`` and the PID namespace, so
UCX would happily pick shared memory or CMA between them. ``UCX_ENV`` restricts it to TCP on the
host's interface; see tests/multihost/README.md for what that costs.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.0"
# UCX restricted to the network: TCP for data and wire-up, no posix/sysv shared memory, no CMA.
# "self" stays allowed (an agent talking to itself in one process never crosses a host).
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
_counter = itertools.count(1)
_ETC_NETNS = Path("/etc/netns")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """None when network namespaces, veth pairs and bridges work here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = Network(hosts=[])
    try:
        probe.open()
        _ip("-n", probe.switch, "link", "add", "kvsprobe", "type", "bridge")
    except NetnsUnavailable as exc:
        return f"the kernel refuses network namespaces or bridges here: {exc}"
    finally:
        probe.close()
    return None


@dataclass
class Host:
    """One host: its namespace, DNS name and address on the bridge."""

    name: str
    netns: str
    address: str
    index: int

    @property
    def prefix(self) -> list[str]:
        """Command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.netns]

    def run(self, *command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.prefix, *command], capture_output=True, text=True, timeout=30)

    def limit_rate(self, mbit: int | None) -> None:
        """Cap this host's outgoing rate (a token bucket; None removes it), so a transfer lasts long
        enough to be interrupted. (netem is not built into every kernel; tbf is.)"""
        if mbit is None:
            _ip("-n", self.netns, "link", "show", "eth0")  # the interface must exist
            subprocess.run(["tc", "-n", self.netns, "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
            return
        command = ["tc", "-n", self.netns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{mbit}mbit"]
        result = subprocess.run([*command, "burst", "64kb", "latency", "2s"], capture_output=True, text=True)
        if result.returncode != 0:
            raise NetnsUnavailable(f"tc tbf refused: {result.stderr.strip()}")

    def bytes_sent(self) -> int:
        """Bytes this host has sent on its network interface (what crossed the "wire")."""
        result = _ip("-n", self.netns, "-j", "-s", "link", "show", "dev", "eth0")
        return int(json.loads(result.stdout)[0]["stats64"]["tx"]["bytes"])

    def link(self, up: bool) -> None:
        """Bring this host's network interface up or down (a pulled cable, seen from both ends)."""
        _ip("-n", self.netns, "link", "set", "eth0", "up" if up else "down")


@dataclass
class Network:
    """A bridge and ``hosts`` (DNS names) on it. Use as a context manager, or ``open``/``close``."""

    hosts: list[str]
    domain: str = "kvs.test"
    tag: str = field(default_factory=lambda: f"kvs{os.getpid()}n{next(_counter)}")
    by_name: dict[str, Host] = field(default_factory=dict)
    _made: list[str] = field(default_factory=list)
    _made_etc_netns: bool = False

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def __enter__(self) -> Network:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def open(self) -> None:
        atexit.register(self.close)
        self._add_netns(self.switch)
        if not self.hosts:
            return
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for index, name in enumerate(self.hosts, start=2):
            netns = f"{self.tag}-{index}"
            self._add_netns(netns)
            port = f"p{index}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            address = f"{SUBNET}.{index}"
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            self.by_name[name] = Host(name, netns, address, index)
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{host.address} {host.name}.{self.domain} {host.name}" for host in self.by_name.values()]
        self._made_etc_netns = self._made_etc_netns or not _ETC_NETNS.exists()
        for host in self.by_name.values():
            directory = _ETC_NETNS / host.netns
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hosts").write_text("\n".join(lines) + "\n")

    def fqdn(self, name: str) -> str:
        return f"{name}.{self.domain}"

    def __getitem__(self, name: str) -> Host:
        return self.by_name[name]

    def close(self) -> None:
        """Delete every namespace made (their veths and the bridge go with them) and the hosts files.
        Safe to call twice; processes still running in a namespace keep it alive until they exit,
        so callers kill theirs first."""
        while self._made:
            name = self._made.pop()
            _ip("netns", "del", name, check=False)
            shutil.rmtree(_ETC_NETNS / name, ignore_errors=True)
        if self._made_etc_netns:
            try:
                _ETC_NETNS.rmdir()  # only if empty: someone else's entries stay
            except OSError:
                pass
        atexit.unregister(self.close)
