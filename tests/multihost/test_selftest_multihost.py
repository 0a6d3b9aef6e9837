"""`kvsidecar selftest --peer` between two hosts (network namespaces on one bridge, UCX restricted
to TCP on each host's interface): run on host a against b's sidecar by its DNS name, KV moves
both ways in pull and push, verified, and the bytes provably cross b's network interface; with
b's link down the command names b unreachable."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.multihost.conftest import PEER_PORT, Cluster
from tests.multihost.netns import UCX_ENV
from tests.support.processes import python_env

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

REQUESTS, BLOCKS, BLOCK_KIB, LAYERS = 2, 8, 64, 2


def selftest(net: Cluster, peer: str) -> subprocess.CompletedProcess[str]:
    """The command on host a, with a's settings (its engine socket, UCX as its sidecar's)."""
    command = [
        *net["a"].prefix, sys.executable, "-m", "sidecar.app.cli", "selftest", "--peer", peer,
        "--socket", str(net.sidecars["a"].socket), "--requests", str(REQUESTS), "--blocks", str(BLOCKS),
        "--block-kib", str(BLOCK_KIB), "--timeout", "5",
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=python_env(dict(UCX_ENV)))


def test_selftest_across_hosts_moves_verified_kv_both_ways_over_the_wire(cluster) -> None:
    net = cluster(["a", "b"])
    net.sidecar("a")
    net.sidecar("b")
    sent_before = net["b"].bytes_sent()
    result = selftest(net, f"{net.network.fqdn('b')}:{PEER_PORT}")
    print(result.stdout)  # the operator's view (pytest -s)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.split()[:1] in (["pull"], ["push"])]
    assert [row.split()[:2] for row in rows] == [["pull", "B->A"], ["pull", "A->B"], ["push", "B->A"], ["push", "A->B"]]
    assert all("every token verified" in row for row in rows), result.stdout
    assert "UCX_TLS=tcp,self" in result.stdout and "UCX_NET_DEVICES=eth0" in result.stdout
    # B -> A moved 2 cases x REQUESTS x the request's bytes out of b's interface (no shared memory).
    request_bytes = LAYERS * BLOCKS * BLOCK_KIB * 1024
    assert net["b"].bytes_sent() - sent_before >= 2 * REQUESTS * request_bytes


def test_selftest_names_a_peer_host_that_is_unreachable(cluster) -> None:
    net = cluster(["a", "b"])
    net.sidecar("a")
    net.sidecar("b")
    net["b"].link(False)
    try:
        result = selftest(net, f"{net.network.fqdn('b')}:{PEER_PORT}")
    finally:
        net["b"].link(True)
    assert result.returncode == 1
    assert "FAILED:" in result.stdout and "unreachable" in result.stdout, result.stdout
