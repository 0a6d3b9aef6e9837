"""Prometheus metrics of one sidecar, in a registry of its own (several sidecars can live in one
test process). Labels never carry request ids: cardinality stays bounded by methods, modes and
failure reasons.

The loop thread updates most metrics; the transport thread only updates histograms, which
prometheus_client makes thread-safe.
"""

from __future__ import annotations

import bisect
import platform
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from sidecar import __version__

# Transfer times span ~50 us (one small block in-process) to seconds (GiBs over a slow link).
_TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Stages go down to a few microseconds (a cached handshake, descriptor prep of one block).
_STAGE_BUCKETS = (0.00001, 0.000025, 0.00005, *_TIME_BUCKETS)
_BYTE_BUCKETS = tuple(float(2**power) for power in range(12, 36, 2))
_DESC_BUCKETS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384, 65536)


class FastHistogram(Histogram):
    """A ``Histogram`` whose ``observe`` finds the bucket by bisection: prometheus_client walks the
    bounds in Python, ~3 us per observation, and a request observes ~10 (its stages, its calls;
    the NIXL owner thread four per transfer). The same buckets, sum and exposition."""

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar or amount != amount or self._is_parent():  # NaN, exemplars, misuse: as prometheus does
            super().observe(amount, exemplar)
            return
        self._sum.inc(amount)
        # The first bound >= amount: prometheus' "amount <= bound" (its last bound is +Inf).
        self._buckets[bisect.bisect_left(self._upper_bounds, amount)].inc(1)


class SidecarMetrics:
    """Every metric the daemon exports."""

    def __init__(self, nixl_version: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # (metric, label values) -> its labelled child; see ``child``.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.build_info = Info("kvsidecar_build", "Versions of kvsidecar and what it runs on.", registry=r)
        self.build_info.info(
            {
                "kvsidecar": __version__,
                "nixl": nixl_version,
                "grpc": grpc.__version__,
                "python": platform.python_version(),
            }
        )
        self.rpc_requests = Counter(
            "kvsidecar_rpc_requests_total",
            "gRPC calls served, by service, method and status code.",
            ["service", "method", "code"],
            registry=r,
        )
        self.rpc_duration = FastHistogram(
            "kvsidecar_rpc_duration_seconds",
            "Time to answer a unary gRPC call.",
            ["service", "method"],
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.request_duration = FastHistogram(
            "kvsidecar_request_transfer_seconds",
            "Time from a request's call to its terminal event, by mode and side.",
            ["mode", "side"],
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.request_stage = FastHistogram(
            "kvsidecar_request_stage_seconds",
            "Time a request spent in each stage on this sidecar, derived from its trace timeline when "
            "it ends (stages in sidecar/core/stages.py; needs trace_requests > 0).",
            ["side", "mode", "stage"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        # One transfer as the data plane moves it, by path: a NIXL transfer ("nixl"), a request's
        # batched device copy ("device_copy"), or a transfer staged through the pinned host pool
        # ("host_staging", counted whole: its chunks' NIXL transfers are not counted apart).
        self.xfer_duration = FastHistogram(
            "kvsidecar_nixl_transfer_seconds",
            "Duration of one transfer, post to done: NIXL's own measurement (path=nixl), a device copy's "
            "(device_copy), a staged transfer's first post to last completion (host_staging).",
            ["op", "path"],
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.xfer_post = FastHistogram(
            "kvsidecar_nixl_post_seconds",
            "Time taken to post one transfer (NIXL's post; a device copy's launch).",
            ["op", "path"],
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.xfer_bytes = Counter(
            "kvsidecar_transfer_bytes_total", "Bytes moved by transfers, by path.", ["op", "path"], registry=r
        )
        self.xfer_request_bytes = FastHistogram(
            "kvsidecar_transfer_size_bytes", "Bytes per transfer.", ["op", "path"], buckets=_BYTE_BUCKETS, registry=r
        )
        self.xfer_descriptors = FastHistogram(
            "kvsidecar_transfer_descriptors",
            "Descriptors (device copies: copy rows) per transfer after merging adjacent blocks.",
            ["op", "path"],
            buckets=_DESC_BUCKETS,
            registry=r,
        )
        self.device_copies_held = Gauge(
            "kvsidecar_device_copies_held",
            "Device copies past their deadline that may still write an engine's blocks: their transfer's "
            "failure, and the blocks, wait until they complete (above 0 for long: a hung GPU).",
            registry=r,
        )
        self.staging_slots_lent = Gauge(
            "kvsidecar_staging_slots_lent",
            "Slots of the pinned pool lent to peers reading this sidecar's GPU KV (target-side staging); "
            "each returns when handed back or at its lease's end.",
            registry=r,
        )
        self.device_copy_held_bytes = Gauge(
            "kvsidecar_device_copy_held_bytes",
            "Bytes of the device copies held (kvsidecar_device_copies_held).",
            registry=r,
        )
        self.failures = Counter(
            "kvsidecar_transfer_failures_total",
            "Requests that failed, by reason (handshake, transfer, timeout, peer_failed, ...).",
            ["reason"],
            registry=r,
        )
        self.leases = Gauge("kvsidecar_leases", "Producer leases currently held.", registry=r)
        self.pull_reads = Counter(
            "kvsidecar_pull_reads_total",
            "Pull READs posted, by what vouched that the producer still held the blocks: voucher (the "
            "producer engine's, kvsidecar.voucher: no call to the producer) or producer (its sidecar "
            "confirmed, before or during the pull).",
            ["checked_by"],
            registry=r,
        )
        self.leases_expired = Counter(
            "kvsidecar_leases_expired_total", "Producer leases that ran out before the consumer finished.", registry=r
        )
        self.peers = Gauge("kvsidecar_peers", "Peer sidecars with a cached handshake.", registry=r)
        self.handshake_duration = FastHistogram(
            "kvsidecar_handshake_seconds", "Time of a handshake with a peer sidecar.", buckets=_TIME_BUCKETS, registry=r
        )
        self.handshake_failures = Counter(
            "kvsidecar_handshake_failures_total", "Failed handshakes, by reason.", ["reason"], registry=r
        )
        self.registered_bytes = Gauge("kvsidecar_registered_bytes", "Bytes registered with NIXL.", registry=r)
        self.workers = Gauge("kvsidecar_workers", "Registered engine workers.", registry=r)
        self.pending_push_registrations = Gauge(
            "kvsidecar_pending_push_registrations",
            "Push registrations received from consumers, waiting for the producer's blocks.",
            registry=r,
        )
        self.unmatched_submissions = Gauge(
            "kvsidecar_unmatched_submissions",
            "Producer submissions in push mode waiting for a registration.",
            registry=r,
        )
        self.pending_receives = Gauge(
            "kvsidecar_pending_receives", "Consumer requests waiting for their KV.", registry=r
        )
        self.transfers_in_flight = Gauge("kvsidecar_transfers_in_flight", "NIXL transfers in flight.", registry=r)
        self.held_requests = Gauge("kvsidecar_held_requests", "Requests whose blocks are held for reuse.", registry=r)
        self.held_blocks = Gauge("kvsidecar_held_blocks", "Blocks held for multi-turn reuse (all groups).", registry=r)
        self.hold_releases = Counter(
            "kvsidecar_hold_releases_total",
            "Holds ended, by reason: read (a peer pulled them), ttl, cap (released for a newer hold), "
            "superseded (the conversation's next turn is held), refused_over_cap, released (by the engine), "
            "engine_gone.",
            ["reason"],
            registry=r,
        )
        self.cache_lookups = Counter(
            "kvsidecar_cache_lookups_total",
            "Cache queries asked by local engines, by outcome: hit, no_hold, prefix_mismatch, peer_unreachable.",
            ["outcome"],
            registry=r,
        )
        self.cache_matched_tokens = Counter(
            "kvsidecar_cache_matched_tokens_total",
            "Prompt tokens that cache hits found held on a peer (the engine still decides whether to load them).",
            registry=r,
        )
        self.events = Counter("kvsidecar_events_total", "Events sent to workers, by kind.", ["kind"], registry=r)
        self.transport_responsive = Gauge(
            "kvsidecar_transport_responsive",
            "1 while the NIXL owner thread answers its liveness probe, 0 while it is stuck (health NOT_SERVING).",
            registry=r,
        )
        self.transport_responsive.set(1)
        self.orphaned_files_removed = Counter(
            "kvsidecar_orphaned_shm_files_removed_total",
            "KV files of workers that died without removing them, removed by this sidecar.",
            registry=r,
        )

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once: ``labels`` takes a lock and builds its key on
        every call, which per request (and per transfer, on the NIXL owner thread) added up. Values
        in the order the metric declares its labels. Safe from any thread: two threads looking up
        the same new child get the one ``labels`` keeps."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def serve_http(self, host: str, port: int) -> tuple[Any, int]:
        """Start the /metrics HTTP endpoint in a daemon thread; returns (server, bound port)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, int(server.server_port)
