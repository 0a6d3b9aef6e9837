"""The NIXL transport: every NIXL object of the sidecar, on one owner thread.

- ``owner``: ``NixlTransport``, the owner thread's loop (commands, polling, posts, completion);
- ``agents``: each local agent's tables (registrations, remote agents, prepared lists);
- ``chunks``: the chunk scheduler (a large transfer cut into bounded posts, round robin; pure);
- ``inflight``: one post in flight and the result it reports;
- ``handoff``: results and notifications to the event loop, one wake-up per delivery;
- ``polling``: when the owner thread polls (pure);
- ``loader``: importing NIXL and creating an agent.
"""

from sidecar.dataplane.transport.loader import NixlUnavailable, available_backends, load_nixl, nixl_package
from sidecar.dataplane.transport.owner import NixlTransport, next_poll_delay

__all__ = ["NixlTransport", "NixlUnavailable", "available_backends", "load_nixl", "next_poll_delay", "nixl_package"]
