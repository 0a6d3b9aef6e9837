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

# Wire protocol revision spoken between sidecars (VersionInfo.protocol); bump on breaking changes.
PROTOCOL_VERSION = 1
