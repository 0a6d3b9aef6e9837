"""Were the protos changed only compatibly since an older commit? (``make lint`` asks.)

The policy is docs/compatibility.md. Both versions of ``proto/`` are compiled to
FileDescriptorSets with grpc_tools' protoc (the old one from ``git show <commit>:<path>``) and
compared, as buf's wire-and-JSON breaking check would: every message, enum and service of the old
set must still exist under the same full name; every old field number must still be there with the
same name, type and label, or be reserved; every old enum value likewise; every old RPC must still
exist with the same request and response types and streaming. Additions are free.

Not part of the daemon (nothing under sidecar imports it); run by hand as
``python -m sidecar.tools.proto_compat --against accfe2b``. Single-threaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = "proto"
# The release the protos are checked against: a newer sidecar must still talk to it.
PINNED_COMMIT = "accfe2b"

FieldProto = descriptor_pb2.FieldDescriptorProto


class CompatError(RuntimeError):
    """The check could not run (a commit not in this clone, protos that do not compile)."""


def compile_protos(root: Path) -> descriptor_pb2.FileDescriptorSet:
    """Every ``.proto`` under ``root`` compiled into one FileDescriptorSet (imports resolved).

    protoc runs in a child process: grpc_tools' compiler module crashed (SIGSEGV) when imported
    into a process that had loaded other protobuf/gRPC extension modules first (a test run)."""
    files = sorted(str(path.relative_to(root)) for path in root.rglob("*.proto"))
    if not files:
        raise CompatError(f"no .proto files under {root}")
    spec = importlib.util.find_spec("grpc_tools")
    if spec is None or not spec.submodule_search_locations:
        raise CompatError("grpc_tools is not installed (make setup installs it)")
    builtin = Path(next(iter(spec.submodule_search_locations))) / "_proto"
    with tempfile.TemporaryDirectory(prefix="kvs-proto-") as scratch:
        out = Path(scratch) / "set.pb"
        command = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{builtin}",
            f"--descriptor_set_out={out}",
        ]
        compiled = subprocess.run([*command, *files], capture_output=True, text=True, timeout=120)
        if compiled.returncode != 0 or not out.exists():
            raise CompatError(f"protoc could not compile the protos under {root}: {compiled.stderr.strip()}")
        result = descriptor_pb2.FileDescriptorSet()
        result.ParseFromString(out.read_bytes())
    return result


def require_commit(commit: str, repo: Path, consequence: str) -> None:
    """CompatError naming the fix unless ``commit`` is in the clone at ``repo`` (CI's may be shallow)."""
    found = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise CompatError(
            f"commit {commit} is not in the clone at {repo} (a shallow clone?): {consequence}; fetch the "
            f"history (git fetch --unshallow) or the commit (git fetch origin {commit})"
        )


def export_commit(commit: str, repo: Path, into: Path, proto_dir: str = PROTO_DIR) -> Path:
    """Write ``proto_dir`` as of ``commit`` under ``into``; CompatError (with the fix) if the
    commit is not in this clone."""
    require_commit(commit, repo, "the protos cannot be checked against it")
    listing = subprocess.run(
        ["git", "-C", str(repo), "ls-tree", "-r", "--name-only", commit, "--", proto_dir],
        capture_output=True,
        text=True,
        check=True,
    )
    names = [name for name in listing.stdout.splitlines() if name.endswith(".proto")]
    if not names:
        raise CompatError(f"commit {commit} has no .proto files under {proto_dir}/")
    for name in names:
        text = subprocess.run(
            ["git", "-C", str(repo), "show", f"{commit}:{name}"], capture_output=True, check=True
        ).stdout
        target = into / Path(name).relative_to(proto_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text)
    return into


# --- the comparison -------------------------------------------------------------------------------


def _messages(
    prefix: str, messages: Iterable[descriptor_pb2.DescriptorProto]
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for message in messages:
        name = f"{prefix}.{message.name}"
        yield name, message
        yield from _messages(name, message.nested_type)


def _index(
    files: descriptor_pb2.FileDescriptorSet,
) -> tuple[
    dict[str, descriptor_pb2.DescriptorProto],
    dict[str, descriptor_pb2.EnumDescriptorProto],
    dict[str, descriptor_pb2.ServiceDescriptorProto],
]:
    messages: dict[str, descriptor_pb2.DescriptorProto] = {}
    enums: dict[str, descriptor_pb2.EnumDescriptorProto] = {}
    services: dict[str, descriptor_pb2.ServiceDescriptorProto] = {}
    for file in files.file:
        package = f".{file.package}" if file.package else ""
        for name, message in _messages(package, file.message_type):
            messages[name] = message
            for enum in message.enum_type:
                enums[f"{name}.{enum.name}"] = enum
        for enum in file.enum_type:
            enums[f"{package}.{enum.name}"] = enum
        for service in file.service:
            services[f"{package}.{service.name}"] = service
    return messages, enums, services


def _reserved(number: int, ranges: Iterable[Any], end_inclusive: bool) -> bool:
    # Message reserved ranges end exclusively; enum reserved ranges inclusively.
    return any(r.start <= number < r.end + (1 if end_inclusive else 0) for r in ranges)


def _type_of(field: FieldProto) -> str:
    kind = FieldProto.Type.Name(field.type).removeprefix("TYPE_").lower()
    return f"{kind} {field.type_name}" if field.type_name else kind


def _label_of(field: FieldProto) -> str:
    if field.label == FieldProto.LABEL_REPEATED:
        return "repeated"
    return "optional" if field.proto3_optional or field.HasField("oneof_index") else "singular"


def _compare_message(name: str, old: descriptor_pb2.DescriptorProto, new: descriptor_pb2.DescriptorProto) -> list[str]:
    problems = []
    new_by_number = {field.number: field for field in new.field}
    new_by_name = {field.name: field for field in new.field}
    for field in old.field:
        where = f"{name}.{field.name} = {field.number}"
        now = new_by_number.get(field.number)
        if now is None:
            moved = new_by_name.get(field.name)
            if moved is not None:
                problems.append(f"field {where} renumbered to {moved.number}")
            elif not _reserved(field.number, new.reserved_range, end_inclusive=False):
                problems.append(f"field {where} removed without reserving its number ('reserved {field.number};')")
            continue
        if now.name != field.name:
            problems.append(f"field {where} renamed to {now.name!r} (breaks JSON and generated code)")
        if _type_of(now) != _type_of(field):
            problems.append(f"field {where} retyped from {_type_of(field)} to {_type_of(now)}")
        elif (_label_of(now) == "repeated") != (_label_of(field) == "repeated"):
            # singular <-> optional or a oneof keeps the wire format; repeated <-> not does not
            problems.append(f"field {where} changed from {_label_of(field)} to {_label_of(now)}")
    return problems


def _compare_enum(
    name: str, old: descriptor_pb2.EnumDescriptorProto, new: descriptor_pb2.EnumDescriptorProto
) -> list[str]:
    problems = []
    new_by_number = {value.number: value for value in new.value}
    for value in old.value:
        now = new_by_number.get(value.number)
        if now is None:
            if not _reserved(value.number, new.reserved_range, end_inclusive=True):
                problems.append(f"enum value {name}.{value.name} = {value.number} removed without reserving it")
        elif now.name != value.name:
            problems.append(f"enum value {name}.{value.name} = {value.number} renamed to {now.name!r}")
    return problems


def _compare_service(
    name: str, old: descriptor_pb2.ServiceDescriptorProto, new: descriptor_pb2.ServiceDescriptorProto
) -> list[str]:
    problems = []
    new_methods = {method.name: method for method in new.method}
    for method in old.method:
        now = new_methods.get(method.name)
        if now is None:
            problems.append(f"rpc {name}.{method.name} removed (keep it; answer UNIMPLEMENTED or FAILED_PRECONDITION)")
            continue
        before = (method.input_type, method.output_type, method.client_streaming, method.server_streaming)
        after = (now.input_type, now.output_type, now.client_streaming, now.server_streaming)
        if before != after:
            problems.append(f"rpc {name}.{method.name} changed its signature from {before} to {after}")
    return problems


def breaking_changes(old: descriptor_pb2.FileDescriptorSet, new: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """What ``new`` breaks of ``old``: one readable line per problem; empty when compatible."""
    old_messages, old_enums, old_services = _index(old)
    new_messages, new_enums, new_services = _index(new)
    problems: list[str] = []
    for name, message in old_messages.items():
        if name not in new_messages:
            problems.append(f"message {name} removed or renamed")
        else:
            problems += _compare_message(name, message, new_messages[name])
    for name, enum in old_enums.items():
        if name not in new_enums:
            problems.append(f"enum {name} removed or renamed")
        else:
            problems += _compare_enum(name, enum, new_enums[name])
    for name, service in old_services.items():
        if name not in new_services:
            problems.append(f"service {name} removed or renamed")
        else:
            problems += _compare_service(name, service, new_services[name])
    return problems


def check_against(commit: str, repo: Path = REPO_ROOT, proto_dir: str = PROTO_DIR) -> list[str]:
    """The breaking changes in ``repo``'s working tree's protos since ``commit``."""
    with tempfile.TemporaryDirectory(prefix="kvs-proto-old-") as scratch:
        old = compile_protos(export_commit(commit, repo, Path(scratch), proto_dir))
    return breaking_changes(old, compile_protos(repo / proto_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--against", default=PINNED_COMMIT, help=f"older commit (default {PINNED_COMMIT})")
    parser.add_argument("--repo", type=Path, default=REPO_ROOT, help="the git checkout (default: this one)")
    args = parser.parse_args(argv)
    try:
        problems = check_against(args.against, args.repo)
    except CompatError as exc:
        print(f"proto_compat: cannot check: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"proto_compat: {problem}", file=sys.stderr)
    if problems:
        print(
            f"proto_compat: {len(problems)} incompatible change(s) since {args.against} (docs/compatibility.md)",
            file=sys.stderr,
        )
        return 1
    print(f"proto_compat: the protos changed only compatibly since {args.against}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
