"""Pure validation logic: peer addresses, block id lists, the descriptor math's last line of
defence, the producer's check of a pull's block ids, and settings from every source."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.v1 import common_pb2
from sidecar.config import ConfigError, load_settings, unknown_env_variables
from sidecar.core.validation import address, address_problem, block_ids
from sidecar.dataplane.plan.blocks import foreign_block_ids
from sidecar.dataplane.plan.descriptors import descriptor_indices
from sidecar.dataplane.plan.layout import PlanError, RegionLayout, WorkerLayout
from sidecar.errors import InvalidArgument


@pytest.mark.parametrize(
    "value",
    ["127.0.0.1:0", "127.0.0.1:65536", "nohostport", ":1", "127.0.0.1:", "[::1", "::1:5", "[zz]:1", "a b:1",
     "-x:1", "127.0.0.1:+5", "127.0.0.1:\u0663", "h:1:2"],
)  # fmt: skip
def test_bad_addresses_have_a_reason(value: str) -> None:
    assert address_problem(value)
    with pytest.raises(InvalidArgument, match=r"^remote\.address: "):
        address(value, "remote.address")


@pytest.mark.parametrize("value", ["127.0.0.1:1", "[::1]:65535", "localhost:50151", "p-0.pods.local:9"])
def test_good_addresses_pass(value: str) -> None:
    assert address_problem(value) is None


def test_block_ids_refuse_a_block_named_twice() -> None:
    message = common_pb2.GroupedBlockIds(
        groups=[common_pb2.BlockIdList(ids=[1, 2]), common_pb2.BlockIdList(ids=[5, 5])]
    )
    with pytest.raises(InvalidArgument, match=r"^block_ids: group 1: block id 5 is listed twice"):
        block_ids(message, "block_ids", 100)


def _layout(num_blocks: int, physical_per_logical: int = 1) -> WorkerLayout:
    regions = tuple(RegionLayout(f"l{i}", 1 << 20 * (i + 1), 64, 64, 0) for i in range(2))
    return WorkerLayout(0, 0, regions, num_blocks, physical_per_logical, 16, "NHD", 1, 1, False)


def test_descriptors_never_leave_the_named_blocks() -> None:
    layout = _layout(8)
    assert list(descriptor_indices(layout, ((7, 0),))) == [7, 0, 15, 8]
    # Block 8 would select region 1's block 0; 2**32-1 would wrap in int32.
    for bad in (((8,),), ((2**32 - 1,),), ((3, 3),)):
        with pytest.raises(PlanError):
            descriptor_indices(layout, bad)
    with pytest.raises(PlanError, match="out of range"):
        descriptor_indices(_layout(8, physical_per_logical=2), ((4,),))


def test_foreign_block_ids_are_those_not_submitted_for_the_request() -> None:
    submitted = ((1, 2, 3), (7,))
    assert foreign_block_ids(((2, 3),), submitted) is None
    assert foreign_block_ids(((), (7,)), submitted) is None
    assert "block 40" in (foreign_block_ids(((40, 1),), submitted) or "")
    assert "block 1 " in (foreign_block_ids(((1,), (1,)), submitted) or "")
    assert "groups" in (foreign_block_ids(((1,), (7,), (9,)), submitted) or "")


def test_list_settings_from_the_environment_and_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSIDECAR_NIXL__BACKENDS", "UCX")
    assert load_settings().nixl.backends == ["UCX"]
    monkeypatch.setenv("KVSIDECAR_NIXL__BACKENDS", '["UCX", "POSIX"]')
    assert load_settings().nixl.backends == ["UCX", "POSIX"]
    monkeypatch.delenv("KVSIDECAR_NIXL__BACKENDS")
    settings = load_settings({"shm_dirs": f"/dev/shm,{tmp_path}", "nixl": {"backends": "UCX,POSIX"}})
    assert settings.shm_dirs == [Path("/dev/shm"), tmp_path] and settings.nixl.backends == ["UCX", "POSIX"]


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[nixl]\nbackends = []\n", "nixl.backends"),
        ('shm_dirs = ["/nonexistent"]\n', "/nonexistent is not an existing directory"),
        ("shm_dirs = []\n", "shm_dirs"),
        ("lease_seconds = nan\n", "is not a number"),
    ],
)
def test_a_config_file_is_validated_like_flags(tmp_path: Path, toml: str, expected: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(toml)
    with pytest.raises(ConfigError, match=expected):
        load_settings(None, config)


def test_config_errors_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"lease_seconds.*is not a number"):
        load_settings({"lease_seconds": "nan"})
    with pytest.raises(ConfigError) as error:
        load_settings({"peer_tls_cert": "/etc/hostname"})
    assert "peer_tls_key, peer_tls_ca" in str(error.value) and "'settings'" not in str(error.value)
    with pytest.raises(ConfigError, match="is a directory"):
        load_settings(None, tmp_path)


def test_unknown_environment_variables_are_found_with_the_closest_setting() -> None:
    found = unknown_env_variables(
        {"KVSIDECAR_LEASE_SECOND": "5", "KVSIDECAR_LEASE_SECONDS": "5", "KVSIDECAR_CONFIG": "x", "PATH": "/bin",
         "KVSIDECAR_NIXL__BACKEND": "UCX"}
    )  # fmt: skip
    assert found == [
        ("KVSIDECAR_LEASE_SECOND", "KVSIDECAR_LEASE_SECONDS"),
        ("KVSIDECAR_NIXL__BACKEND", "KVSIDECAR_NIXL__BACKENDS"),
    ]
