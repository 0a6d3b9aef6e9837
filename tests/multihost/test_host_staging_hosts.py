"""Host staging between hosts: the initiator's engine keeps its KV in "GPU memory"
(``FakeCudaDriver``, a fake standing in for the GPU) on host d0, the peer's KV is in host memory
behind a real NIXL agent on host p0, and UCX may use only TCP on the hosts' interface
(``UCX_ENV``). Pull and push, byte for byte and across block size and layout, move every byte
through the initiator's pinned pool (its NIXL agent registers no memory of its own) and across
the wire; a GPU copy that never completes fails the request at its deadline. The scenario is
``tests/support/staging_peer.py``, the same as the loopback test in tests/node/test_host_staging.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.multihost.conftest import Cluster
from tests.multihost.netns import UCX_ENV
from tests.support.staging_peer import CASES, check_staged_results, peer_memory, run_pair

pytestmark = [pytest.mark.multihost, pytest.mark.slow]


def test_staged_gpu_kv_crosses_hosts_every_byte(cluster: Callable[[list[str]], Cluster], workdir: Path) -> None:
    hosts = cluster(["p0", "d0"])
    directory = workdir / "staging"
    directory.mkdir()
    sent_before = hosts["p0"].bytes_sent()
    with peer_memory(directory, seed=23):
        run_pair(
            directory, ["initiator", *CASES], dict(UCX_ENV), target_prefix=hosts["p0"].prefix,
            initiator_prefix=hosts["d0"].prefix, timeout=240,
        )  # fmt: skip
    results = json.loads((directory / "results.json").read_text())
    check_staged_results(results)
    pulled = results["pull"]["bytes"] + results["pull-convert"]["bytes"]
    assert hosts["p0"].bytes_sent() - sent_before >= pulled, "the pulled KV did not cross p0's interface"
