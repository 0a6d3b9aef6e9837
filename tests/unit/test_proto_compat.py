"""The proto compatibility check of ``make lint`` (sidecar/tools/proto_compat.py): it passes what
docs/compatibility.md allows and names each thing it forbids, on deliberately broken protos."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.tools.proto_compat import PINNED_COMMIT, CompatError, breaking_changes, compile_protos, export_commit
from tests.support.processes import REPO, python_env

OLD = """
syntax = "proto3";
package demo.v1;
import "google/protobuf/empty.proto";
message Info { string version = 1; uint32 protocol = 2; repeated string tags = 3; Kind kind = 4;
  message Inner { int64 at = 1; } Inner inner = 5; }
enum Kind { KIND_UNSPECIFIED = 0; KIND_PULL = 1; KIND_PUSH = 2; }
message Ask { string name = 1; }
service Peer {
  rpc Hello(Ask) returns (Info);
  rpc Watch(Ask) returns (stream Info);
  rpc Ping(google.protobuf.Empty) returns (google.protobuf.Empty);
}
"""


def _set(tmp_path: Path, name: str, text: str):  # -> FileDescriptorSet
    root = tmp_path / name / "demo" / "v1"
    root.mkdir(parents=True)
    (root / "demo.proto").write_text(text)
    return compile_protos(tmp_path / name)


def _problems(tmp_path: Path, new_text: str) -> list[str]:
    return breaking_changes(_set(tmp_path, "old", OLD), _set(tmp_path, "new", new_text))


COMPATIBLE = {
    "unchanged": OLD,
    "a field added": OLD.replace("Kind kind = 4;", "Kind kind = 4; repeated string features = 6;"),
    "an RPC added": OLD.replace("service Peer {", "service Peer {\n  rpc Selftest(Ask) returns (Info);"),
    "an enum value added": OLD.replace("KIND_PUSH = 2;", "KIND_PUSH = 2; KIND_HOLD = 3;"),
    "a message added": OLD + "\nmessage Extra { bool x = 1; }\n",
    "a field removed, its number reserved": OLD.replace("uint32 protocol = 2;", "reserved 2;"),
    "an enum value removed, reserved": OLD.replace("KIND_PUSH = 2;", "reserved 2;"),
    "a field made proto3 optional": OLD.replace("uint32 protocol = 2;", "optional uint32 protocol = 2;"),
}

BROKEN = {
    "a field removed": (OLD.replace("uint32 protocol = 2;", ""), "field .demo.v1.Info.protocol = 2 removed"),
    "a field renumbered": (
        OLD.replace("uint32 protocol = 2;", "uint32 protocol = 7;"),
        "field .demo.v1.Info.protocol = 2 renumbered to 7",
    ),
    "a field retyped": (
        OLD.replace("uint32 protocol = 2;", "string protocol = 2;"),
        "field .demo.v1.Info.protocol = 2 retyped from uint32 to string",
    ),
    "a field made repeated": (
        OLD.replace("string version = 1;", "repeated string version = 1;"),
        "field .demo.v1.Info.version = 1 changed from singular to repeated",
    ),
    "a field renamed": (
        OLD.replace("string version = 1;", "string release = 1;"),
        "field .demo.v1.Info.version = 1 renamed to 'release'",
    ),
    "a field's message type changed": (
        OLD.replace("Inner inner = 5;", "Ask inner = 5;"),
        "field .demo.v1.Info.inner = 5 retyped from message .demo.v1.Info.Inner to message .demo.v1.Ask",
    ),
    "a nested message's field removed": (OLD.replace("int64 at = 1;", ""), "field .demo.v1.Info.Inner.at = 1"),
    "an enum value removed": (OLD.replace("KIND_PUSH = 2;", ""), "enum value .demo.v1.Kind.KIND_PUSH = 2 removed"),
    "a message renamed": (
        OLD.replace("message Ask", "message Question").replace("(Ask)", "(Question)"),
        "message .demo.v1.Ask removed or renamed",
    ),
    "an RPC removed": (OLD.replace("rpc Hello(Ask) returns (Info);", ""), "rpc .demo.v1.Peer.Hello removed"),
    "an RPC's response changed": (
        OLD.replace("rpc Hello(Ask) returns (Info);", "rpc Hello(Ask) returns (Ask);"),
        "rpc .demo.v1.Peer.Hello changed its signature",
    ),
    "an RPC made unary": (
        OLD.replace("returns (stream Info)", "returns (Info)"),
        "rpc .demo.v1.Peer.Watch changed its signature",
    ),
    "the package renamed": (OLD.replace("package demo.v1;", "package demo.v2;"), "service .demo.v1.Peer removed"),
}


@pytest.mark.parametrize("case", sorted(COMPATIBLE))
def test_compatible_changes_pass(tmp_path: Path, case: str) -> None:
    assert _problems(tmp_path, COMPATIBLE[case]) == []


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_breaking_change_is_named(tmp_path: Path, case: str) -> None:
    new_text, expected = BROKEN[case]
    problems = _problems(tmp_path, new_text)
    assert any(expected in problem for problem in problems), problems


def test_protos_that_do_not_compile_are_an_error_not_a_pass(tmp_path: Path) -> None:
    with pytest.raises(CompatError, match="could not compile"):
        _set(tmp_path, "bad", OLD.replace("Kind kind = 4;", "Nope kind = 4;"))


def test_this_checkout_is_compatible_with_the_pinned_commit() -> None:
    """What `make lint` runs: the exit status is the verdict."""
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.tools.proto_compat", "--against", PINNED_COMMIT],
        capture_output=True, text=True, timeout=120, env=python_env(), cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"changed only compatibly since {PINNED_COMMIT}" in result.stdout


def test_a_commit_missing_from_the_clone_fails_loudly_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(CompatError, match=r"not in the clone .*git fetch"):
        export_commit("0123456789abcdef0123456789abcdef01234567", REPO, tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.tools.proto_compat", "--against", "0123456789abcdef"],
        capture_output=True, text=True, timeout=120, env=python_env(), cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 2 and "cannot check" in result.stderr


def test_the_old_protos_are_taken_from_git_not_the_working_tree(tmp_path: Path) -> None:
    exported = export_commit(PINNED_COMMIT, REPO, tmp_path)
    old_peer = (exported / "kvsidecar" / "v1" / "peer.proto").read_text()
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{PINNED_COMMIT}:proto/kvsidecar/v1/peer.proto"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert old_peer == shown
    assert "features" not in (exported / "kvsidecar" / "v1" / "common.proto").read_text()
