"""kvsidecar: the per-node KV-cache transport daemon.

Dependencies point one way: ``cli`` -> ``server`` -> servicers (``engine_api``, ``peer_api``) ->
``node`` (the core) -> ``transport`` / ``peers`` -> pure logic (``planning``, ``leases``,
``matching``, ``cache_index``). The core never imports a servicer.
"""

__version__ = "0.1.0"

# Wire protocol revision spoken between sidecars (VersionInfo.protocol); bump on breaking changes.
PROTOCOL_VERSION = 1
