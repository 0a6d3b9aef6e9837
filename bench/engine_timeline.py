"""Where D's time to first token goes, per request: phases from a ``KVBENCH_TRACE`` file written
by ``bench/vllm_pd.py`` with the engine trace (``KVBENCH_SERVER_PYTHONPATH=bench/engine_trace``).

    KVBENCH_TRACE=/tmp/t.log KVBENCH_SERVER_PYTHONPATH=bench/engine_trace \\
        python -m bench.vllm_pd --no-concurrent --sizes 512 --configs kvsidecar-pull nixl-pull-fixed
    python -m bench.engine_timeline /tmp/t.log

For each measured request (the warm-up of each configuration and size is skipped), from the
client's D-leg send: ``to_engine`` (the HTTP request reaches D's EngineCore, ``add_request``),
``to_loaded`` (-> D's connector reports the KV received: the transfer window, whichever
connector), ``to_scheduled`` (-> the forward step that computes the first token starts), ``step``
(that step) and ``to_client`` (-> the first token reaches the client). Prints the median of each
phase per configuration and size; ``--runs`` prints every request.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path

PHASES = ("to_engine", "to_loaded", "to_scheduled", "step", "to_client", "ttft")
_CLIENT = re.compile(r"client P-leg \S+ D-leg sent (?P<sent>[\d.]+) first (?P<first>[\d.]+)")
_ADD = re.compile(r" core add (?P<id>\S+)")
_LOADED = re.compile(r" (?:shim|nixl) results recv=\[(?P<ids>[^\]]*)\]")
_EXECUTE = re.compile(r" worker execute start=(?P<start>[\d.]+) dur_ms=(?P<dur>[\d.]+)")


def phases(lines: list[tuple[float, str]], sent: float, first: float) -> dict[str, float] | None:
    """The phases (ms) of the request sent at ``sent`` whose first token arrived at ``first``."""
    window = [(at, text) for at, text in lines if sent <= at <= first]
    added = next(((at, m["id"]) for at, text in window if (m := _ADD.search(text))), None)
    if added is None:
        return None
    added_at, request_id = added
    loaded_at = next((at for at, text in window if (m := _LOADED.search(text)) and request_id in m["ids"]), None)
    if loaded_at is None:
        return None
    executions = [(float(m["start"]), float(m["dur"])) for _, text in window if (m := _EXECUTE.search(text))]
    step = next(((start, dur) for start, dur in executions if start >= loaded_at), None)
    if step is None:
        return None
    start, duration = step
    ms = 1e3
    return {
        "to_engine": (added_at - sent) * ms,
        "to_loaded": (loaded_at - added_at) * ms,
        "to_scheduled": (start - loaded_at) * ms,
        "step": duration,
        "to_client": (first - start) * ms - duration,
        "ttft": (first - sent) * ms,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--runs", action="store_true", help="print every request, not only medians")
    args = parser.parse_args(argv)
    lines: list[tuple[float, str]] = []
    for raw in args.trace.read_text().splitlines():
        stamp, _, rest = raw.partition(" ")
        try:
            lines.append((float(stamp), " " + rest))
        except ValueError:
            continue
    groups: dict[str, list[dict[str, float]]] = defaultdict(list)
    current, warm_up = "", False
    for _, text in lines:
        if " client measuring " in text:
            current, warm_up = text.split(" client measuring ", 1)[1].strip(), True
            continue
        if " client starting " in text:
            current = ""  # a configuration's first-use request, before its sizes are measured
            continue
        match = _CLIENT.search(text)
        if match is None or not current:
            continue
        if warm_up:
            warm_up = False
            continue
        found = phases(lines, float(match["sent"]), float(match["first"]))
        if found is not None:
            groups[current].append(found)
            if args.runs:
                print(current, " ".join(f"{name} {found[name]:.1f}" for name in PHASES))
    print("| configuration, size | requests | " + " | ".join(PHASES) + " |")
    print("|---|---|" + "---|" * len(PHASES))
    for group, found in groups.items():
        medians = " | ".join(f"{statistics.median(f[name] for f in found):.1f}" for name in PHASES)
        print(f"| {group} | {len(found)} | {medians} |")


if __name__ == "__main__":
    main()
