"""Summarise a ``py-spy record --subprocesses --format raw`` profile per process: the frames with
the most samples of their own (self) and in their stack (inclusive), and per-process collapsed
stacks (``flamegraph.pl`` / speedscope input) without the process prefixes.

Run: ``python -m bench.profile_top PROFILE.txt [--out-dir DIR] [--exclude REGEX] [--top N]``.
Processes are named by pid and what they run (``sidecar-...`` for ``kvsidecar serve`` daemons).
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path


def process_name(header: str, daemons: set[str]) -> str:
    """``sidecar-<socket name>-<pid>`` for a daemon (py-spy may keep the command line a child had
    before its exec: then ``sidecar-<pid>``), else ``<program>-<pid>``."""
    pid = header.split(":", 1)[0].removeprefix("process ")
    if pid in daemons:
        found = re.search(r"(\w+)\.sock", header) if " serve " in header else None
        return f"sidecar-{found.group(1)}-{pid}" if found else f"sidecar-{pid}"
    return f"bench-{pid}" if " bench " in header else f"process-{pid}"


def _split(line: str) -> tuple[list[str], list[str], int]:
    stack, _, count = line.rpartition(" ")
    parts = stack.split(";")
    return (
        [p for p in parts if p.startswith("process ")],
        [p for p in parts if not p.startswith("process ")],
        int(count),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--out-dir", type=Path, help="write <process>.collapsed.txt here")
    parser.add_argument("--exclude", default="", help="drop stacks with a frame matching this regex")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    exclude = re.compile(args.exclude) if args.exclude else None
    stacks: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    lines = [_split(line) for line in args.profile.read_text().splitlines()]
    # A process is a sidecar daemon if any of its stacks runs ``_serve`` (its main thread).
    daemons = {
        headers[-1].split(":", 1)[0].removeprefix("process ")
        for headers, frames, _ in lines
        if headers and any(frame.startswith("_serve ") for frame in frames)
    }
    for headers, frames, count in lines:
        if not headers or not frames or (exclude and any(exclude.search(frame) for frame in frames)):
            continue
        stacks[process_name(headers[-1], daemons)][";".join(frames)] += count
    for name, counts in sorted(stacks.items()):
        total = sum(counts.values())
        own: collections.Counter[str] = collections.Counter()
        inclusive: collections.Counter[str] = collections.Counter()
        for stack, count in counts.items():
            frames = stack.split(";")
            own[frames[-1]] += count
            for function in {re.sub(r" \(.*", "", frame) for frame in frames}:
                inclusive[function] += count
        print(f"== {name}: {total} samples")
        print("  self:")
        for frame, count in own.most_common(args.top):
            print(f"    {100 * count / total:5.1f}%  {frame}")
        print("  inclusive:")
        for function, count in inclusive.most_common(args.top * 2):
            print(f"    {100 * count / total:5.1f}%  {function}")
        if args.out_dir is not None:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            lines = [f"{stack} {count}" for stack, count in counts.most_common()]
            (args.out_dir / f"{name}.collapsed.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
