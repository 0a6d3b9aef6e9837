"""Settings of the daemon: embedded defaults, overridden by an optional TOML file, then by
``KVSIDECAR_*`` environment variables, then by command-line flags (flags win).

Every source goes through the same pydantic model, so a value is checked the same way whether it
came from the file, the environment or a flag; list settings take a JSON list or a comma-separated
string from the environment and ``--set``. Everything is validated once at start; a bad value raises
``ConfigError`` naming the setting and where it came from. I/O here: reading the TOML file and
checking that ``shm_dirs`` are directories (the NIXL backends are checked by the CLI, which can
load NIXL).
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
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


def _split_list(value: Any) -> Any:
    """A list setting given as text (environment, --set): a JSON list or comma-separated items."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError(f"is not a JSON list: {value!r}") from None
    return [item.strip() for item in text.split(",") if item.strip()]


def _duration(low: float, high: float, zero: str | None = None, unit: str = "s") -> AfterValidator:
    """A duration setting's range: ``low``..``high`` (in ``unit``), or 0 where ``zero`` says what 0
    means. The floors are what the event loop and the kernel can time under load (10 ms), or higher
    where a smaller value would make the setting fail everything it bounds (a lease, a timeout);
    the ceilings are beyond what any deployment needs. A value outside is a typo (ms for s)."""

    def check(value: float) -> float:
        if value == 0 and zero is not None:
            return value
        if not low <= value <= high:
            allowed = f"between {low:g} and {high:g} {unit}"
            raise ValueError(f"must be {allowed}" + (f", or 0 ({zero})" if zero is not None else ""))
        return value

    return AfterValidator(check)


class NixlSettings(BaseModel):
    """How the sidecar drives NIXL."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # NIXL backend plugins per agent; at least one (the CLI checks NIXL offers them).
    backends: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["UCX"], min_length=1)
    # UCX worker threads per agent (0 = NIXL's default).
    num_threads: int = Field(default=0, ge=0, le=64)
    # "peer" detects dead peers and is required across hosts; "none" makes same-host notifications
    # faster (shared memory) but never notices a dead peer.
    ucx_error_handling_mode: Literal["peer", "none"] = "peer"
    # Longest sleep between two progress polls while transfers or notifications are expected. The
    # owner thread polls right away after activity and backs off to this; idle it does not poll.
    poll_interval_max_ms: Annotated[float, _duration(0.01, 100.0, unit="ms")] = 1.0
    # Largest post to NIXL: bigger transfers go in chunks of about this many bytes, interleaved
    # with other requests' posts (between processes on one host each copy runs inside the post, on
    # the owner thread, so a small request would otherwise wait for a whole large copy). 0 = never
    # split.
    max_post_bytes: int = Field(default=4 << 20, ge=0)
    # SCHED_FIFO priority of the owner thread from a post until it next sleeps (on one host the copy
    # runs inside the post; next to busy-looping engines it otherwise waits for a CPU most of the
    # time). 0 = off (default: see docs/bench-history.md for the outliers seen with it on). Needs
    # CAP_SYS_NICE or RLIMIT_RTPRIO >= it; without, logged once and posts run as before.
    post_priority: int = Field(default=0, ge=0, le=99)
    # Pre-fault shared-memory mappings at registration (first writes into untouched pages are slow).
    populate_mappings: bool = True
    # Liveness of the owner thread: a no-op is sent every probe interval; one unanswered for
    # stall_seconds (NIXL has no timeouts; registering large memory can take seconds) makes health
    # NOT_SERVING and withholds systemd watchdog pings until it is answered. 0 disables the probe.
    probe_interval_seconds: Annotated[float, _duration(0.01, 3600.0, zero="no probe")] = 5.0
    stall_seconds: Annotated[float, _duration(0.1, 86400.0)] = 60.0

    @field_validator("backends", mode="before")
    @classmethod
    def _backends_list(cls, value: Any) -> Any:
        return _split_list(value)


class HostStagingSettings(BaseModel):
    """Host staging of GPU KV (``sidecar.dataplane.host_staging``): a local engine's GPU memory,
    imported over CUDA IPC, cannot be registered for RDMA, so its bytes go through the sidecar's
    own pinned host pool, copied GPU <-> pool in chunks overlapped with NIXL moving the pool."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # "auto": a local VRAM worker's transfers stage through the pool unless the plane copies device
    # to device (same node); "always": also where a device copy could run (proves the cross-node
    # path on one node); "off": NIXL moves the imported GPU memory itself (emulated over TCP).
    mode: Literal["auto", "always", "off"] = "auto"
    # Pinned host memory of the pool (allocated at the first staged transfer, kept for the life
    # of the process, registered once per agent). Pinned memory is locked RAM: keep it modest.
    pool_bytes: int = Field(default=256 << 20, ge=1 << 20, le=64 << 30)
    # Bytes per pipeline step: one NIXL transfer and one batched GPU copy each.
    chunk_bytes: int = Field(default=8 << 20, ge=64 << 10, le=1 << 30)
    # Chunks one transfer may hold at once (READs or WRITEs in flight + the copy); fewer if the
    # pool is short (down to one: no overlap, still correct).
    slots: int = Field(default=4, ge=1, le=64)

    @model_validator(mode="after")
    def _chunk_fits(self) -> HostStagingSettings:
        if self.chunk_bytes > self.pool_bytes:
            raise ValueError(f"chunk_bytes ({self.chunk_bytes}) exceeds pool_bytes ({self.pool_bytes})")
        return self


class Settings(BaseSettings):
    """All settings of ``kvsidecar serve``. Durations are seconds (``_ms``: milliseconds), each within
    the range its ``_duration`` gives; 0 is allowed only where the comment says what it means."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,
    )

    # Unix socket of EngineService (created with mode 0600; its directory 0700 if created).
    engine_socket: Path = Field(default_factory=default_engine_socket)
    # Optional loopback TCP address for EngineService (HOST:PORT); must be a loopback host.
    engine_tcp_listen: str | None = None
    # Who may call EngineService (kvsidecar.engine_auth): callers whose uid is listed, or whose
    # gid is (SO_PEERCRED, read on the credential socket next to the engine socket), besides the
    # daemon's own uid and root, which are always allowed (both can read the daemon's memory
    # anyway). Others get no session token and every engine call of theirs PERMISSION_DENIED.
    engine_allowed_uids: Annotated[list[int], NoDecode] = Field(default_factory=list)
    engine_allowed_gids: Annotated[list[int], NoDecode] = Field(default_factory=list)
    # Mode of the engine socket and its credential socket (octal, e.g. "0660"): the kernel's
    # first gate. Open it (0660 with a shared group, or 0666) so that allowed users of another
    # uid can connect at all; the token check then decides.
    engine_socket_mode: int = 0o600
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
    lease_seconds: Annotated[float, _duration(0.1, 86400.0)] = 30.0
    # Consumer heartbeat period; 0 means lease_seconds / 6.
    heartbeat_interval_seconds: Annotated[float, _duration(0.01, 3600.0, zero="lease_seconds / 6")] = 0.0
    # A producer may be asked about a request before its own SubmitBlocks reached it; "unknown"
    # counts as "lost" after this long (or at once if the producer had confirmed it before).
    producer_unknown_grace_seconds: Annotated[float, _duration(0.01, 600.0, zero="no grace")] = 2.0
    # Pull vouchers (kvsidecar.voucher): how long a producer engine's voucher may be valid. A
    # consumer holding a valid one reads without first confirming the lease with the producer's
    # sidecar; the producer holds vouched blocks that long even if the request is released
    # meanwhile (unless a consumer read them). 0: off (engines get no key, and a consumer ignores
    # vouchers).
    voucher_seconds: Annotated[float, _duration(0.01, 3600.0, zero="vouchers off")] = 10.0
    # Allowance for the two nodes' wall clocks (vouchers and push registrations carry Unix times):
    # the producer holds this much longer, a consumer stops using a voucher this much earlier, and
    # a producer stops posting a push's WRITEs this much before the consumer's write_by. Safe while
    # the consumer's clock is behind the producer's by less than twice this (vouchers) and the
    # producer's is behind the consumer's by less than this (push).
    voucher_clock_skew_seconds: Annotated[float, _duration(0.001, 600.0, zero="clocks in step")] = 0.5
    # A peer's Handshake, PushReg or Heartbeat naming an engine of ours that has not registered yet
    # (starting or restarting) waits this long for it before answering as before; capped at 80 % of
    # peer_call_timeout_seconds so the answer beats the caller's deadline. 0: fail at once.
    engine_arrival_wait_seconds: Annotated[float, _duration(0.01, 600.0, zero="fail at once")] = 2.0
    # Consecutive failed heartbeats after which a consumer gives up on a peer's requests.
    heartbeat_failures_allowed: int = Field(default=2, ge=1, le=100)
    # Consumer, push: a registered push that has not arrived by then fails (vLLM recomputes).
    push_registration_timeout_seconds: Annotated[float, _duration(0.1, 86400.0)] = 480.0
    # Bound on one pull (handshake + reads) and on one NIXL transfer.
    transfer_timeout_seconds: Annotated[float, _duration(0.1, 3600.0)] = 30.0
    # Default hold time for HoldBlocks (multi-turn).
    hold_ttl_seconds: Annotated[float, _duration(0.1, 86400.0)] = 480.0
    # Share of an engine's KV blocks its holds may occupy; past it the oldest holds are released
    # (the engine gets the blocks back), so holding for multi-turn reuse never starves it.
    hold_max_share: float = Field(default=0.25, gt=0.0, le=1.0)
    # Deadline of one PeerService call (handshake included).
    peer_call_timeout_seconds: Annotated[float, _duration(0.1, 600.0)] = 5.0
    # A worker that registered must open WatchEvents within this time or its registration is dropped.
    worker_attach_timeout_seconds: Annotated[float, _duration(0.1, 3600.0)] = 30.0
    # Graceful shutdown: in-flight calls and transfers get this long before the daemon exits.
    shutdown_grace_seconds: Annotated[float, _duration(0.01, 3600.0, zero="exit at once")] = 10.0
    # Directories from which shared-memory files may be mapped.
    shm_dirs: Annotated[list[Path], NoDecode] = Field(default_factory=lambda: [Path("/dev/shm")], min_length=1)
    # Largest gRPC message accepted or sent.
    max_message_bytes: int = Field(default=64 * 1024 * 1024, ge=1024 * 1024, le=1024 * 1024 * 1024)
    # Events buffered per worker before its stream is considered stuck and closed.
    max_queued_events: int = Field(default=65536, ge=16)
    # Limits against hostile or broken clients.
    max_blocks_per_request: int = Field(default=1 << 20, ge=1)
    max_pending_requests: int = Field(default=100_000, ge=1)
    # Admission by queueing delay (``core.admission``): a request whose estimated wait behind the
    # transfers this node already drives (in flight / measured throughput) exceeds this is refused
    # with RESOURCE_EXHAUSTED; a request with nothing ahead is always admitted. 0: the count
    # (``max_pending_requests``) is the only bound.
    admission_max_queue_delay_ms: Annotated[float, _duration(1.0, 60_000.0, zero="no bound", unit="ms")] = 0.0
    # Engines registered at once, and workers (TP x PP ranks) per engine; RegisterWorker beyond is
    # RESOURCE_EXHAUSTED. Each worker costs a NIXL agent (threads, sockets) and a memory mapping.
    max_engines: int = Field(default=32, ge=1, le=4096)
    max_workers_per_engine: int = Field(default=64, ge=1, le=262144)
    # Peer sidecars remembered (handshaken) and connected at once.
    max_peers: int = Field(default=1024, ge=1, le=1_000_000)
    # Per-request traces kept for EngineService/PeerService.Trace (a ring of the most recent
    # requests, each at most 64 events); 0 turns tracing off.
    trace_requests: int = Field(default=1024, ge=0, le=1_000_000)

    # Consumer-side check of moved KV: "digest" makes the consumer compare a digest of every
    # received block's logical content (token x head x bytes, whatever the layouts and block
    # sizes) with the producer's, and report LOAD_FAILED naming the first bad block on mismatch.
    # Costs a hash of the request's bytes on both sides (bench/README.md). The consumer's setting
    # decides; requests with several KV cache groups (hybrid models) move unchecked.
    integrity: Literal["off", "digest"] = "off"
    # Converted transfers (different block size, layout, or TP with a token-major layout) whose
    # descriptor runs average fewer bytes than this go through a registered staging buffer and a
    # local numpy permutation instead of one NIXL descriptor per run (bench/README.md).
    staging_below_bytes: int = Field(default=16384, ge=0, le=1 << 30)
    # GPU KV through the sidecar's pinned host pool (across nodes; see HostStagingSettings).
    host_staging: HostStagingSettings = Field(default_factory=HostStagingSettings)

    # mTLS between sidecars: all three set enables it on the peer port and for outgoing calls.
    peer_tls_cert: Path | None = None
    peer_tls_key: Path | None = None
    peer_tls_ca: Path | None = None

    nixl: NixlSettings = Field(default_factory=NixlSettings)

    # The TOML file read for this instance; set by load_settings, not a setting of its own.
    toml_file: ClassVar[Path | None] = None

    @field_validator("shm_dirs", mode="before")
    @classmethod
    def _shm_dirs_list(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("engine_allowed_uids", "engine_allowed_gids", mode="before")
    @classmethod
    def _id_list(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("engine_allowed_uids", "engine_allowed_gids")
    @classmethod
    def _check_ids(cls, value: list[int]) -> list[int]:
        for ident in value:
            if not 0 <= ident < 2**32 - 1:
                raise ValueError(f"{ident} is not a valid uid or gid")
        return value

    @field_validator("engine_socket_mode", mode="before")
    @classmethod
    def _octal_mode(cls, value: Any) -> Any:
        # "0660" from a flag, the environment or a TOML string is octal, as in chmod.
        if isinstance(value, str):
            try:
                return int(value, 8)
            except ValueError:
                raise ValueError(f"{value!r} is not an octal file mode (e.g. 0600, 0660)") from None
        return value

    @field_validator("engine_socket_mode")
    @classmethod
    def _check_mode(cls, value: int) -> int:
        if value & ~0o666 or value & 0o600 != 0o600:
            raise ValueError(f"{value:#o}: a socket mode gives read/write only, and the owner must have both")
        return value

    @field_validator("shm_dirs")
    @classmethod
    def _check_shm_dirs(cls, value: list[Path]) -> list[Path]:
        for directory in value:
            if not directory.is_absolute():
                raise ValueError(f"{directory} is not an absolute path")
            if not directory.is_dir():
                raise ValueError(f"{directory} is not an existing directory")
        return value

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
        # The credential socket next to it (kvsidecar.engine_auth) is 5 bytes longer.
        if len(os.fsencode(str(value))) > 107 - 5:
            raise ValueError(f"engine_socket path is longer than 102 bytes: {value}")
        return value

    @model_validator(mode="after")
    def _check_tls(self) -> Settings:
        tls = {"peer_tls_cert": self.peer_tls_cert, "peer_tls_key": self.peer_tls_key, "peer_tls_ca": self.peer_tls_ca}
        missing = [name for name, path in tls.items() if path is None]
        if missing and len(missing) < len(tls):
            given = [name for name in tls if name not in missing]
            raise ValueError(
                f"{', '.join(given)} set without {', '.join(missing)}: "
                "peer_tls_cert, peer_tls_key and peer_tls_ca must be set together"
            )
        tls_paths = list(tls.values())
        for path in tls_paths:
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


def load_settings(
    overrides: dict[str, Any] | None = None,
    config_file: Path | None = None,
    flags: Mapping[str, str] | None = None,
) -> Settings:
    """Build the settings: defaults < TOML file < environment < ``overrides`` (the CLI flags).

    The TOML file is ``config_file``, else ``$KVSIDECAR_CONFIG`` if set. ``flags`` maps a setting
    to the caller's own flag for it (e.g. ``lease_seconds`` -> ``--lease-seconds``), so that an
    error cites only flags that exist; any other setting is cited as ``--set NAME=...``.
    """
    if config_file is None and os.environ.get(ENV_PREFIX + "CONFIG"):
        config_file = Path(os.environ[ENV_PREFIX + "CONFIG"])
    if config_file is not None and config_file.is_dir():
        raise ConfigError(f"config file {config_file} is a directory, not a TOML file")
    if config_file is not None and not config_file.is_file():
        raise ConfigError(f"config file {config_file} does not exist")
    clean = {key: value for key, value in (overrides or {}).items() if value is not None}

    class _Settings(Settings):
        toml_file: ClassVar[Path | None] = config_file

    try:
        loaded = _Settings(**clean)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc, config_file, flags or {})) from None
    except SettingsError as exc:
        # pydantic-settings could not parse an environment value (e.g. a JSON object it expected).
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        raise ConfigError(f"{exc}{cause}") from None
    return Settings.model_construct(**{name: getattr(loaded, name) for name in Settings.model_fields})


def _describe_validation_error(exc: ValidationError, config_file: Path | None, flags: Mapping[str, str]) -> str:
    problems = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "finite_number":
            message = "is not a number (NaN and infinity are not allowed)"
        if not error["loc"]:  # a check across settings: its message names them
            problems.append(f"invalid settings: {message}")
            continue
        name = ".".join(str(part) for part in error["loc"] if not isinstance(part, int))
        in_file = f" or {config_file}" if config_file else ""
        value = error.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        if error["type"] == "extra_forbidden":
            # Not a setting: it came from --set or the file (or a nested variable, which the
            # environment source passes on); cite those and the closest real setting, nothing else.
            env = f", {_env_name(name)}" if "." in name else ""
            hint = _closest_setting(name)
            suggestion = f"; did you mean {hint!r} ({_origin(hint, flags, in_file)})?" if hint else ""
            problems.append(f"unknown setting {name!r}{shown} [from --set {name}=...{env}{in_file}]{suggestion}")
            continue
        problems.append(f"invalid setting {name!r}{shown}: {message} [from {_origin(name, flags, in_file)}]")
    return "; ".join(problems)


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.replace(".", "__").upper()


def _origin(name: str, flags: Mapping[str, str], in_file: str) -> str:
    """Where a setting may have come from: its flag if the caller has one, else ``--set``."""
    return f"{flags.get(name) or f'--set {name}=...'}, {_env_name(name)}{in_file}"


def setting_names() -> list[str]:
    """Every setting's name, nested ones as ``group.name``."""
    names: list[str] = []
    for name, field in Settings.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names.extend(f"{name}.{inner}" for inner in annotation.model_fields)
        else:
            names.append(name)
    return names


def _closest_setting(name: str) -> str | None:
    close = difflib.get_close_matches(name.lower(), setting_names(), n=1, cutoff=0.6)
    return close[0] if close else None


def _known_env_names() -> dict[str, str]:
    """Every ``KVSIDECAR_*`` variable the settings read -> its setting's name."""
    names = {ENV_PREFIX + "CONFIG": "config file"}
    for name, field in Settings.model_fields.items():
        names[ENV_PREFIX + name.upper()] = name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            for inner in annotation.model_fields:
                names[f"{ENV_PREFIX}{name.upper()}__{inner.upper()}"] = f"{name}.{inner}"
    return names


def unknown_env_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``KVSIDECAR_*`` variables no setting reads (typos), each with the closest known variable."""
    known = {name.removeprefix(ENV_PREFIX): name for name in _known_env_names()}
    unknown = []
    for variable in sorted(environ):
        upper = variable.upper()
        if upper.startswith(ENV_PREFIX) and upper.removeprefix(ENV_PREFIX) not in known:
            close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), list(known), n=1, cutoff=0.6)
            unknown.append((variable, known[close[0]] if close else None))
    return unknown
