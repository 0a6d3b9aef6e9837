"""Where a request's time went on this sidecar: stage durations derived from its trace timeline.

Pure logic (no I/O, no clock): ``stage_durations`` reads a finished ``Timeline`` of the trace
recorder and attributes each gap between consecutive events to the stage that the later event
ends, so the stages of a request sum to its total on this sidecar (first event -> terminal
event). A NIXL completion carries NIXL's own times: its transfer time runs from the start of its
post to completion and so includes the post (on one host UCX copies by CMA inside the post, so
the post is most of it); the stages split it into ``nixl_post`` (inside the post call) and
``nixl_transfer`` (the rest, after the post returned). The rest of the post -> completion gap is
the hand-off to and from the NIXL owner thread and its polling (``nixl_handoff``). ``control`` is
the total minus NIXL's time (post and transfer): what kvsidecar adds around the bytes (issue
#10's control path).

Stages, by the event that ends them (see docs/operations.md, "Request timeline"):

====================  ==========================================================================
stage                 ends at / means
====================  ==========================================================================
peer_hop              consumer: the producer confirmed it holds the blocks (pull) or accepted the
                      PushReg (push)
wait_consumer         producer: the consumer's first heartbeat (pull; includes D's own queueing)
wait_match            producer: the consumer's PushReg matched this submission (push)
handshake             the peer's engine view is known (a cached handshake is ~0)
descriptor_prep       the data plane posts: block -> descriptor indices, pairing of ranks
nixl_post             NIXL's post call (postXferReq), as NIXL's telemetry measured it; on one host
                      the CMA copy itself
nixl_transfer         the rest of NIXL's transfer time (its telemetry's, which starts at the post)
nixl_handoff          the rest of post -> completion: owner-thread queueing, polling, hand-back
wait_notification     the other side's NIXL operation completed (push consumer / pull producer)
complete              the terminal event was decided and queued for the engine
total                 first event -> terminal event on this sidecar
control               total - nixl_post - nixl_transfer (only where this sidecar ran the transfer)
====================  ==========================================================================

Called on the event loop thread by the trace recorder's ``on_done``.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict

from sidecar.core.trace import Timeline

# Event kind -> the stage it ends, by side ("" = either side).
_STAGE_OF: dict[tuple[str, str], str] = {
    ("consumer", "confirmed"): "peer_hop",
    ("consumer", "registered"): "peer_hop",
    ("producer", "heartbeat"): "wait_consumer",
    ("producer", "matched"): "wait_match",
    ("", "handshake"): "handshake",
    ("", "posted"): "descriptor_prep",
    ("", "nixl_completion"): "nixl_handoff",
    ("", "notification"): "wait_notification",
    ("", "finished"): "complete",
    ("", "failed"): "complete",
}
STAGES = (
    "peer_hop",
    "wait_consumer",
    "wait_match",
    "handshake",
    "descriptor_prep",
    "nixl_post",
    "nixl_transfer",
    "nixl_handoff",
    "wait_notification",
    "complete",
    "other",
    "total",
    "control",
)


def stage_of(side: str, kind: str) -> str:
    return _STAGE_OF.get((side, kind)) or _STAGE_OF.get(("", kind)) or "other"


def stage_durations(timeline: Timeline) -> dict[str, float]:
    """Seconds per stage of a timeline (only the stages it went through, plus total/control)."""
    events = timeline.events
    if not events:
        return {}
    stages: dict[str, float] = defaultdict(float)
    ran_nixl = False
    for previous, event in itertools.pairwise(events):
        gap = max(0.0, event.monotonic - previous.monotonic)
        stage = stage_of(timeline.side, event.kind)
        if stage == "nixl_handoff":
            ran_nixl = True
            # Several ranks' transfers overlap: NIXL's times are attributed up to the gap. NIXL's
            # transfer time starts at the post, so the post is a part of it, not added to it.
            measured_post = event.measured.get("nixl_post", 0.0)
            post = min(gap, measured_post)
            transfer = min(gap - post, max(0.0, event.measured.get("nixl_transfer", 0.0) - measured_post))
            stages["nixl_post"] += post
            stages["nixl_transfer"] += transfer
            gap -= post + transfer
        stages[stage] += gap
    total = max(0.0, events[-1].monotonic - events[0].monotonic)
    stages["total"] = total
    if ran_nixl:
        stages["control"] = max(0.0, total - stages["nixl_post"] - stages["nixl_transfer"])
    return dict(stages)


def mode_of(timeline: Timeline) -> str:
    """The timeline's transfer mode; a producer never matched with a PushReg was pulled from."""
    return timeline.mode if timeline.mode in ("pull", "push") else "pull"


_STAGE_SAMPLE = re.compile(r"^kvsidecar_request_stage_seconds_(sum|count)\{(.*)\}$")
_ENGINE_SAMPLE = re.compile(r"^vllm:kvsidecar_(call_to_event|event_to_step)_seconds_(sum|count)(\{.*\})?$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per request of each stage between two scrapes of /metrics
    (``{'name{labels}': value}``): ``"<side>/<mode>/<stage>"`` from a sidecar's
    ``kvsidecar_request_stage_seconds``, ``"engine/call_to_event"`` / ``"engine/event_to_step"``
    from vLLM's ``vllm:kvsidecar_*`` (summed over label sets). Stages with no request are left out."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    for key, value in after.items():
        delta = value - before.get(key, 0.0)
        match = _STAGE_SAMPLE.match(key)
        if match:
            labels = dict(_LABEL.findall(match.group(2)))
            name = f"{labels.get('side')}/{labels.get('mode')}/{labels.get('stage')}"
            suffix = match.group(1)
        else:
            engine = _ENGINE_SAMPLE.match(key)
            if not engine:
                continue
            name, suffix = f"engine/{engine.group(1)}", engine.group(2)
        (sums if suffix == "sum" else counts)[name] += delta
    return {name: round(sums[name] / count * 1000.0, 4) for name, count in sorted(counts.items()) if count > 0}
