"""Settings of the daemon: embedded defaults, overridden by an optional TOML file, then by
``KVSIDECAR_*`` environment variables, then by command-line flags (flags win).

Everything is validated once at start; a bad value raises ``ConfigError`` naming the setting and
where it came from. Nothing here does I/O beyond reading the TOML file.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

ENV_PREFIX = "KVSIDECAR_"


class ConfigError(ValueError):
    """A setting is invalid; the message names it."""


def default_engine_socket() -> Path:
    """The engine socket's default path: under $XDG_RUNTIME_DIR when set, else the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / "kvsidecar" / "engine.sock"


def split_host_port(value: str, setting: str) -> tuple[str, int]:
    """Parse "host:port" or "[v6]:port"; raises ValueError naming the setting."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{setting} must be HOST:PORT, got {value!r}")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{setting} has a non-numeric port in {value!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{setting} port {port} is out of range 0..65535")
    return host, port


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class NixlSettings(BaseModel):
    """How the sidecar drives NIXL."""

    backends: list[str] = Field(default_factory=lambda: ["UCX"])
    # UCX worker threads per agent (0 = NIXL's default).
    num_threads: int = Field(default=0, ge=0, le=64)
    # "peer" detects dead peers and is required across hosts; "none" makes same-host notifications
    # faster (shared memory) but never notices a dead peer.
    ucx_error_handling_mode: Literal["peer", "none"] = "peer"
    # Longest sleep between two progress polls while transfers or notifications are expected. The
    # owner thread polls right away after activity and backs off to this; idle it does not poll.
    poll_interval_max_ms: float = Field(default=1.0, gt=0.0, le=100.0)
    # Pre-fault shared-memory mappings at registration (first writes into untouched pages are slow).
    populate_mappings: bool = True
    # Liveness of the owner thread: a no-op is sent every probe interval; one unanswered for
    # stall_seconds (NIXL has no timeouts; registering large memory can take seconds) makes health
    # NOT_SERVING and withholds systemd watchdog pings until it is answered. 0 disables the probe.
    probe_interval_seconds: float = Field(default=5.0, ge=0.0, le=3600.0)
    stall_seconds: float = Field(default=60.0, gt=0.0, le=86400.0)


class Settings(BaseSettings):
    """All settings of ``kvsidecar serve``. Durations are seconds."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    # Unix socket of EngineService (created with mode 0600; its directory 0700 if created).
    engine_socket: Path = Field(default_factory=default_engine_socket)
    # Optional loopback TCP address for EngineService (HOST:PORT); must be a loopback host.
    engine_tcp_listen: str | None = None
    # PeerService address to bind (HOST:PORT). Bind a routable address for cross-node peers.
    peer_listen: str = "127.0.0.1:50151"
    # Address peers use to reach this sidecar; defaults to peer_listen (with the host's name when
    # peer_listen binds a wildcard address).
    advertise: str | None = None
    # Prometheus metrics HTTP address (HOST:PORT), or "off".
    metrics_listen: str = "127.0.0.1:50152"
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # Producer lease: how long submitted blocks are held without a consumer's heartbeat.
    lease_seconds: float = Field(default=30.0, gt=0.0, le=86400.0)
    # Consumer heartbeat period; 0 means lease_seconds / 6.
    heartbeat_interval_seconds: float = Field(default=0.0, ge=0.0, le=3600.0)
    # A producer may be asked about a request before its own SubmitBlocks reached it; "unknown"
    # counts as "lost" after this long (or at once if the producer had confirmed it before).
    producer_unknown_grace_seconds: float = Field(default=2.0, ge=0.0, le=600.0)
    # Consecutive failed heartbeats after which a consumer gives up on a peer's requests.
    heartbeat_failures_allowed: int = Field(default=2, ge=1, le=100)
    # Consumer, push: a registered push that has not arrived by then fails (vLLM recomputes).
    push_registration_timeout_seconds: float = Field(default=480.0, gt=0.0, le=86400.0)
    # Bound on one pull (handshake + reads) and on one NIXL transfer.
    transfer_timeout_seconds: float = Field(default=30.0, gt=0.0, le=3600.0)
    # Default hold time for HoldBlocks (multi-turn).
    hold_ttl_seconds: float = Field(default=480.0, gt=0.0, le=86400.0)
    # Share of an engine's KV blocks its holds may occupy; past it the oldest holds are released
    # (the engine gets the blocks back), so holding for multi-turn reuse never starves it.
    hold_max_share: float = Field(default=0.25, gt=0.0, le=1.0)
    # Deadline of one PeerService call (handshake included).
    peer_call_timeout_seconds: float = Field(default=5.0, gt=0.0, le=600.0)
    # A worker that registered must open WatchEvents within this time or its registration is dropped.
    worker_attach_timeout_seconds: float = Field(default=30.0, gt=0.0, le=3600.0)
    # Graceful shutdown: in-flight calls and transfers get this long before the daemon exits.
    shutdown_grace_seconds: float = Field(default=10.0, ge=0.0, le=3600.0)
    # Directories from which shared-memory files may be mapped.
    shm_dirs: list[Path] = Field(default_factory=lambda: [Path("/dev/shm")])
    # Largest gRPC message accepted or sent.
    max_message_bytes: int = Field(default=64 * 1024 * 1024, ge=1024 * 1024, le=1024 * 1024 * 1024)
    # Events buffered per worker before its stream is considered stuck and closed.
    max_queued_events: int = Field(default=65536, ge=16)
    # Limits against hostile or broken clients.
    max_blocks_per_request: int = Field(default=1 << 20, ge=1)
    max_pending_requests: int = Field(default=100_000, ge=1)

    # mTLS between sidecars: all three set enables it on the peer port and for outgoing calls.
    peer_tls_cert: Path | None = None
    peer_tls_key: Path | None = None
    peer_tls_ca: Path | None = None

    nixl: NixlSettings = Field(default_factory=NixlSettings)

    # The TOML file read for this instance; set by load_settings, not a setting of its own.
    toml_file: ClassVar[Path | None] = None

    @field_validator("peer_listen")
    @classmethod
    def _check_peer_listen(cls, value: str) -> str:
        split_host_port(value, "peer_listen")
        return value

    @field_validator("advertise")
    @classmethod
    def _check_advertise(cls, value: str | None) -> str | None:
        if value is not None:
            _host, port = split_host_port(value, "advertise")
            if port == 0:
                raise ValueError("advertise needs a real port, not 0")
        return value

    @field_validator("metrics_listen")
    @classmethod
    def _check_metrics_listen(cls, value: str) -> str:
        if value != "off":
            split_host_port(value, "metrics_listen")
        return value

    @field_validator("engine_tcp_listen")
    @classmethod
    def _check_engine_tcp(cls, value: str | None) -> str | None:
        if value is not None:
            host, _ = split_host_port(value, "engine_tcp_listen")
            if not is_loopback_host(host):
                raise ValueError(f"engine_tcp_listen must be a loopback address, got host {host!r}")
        return value

    @field_validator("engine_socket")
    @classmethod
    def _check_socket(cls, value: Path) -> Path:
        # sun_path holds 108 bytes including the terminating NUL.
        if len(os.fsencode(str(value))) > 107:
            raise ValueError(f"engine_socket path is longer than 107 bytes: {value}")
        return value

    @model_validator(mode="after")
    def _check_tls(self) -> Settings:
        tls = [self.peer_tls_cert, self.peer_tls_key, self.peer_tls_ca]
        if any(tls) and not all(tls):
            raise ValueError("peer_tls_cert, peer_tls_key and peer_tls_ca must be set together")
        for path in tls:
            if path is not None and not path.is_file():
                raise ValueError(f"TLS file {path} does not exist")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls.toml_file is not None:
            sources.append(InitSettingsSource(settings_cls, init_kwargs=_read_toml(cls.toml_file)))
        return tuple(sources)

    # Derived values -------------------------------------------------------------------------

    @property
    def heartbeat_interval(self) -> float:
        return self.heartbeat_interval_seconds or self.lease_seconds / 6.0

    @property
    def lease_extension_seconds(self) -> float:
        """A heartbeat extends a lease to now + 2/3 of its length (vLLM's rule)."""
        return self.lease_seconds * 2.0 / 3.0

    @property
    def tls_enabled(self) -> bool:
        return self.peer_tls_cert is not None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def load_settings(overrides: dict[str, Any] | None = None, config_file: Path | None = None) -> Settings:
    """Build the settings: defaults < TOML file < environment < ``overrides`` (the CLI flags).

    The TOML file is ``config_file``, else ``$KVSIDECAR_CONFIG`` if set.
    """
    if config_file is None and os.environ.get(ENV_PREFIX + "CONFIG"):
        config_file = Path(os.environ[ENV_PREFIX + "CONFIG"])
    if config_file is not None and not config_file.is_file():
        raise ConfigError(f"config file {config_file} does not exist")
    clean = {key: value for key, value in (overrides or {}).items() if value is not None}

    class _Settings(Settings):
        toml_file: ClassVar[Path | None] = config_file

    try:
        loaded = _Settings(**clean)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc, config_file)) from None
    return Settings.model_construct(**{name: getattr(loaded, name) for name in Settings.model_fields})


def _describe_validation_error(exc: ValidationError, config_file: Path | None) -> str:
    problems = []
    for error in exc.errors():
        name = ".".join(str(part) for part in error["loc"]) or "settings"
        env_name = ENV_PREFIX + name.replace(".", "__").upper()
        origin = f"--{name.replace('_', '-')}, {env_name}" + (f" or {config_file}" if config_file else "")
        value = error.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        problems.append(f"invalid setting {name!r}{shown}: {error['msg']} [from {origin}]")
    return "; ".join(problems)
