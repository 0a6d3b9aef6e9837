"""Logging setup: structlog for our own events, with the stdlib loggers of grpc and NIXL routed
through the same processors and renderer.

JSON lines when stderr is not a terminal (journald, Kubernetes), key-value on a terminal.
Per-call context (RPC method, engine, request) is bound with ``structlog.contextvars`` by the
server interceptor and the core, so every line of one call carries it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _BoundLogger(structlog.stdlib.BoundLogger):
    """structlog's stdlib logger, where a debug line below the level costs one cached level check
    instead of a copy of the bound context and a processor run that drops it (``filter_by_level``)."""

    def debug(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if not self._logger.isEnabledFor(logging.DEBUG):
            return None
        return super().debug(event, *args, **kw)


def configure_logging(log_format: str = "auto", level: str = "info") -> None:
    """Configure structlog and the stdlib root logger once for the process."""
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Any
    if use_json:
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        # Drop filtered-out levels before any processor runs: debug calls on hot paths cost nothing.
        processors=[structlog.stdlib.filter_by_level, *shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=_BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[level])
    route_foreign_loggers()


def route_foreign_loggers() -> None:
    """Send the stdlib loggers of grpc and NIXL through our handler.

    NIXL's Python package installs its own stdout handler when imported, so the transport calls
    this again right after importing it. Their INFO chatter (one line per agent and backend) is
    lowered to WARNING unless we log at DEBUG.
    """
    debug = logging.getLogger().level <= logging.DEBUG
    for name in ("nixl", "nixl_cu12", "nixl_cu13", "grpc", "asyncio"):
        foreign = logging.getLogger(name)
        foreign.handlers[:] = []
        foreign.propagate = True
        foreign.setLevel(logging.DEBUG if debug else logging.WARNING)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.stdlib.get_logger(name)
