"""kvsidecar: the per-node KV-cache transport daemon.

Sub-packages by role, dependencies pointing one way (checked by ``lint-imports``, contracts in
``pyproject.toml``; ARCHITECTURE.md walks through them):

- ``app``: the process shell (cli, server, liveness, systemd);
- ``api``: the thin gRPC servicers and the interceptor that maps errors to statuses;
- ``tools``: demo, benchmark, workload driver, status view, process launcher (not the daemon);
- ``core``: the node's state machines (registration, events, producer, consumer, holds) and pure
  request logic (matching, leases, timers, notices, cache index, validation);
- ``peers``: the typed client for other sidecars (channels, addresses, handshake cache);
- ``dataplane``: the NIXL owner thread, memory import, the request mover and ``plan`` (pure
  TP / block / layout / descriptor math).

This top level holds the foundation every sub-package may import: the version, ``config``,
``errors``, ``logs`` and ``metrics``.
"""

__version__ = "0.1.0"

# Wire protocol revision spoken between sidecars (VersionInfo.protocol); bump on breaking changes,
# which docs/compatibility.md rules out within kvsidecar.v1 (compatible changes never bump it).
PROTOCOL_VERSION = 1

# Optional capabilities this sidecar tells its peers in every SidecarInfo (VersionInfo.features).
# A name is added with the capability and never removed or reused within kvsidecar.v1; a peer
# checks for a name before relying on a capability newer than BASELINE_FEATURES, and treats a
# name it does not know as absent. An empty list is a sidecar from before the list (accfe2b):
# it has exactly BASELINE_FEATURES.
BASELINE_FEATURES: tuple[str, ...] = (
    "pull",
    "push",
    "vouchers",
    "integrity_digests",
    "layout_conversion",
    "multiturn_holds",
    "trace",
)
# Announced since: the feature list itself, the engine Session stream, the peer Stream, node-local
# GPU device copies (WorkerDescriptor.node_local_exports), target-side host staging (Stage), the
# self-test host (SelfTestService), push staging into a GPU consumer (StagingPool.accepts_push,
# Stage with inbound), a worker's events on the engine Session stream (SessionAnswers.events), the
# engine session on a plain Unix socket next to the engine socket (<engine_socket>.session).
FEATURES: tuple[str, ...] = (
    *BASELINE_FEATURES,
    "features",
    "engine_session",
    "peer_stream",
    "device_copy",
    "target_staging",
    "selftest",
    "push_staging",
    "session_events",
    "session_socket",
)


def peer_features(announced: list[str] | tuple[str, ...]) -> frozenset[str]:
    """What a peer can do, from its VersionInfo.features (empty: the baseline)."""
    return frozenset(announced) if announced else frozenset(BASELINE_FEATURES)
