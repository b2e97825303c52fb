"""One validated, frozen configuration object per component, from a TOML file and the environment.

Precedence: defaults < TOML file (``SPARSEETY_CONFIG`` or ``--config``) < ``SPARSEETY_*`` variables
< explicit overrides; pydantic-settings reads the variables and merges the sources.
A variable names its section and field: ``SPARSEETY_KAFKA_BOOTSTRAP``, ``SPARSEETY_TOPICS_PARTITIONS``,
``SPARSEETY_CLICKHOUSE_DSN``, ``SPARSEETY_PRIVACY_MODE``; top-level fields drop the section:
``SPARSEETY_DATA_DIR``. Dict fields take JSON: ``SPARSEETY_KAFKA_CLIENT='{"security.protocol": "SASL_SSL"}'``.

Only entry points (CLI, plugin activation, worker start) read the environment; everything else is
handed a :class:`Config` (or one of its sections). Secrets are :class:`pydantic.SecretStr` or
masked client options, so printing a config never shows them.
"""

from __future__ import annotations

import json
import os
import socket
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, create_model, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from sparseety.errors import ConfigError
from sparseety.tenants import shown, tenant_problem

ENV_PREFIX = "SPARSEETY_"
_SECRET_HINTS = ("password", "secret", "token", "key", "credentials")


def _is_secret_option(name: str) -> bool:
    lowered = name.lower()
    return any(h in lowered for h in _SECRET_HINTS) and not lowered.endswith(".location")


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KafkaConfig(_Section):
    """Where Kafka is, and librdkafka options passed through untouched (SASL/TLS, timeouts)."""

    bootstrap: str = "127.0.0.1:19092"
    client: dict[str, str] = Field(default_factory=dict)

    def __repr_args__(self) -> Any:
        masked = {k: ("**********" if _is_secret_option(k) else v) for k, v in self.client.items()}
        return [("bootstrap", self.bootstrap), ("client", masked)]

    def librdkafka(self, **extra: Any) -> dict[str, Any]:
        """librdkafka configuration: bootstrap + pass-through options + ``extra``."""
        return {"bootstrap.servers": self.bootstrap, **self.client, **extra}


class TopicsConfig(_Section):
    """Topic names and how to create them."""

    engine_events: str = "sparseety.engine-events"
    timelines: str = "sparseety.timelines"
    usage: str = "sparseety.usage"
    dlq: str = "sparseety.dlq"
    partitions: int = Field(4, ge=1, le=10_000)
    replication_factor: int = Field(1, ge=1, le=16)

    def all(self) -> list[str]:
        """Every topic SparSEEty owns."""
        return [self.engine_events, self.timelines, self.usage, self.dlq]

    def resolve(self, name: str) -> str:
        """A topic by role (engine-events, timelines, usage, dlq) or, failing that, its full name."""
        roles = {
            "engine-events": self.engine_events,
            "timelines": self.timelines,
            "usage": self.usage,
            "dlq": self.dlq,
        }
        return roles.get(name, name)


class RegistryConfig(_Section):
    """Confluent Schema Registry; empty url = Avro single-object encoding against schemas/."""

    url: str = ""
    basic_auth: SecretStr | None = None

    def client_conf(self) -> dict[str, Any]:
        """Configuration for ``confluent_kafka.schema_registry.SchemaRegistryClient``."""
        conf: dict[str, Any] = {"url": self.url}
        if self.basic_auth is not None:
            conf["basic.auth.user.info"] = self.basic_auth.get_secret_value()
        return conf


#: Tables a retention (``clickhouse.ttl_days``) may be set on, and the time column it counts from.
RETENTION = {"request_tokens": "finished_at", "requests": "finished_at"}


class ClickHouseConfig(_Section):
    """ClickHouse through clickhouse-connect: ``chdb:///abs/path`` (embedded) or ``http(s)://``."""

    dsn: str = ""  # empty: chdb:///<data_dir>/chdb
    database: str = "sparseety"
    # Retention per table in days (0 = keep forever), applied by every migrate; see RETENTION.
    ttl_days: dict[str, int] = Field(default_factory=lambda: {"request_tokens": 30})
    username: str = "default"
    password: SecretStr | None = None
    cluster: str = ""  # non-empty: ON CLUSTER DDL with Replicated engines

    @field_validator("dsn")
    @classmethod
    def _check_dsn(cls, v: str) -> str:
        if v and not v.startswith(("chdb://", "http://", "https://")):
            raise ValueError("dsn must start with chdb://, http:// or https://")
        return v

    @field_validator("ttl_days")
    @classmethod
    def _check_ttl(cls, v: dict[str, int]) -> dict[str, int]:
        for table, days in v.items():
            if table not in RETENTION:
                raise ValueError(f"no retention for table {table!r}: choose from {', '.join(RETENTION)}")
            if days < 0:
                raise ValueError(f"ttl_days.{table} must be >= 0 (0 = keep forever)")
        return v

    @field_validator("database")
    @classmethod
    def _check_db(cls, v: str) -> str:
        if not v.replace("_", "").isalnum():
            raise ValueError("database must be letters, digits and underscores")
        return v


class PrivacyConfig(_Section):
    """How prompt token ids leave the engine: raw ids, keyed hashes, or not at all."""

    mode: Literal["raw", "hashed", "none"] = "raw"
    key: SecretStr | None = None

    @field_validator("key")
    @classmethod
    def _check_key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError("privacy key must be at least 16 characters")
        return v

    def model_post_init(self, _context: Any) -> None:
        if self.mode == "hashed" and self.key is None:
            raise ValueError("privacy mode 'hashed' needs privacy.key")


class ProducerConfig(_Section):
    """Engine-side producer: hand-off queue, memory bound, disk spill, heartbeats."""

    engine_name: str = ""  # empty: <hostname>-<port or pid>
    queue_max_events: int = Field(50_000, ge=16)
    memory_limit_bytes: int = Field(64 * 1024 * 1024, ge=1024 * 1024)
    spill_dir: str = ""  # empty: <data_dir>/spill
    spill_max_bytes: int = Field(4 * 1024**3, ge=1024 * 1024)
    heartbeat_interval_s: float = Field(5.0, gt=0)
    # EngineStarted is sent again this often, and whenever Kafka takes events again after an
    # outage, so that a fresh worker or a broker that lost its log gets the configuration back.
    announce_interval_s: float = Field(60.0, gt=0)
    flush_timeout_s: float = Field(15.0, ge=0)
    linger_ms: int = Field(20, ge=0)
    compression: Literal["zstd", "lz4", "gzip", "snappy", "none"] = "zstd"
    routing_capture: bool = False
    # Where events are encoded and produced: "process" (a relay child of the engine process),
    # "unix:<socket path>" (a `sparseety relay --socket` sidecar) or "thread" (in the engine
    # process; its Python competes with the engine's for the GIL).
    relay: str = Field("process", pattern=r"^(process|thread|unix:.+)$")


class ProxyConfig(_Section):
    """The OpenAI-compatible proxy producer."""

    # The tenant header / vllm_xargs.tenant name the tenant only when every request comes through
    # a gateway that sets them; otherwise any client could bill any tenant.
    trust_tenant_header: bool = False
    read_timeout_s: float = Field(600.0, gt=0)  # upstream read timeout (a long generation)


#: The worker group's session timeout where ``worker.session_timeout_s`` is not set: on Apache
#: Kafka its default ``group.min.session.timeout.ms``, the least it takes ...
KAFKA_SESSION_TIMEOUT_S = 6.0
#: ... and on the embedded broker, whose join rounds last half of it (docs/operations.md, "Failover").
EMBEDDED_SESSION_TIMEOUT_S = 2.0


def group_session_timeout(value: float | None) -> float:
    """A consumer group's session timeout as set, or :data:`KAFKA_SESSION_TIMEOUT_S` where unset
    (the embedded broker fills in its own, ``EmbeddedBroker.client_config``)."""
    return KAFKA_SESSION_TIMEOUT_S if value is None else value


class WorkerConfig(_Section):
    """Faust assembler worker."""

    app_id: str = "sparseety-assembler"
    window_s: float = Field(60.0, gt=0)
    allowed_lateness_s: float = Field(30.0, ge=0)
    idle_timeout_s: float = Field(600.0, gt=0)
    prefix_index_max_blocks: int = Field(1_000_000, ge=1)
    closed_retention_s: float = Field(300.0, ge=0)
    reorder_max_events: int = Field(10_000, ge=1)
    routing_wait_s: float = Field(10.0, ge=0)
    take_max: int = Field(500, ge=1)
    take_within_s: float = Field(0.2, gt=0)
    # How long the broker may hold the worker's fetch that found nothing. Apache Kafka answers as
    # soon as a record arrives; the embedded Tansu holds such a fetch for most of the wait
    # (Faust's fixed 1.5 s delayed records by up to that: streams/compat.py item 9). Lower means
    # more idle fetch requests (10 a second at 0.1 s), not more CPU under load.
    fetch_wait_s: float = Field(0.1, gt=0, le=30)
    tick_interval_s: float = Field(5.0, gt=0)
    metrics_port: int = Field(0, ge=0, le=65535)  # 0: no Prometheus endpoint
    # How soon the group notices a dead worker and gives its partitions to another (or to its
    # restarted self); the heartbeat goes every min(3 s, a third of it). None (the default) means
    # EMBEDDED_SESSION_TIMEOUT_S on the embedded broker (Stack and EmbeddedBroker.client_config
    # set it) and KAFKA_SESSION_TIMEOUT_S elsewhere: the embedded Tansu holds every JoinGroup for
    # half of it and a follower's SyncGroup for up to 0.8 of it, so a restarted worker waits ~1 s
    # at 2 s, 3 s at 6 s, and 11 s when it meets its dead self still leading the group, while
    # Apache Kafka refuses less than its group.min.session.timeout.ms (6 s by default) and a
    # worker would fail to join. docs/operations.md, "Failover".
    session_timeout_s: float | None = Field(None, gt=0)
    commit_interval_s: float = Field(2.8, gt=0)
    standby_replicas: int = Field(0, ge=0)

    @property
    def session_timeout(self) -> float:
        """``session_timeout_s``, or Apache Kafka's default floor where it is not set."""
        return group_session_timeout(self.session_timeout_s)


class SinkConfig(_Section):
    """Sink consumer: batch by size and time, write, then commit."""

    group_id: str = "sparseety-sink"
    batch_max_rows: int = Field(50_000, ge=1)
    batch_interval_s: float = Field(1.0, gt=0)
    max_retries: int = Field(8, ge=0)
    retry_backoff_s: float = Field(0.5, ge=0)
    # The sink group's session timeout, resolved as worker.session_timeout_s's (unset: 2 s on the
    # embedded broker, 6 s elsewhere; 30 s before issue 33). librdkafka heartbeats from its own
    # thread, so a long ClickHouse insert does not miss one. The embedded broker holds a JoinGroup
    # for half of it: at 30 s every store start waited 15 s before its sink had partitions.
    session_timeout_s: float | None = Field(None, gt=0)

    @property
    def session_timeout(self) -> float:
        """``session_timeout_s``, or Apache Kafka's default floor where it is not set."""
        return group_session_timeout(self.session_timeout_s)


def _checked_tenants(tenants: list[str]) -> list[str]:
    """Tenant names of a token (``*`` = all), each a tenant name (:mod:`sparseety.tenants`)."""
    for t in tenants:
        rule = None if t == "*" else tenant_problem(t)
        if rule is not None:
            raise ValueError(f"{shown(t)} is not a tenant name: {rule}")
    return tenants


class ApiToken(_Section):
    """One bearer token with permissions beyond its tenants (``api.tokens`` value as a table).

    ``token_ids``: may read token content (ids, keyed hashes, decoded text) of its tenants'
    requests; without it a token sees token counts and statuses only.
    """

    tenants: list[str]
    token_ids: bool = False

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: list[str]) -> list[str]:
        return _checked_tenants(tenants)


class QueryLimits(_Section):
    """Limits on each store query of one kind of caller (``api.limits.tenant`` / ``.admin``).

    They are ClickHouse's own settings, set by the store on every statement the caller's request
    runs (the API's queries and your own SQL); a query cannot change them. A query past one of
    them fails with ClickHouse's message, which names the limit.
    """

    #: Wall time of one statement (``max_execution_time``).
    max_execution_time_s: float = Field(10.0, gt=0, le=3600)
    #: Memory of one statement (``max_memory_usage``).
    max_memory_bytes: int = Field(1 << 30, ge=1 << 20)
    #: Rows of one answer of your own SQL (more are cut, ``result_overflow_mode = 'break'``).
    max_result_rows: int = Field(100_000, ge=1)
    #: Bytes one statement reads from tables (``max_bytes_to_read``).
    max_bytes_to_read: int = Field(10 << 30, ge=1 << 20)
    #: Requests of one token whose store queries run at once; one more is answered 429.
    max_concurrent: int = Field(2, ge=1, le=64)

    def settings(self) -> dict[str, Any]:
        """The ClickHouse settings of every statement (the result-row cap is your own SQL's)."""
        return {
            "max_execution_time": self.max_execution_time_s,
            "max_memory_usage": self.max_memory_bytes,
            "max_bytes_to_read": self.max_bytes_to_read,
        }

    def sql_settings(self) -> dict[str, Any]:
        """:meth:`settings` and the result-row cap, for your own SQL."""
        return {**self.settings(), "max_result_rows": self.max_result_rows, "result_overflow_mode": "break"}


class ApiLimits(_Section):
    """What one API caller may cost the store (docs/operations.md, "Limits").

    ``readers``: read-only store clients (one thread each) that serve the API's queries, apart
    from the store's own thread (the sink's writes and ``/healthz``). ``max_body_bytes``: the
    largest request body, refused (413) before authentication; ``max_sql_bytes``: the largest SQL
    text (``/api/v1/sql``, ``/clickhouse``).
    """

    tenant: QueryLimits = QueryLimits()
    admin: QueryLimits = QueryLimits(
        max_execution_time_s=60.0, max_memory_bytes=4 << 30, max_bytes_to_read=100 << 30, max_concurrent=4
    )
    readers: int = Field(4, ge=1, le=64)
    max_body_bytes: int = Field(1 << 20, ge=1 << 10)
    max_sql_bytes: int = Field(256 << 10, ge=1 << 10)


class ApiConfig(_Section):
    """HTTP API: bind address and bearer tokens scoped to tenants (``*`` = all tenants).

    A token's value is its tenant list, or an :class:`ApiToken` table that adds permissions.
    """

    host: str = "127.0.0.1"
    port: int = Field(8765, ge=0, le=65535)
    tokens: dict[str, list[str] | ApiToken] = Field(default_factory=dict)

    @field_validator("tokens")
    @classmethod
    def _token_tenants(cls, tokens: dict[str, list[str] | ApiToken]) -> dict[str, list[str] | ApiToken]:
        for grant in tokens.values():
            if isinstance(grant, list):
                _checked_tenants(grant)
        return tokens

    # served model name -> its tokenizer on this machine (a path), for token records' text; a
    # model not listed is tried by its own name (a path, or the local Hugging Face cache)
    tokenizers: dict[str, str] = Field(default_factory=dict)
    limits: ApiLimits = ApiLimits()

    def __repr_args__(self) -> Any:
        return [
            ("host", self.host),
            ("port", self.port),
            ("tokens", f"<{len(self.tokens)} tokens>"),
            ("limits", self.limits),
        ]


class OtelConfig(_Section):
    """OpenTelemetry export (the ``otel`` sink): one span per request over OTLP.

    Empty ``endpoint``: the exporter's own default, which honours the standard
    ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` variables. An ``http/protobuf`` endpoint given as a
    base URL (``http://collector:4318``) gets ``/v1/traces`` appended.
    """

    endpoint: str = ""
    protocol: Literal["grpc", "http/protobuf"] = "http/protobuf"
    headers: dict[str, str] = Field(default_factory=dict)  # e.g. authorization: secret
    insecure: bool = False  # grpc: plaintext instead of TLS
    timeout_s: float = Field(10.0, gt=0)
    service_name: str = "sparseety"
    provider_name: str = ""  # gen_ai.provider.name; empty: the record's engine_kind (vllm)
    max_queue_size: int = Field(8192, ge=1)
    max_export_batch_size: int = Field(512, ge=1)
    schedule_delay_ms: int = Field(1000, ge=1)

    def __repr_args__(self) -> Any:
        masked = {k: "**********" for k in self.headers}
        return [(k, masked if k == "headers" else v) for k, v in super().__repr_args__()]


class BrokerConfig(_Section):
    """Embedded Kafka-protocol broker (Tansu) for one-machine stacks and tests."""

    host: str = "127.0.0.1"
    port: int = Field(19092, ge=1, le=65535)


class Config(_Section):
    """Everything SparSEEty reads, for every component."""

    data_dir: Path = Path("~/.sparseety")
    kafka: KafkaConfig = KafkaConfig()
    topics: TopicsConfig = TopicsConfig()
    schema_registry: RegistryConfig = RegistryConfig()
    clickhouse: ClickHouseConfig = ClickHouseConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    producer: ProducerConfig = ProducerConfig()
    proxy: ProxyConfig = ProxyConfig()
    worker: WorkerConfig = WorkerConfig()
    sink: SinkConfig = SinkConfig()
    api: ApiConfig = ApiConfig()
    otel: OtelConfig = OtelConfig()
    broker: BrokerConfig = BrokerConfig()

    @property
    def data_path(self) -> Path:
        """The data directory, user-expanded and absolute."""
        return self.data_dir.expanduser().absolute()

    @property
    def clickhouse_dsn(self) -> str:
        """The configured DSN, or the embedded chDB path under the data dir."""
        return self.clickhouse.dsn or f"chdb://{self.data_path / 'chdb'}"

    @property
    def spill_path(self) -> Path:
        """Where producers spill events while Kafka is away."""
        return (
            Path(self.producer.spill_dir).expanduser()
            if self.producer.spill_dir
            else (self.data_path / "spill")
        )

    def engine_name(self, hint: str = "") -> str:
        """Configured engine name, or ``<host>-<hint or pid>``."""
        return self.producer.engine_name or f"{socket.gethostname()}-{hint or os.getpid()}"

    def replace(self, **changes: Any) -> Config:
        """A copy with top-level fields or whole sections replaced (validated again)."""
        data = self.model_dump()
        for k, v in changes.items():
            data[k] = v.model_dump() if isinstance(v, BaseModel) else v
        return _validate(data, "replace()")


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors())


def _validate(data: Mapping[str, Any], origin: str) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid configuration ({origin}): {_problems(exc)}", origin=origin) from None


class _Variables(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping: library code never reads
    ``os.environ`` (entry points pass it), so the variables come from the caller."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._given = {k.lower(): v for k, v in env.items() if k.upper() != ENV_PREFIX + "CONFIG"}
        # SPARSEETY_<SECTION>_<FIELD>: the first underscore after the section ends it (a field
        # keeps its own underscores); dict and list fields are JSON.
        super().__init__(
            settings_cls,
            case_sensitive=False,
            env_prefix=ENV_PREFIX,
            env_nested_delimiter="_",
            env_nested_max_split=1,
        )

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return self._given


#: Config's fields as settings: pydantic-settings reads the sources into them and merges them.
_Fields = create_model(  # type: ignore[call-overload]
    "_Fields",
    __base__=BaseSettings,
    __config__=None,
    **{name: (f.annotation, f) for name, f in Config.model_fields.items()},
)
_Fields.model_config = SettingsConfigDict(frozen=True, extra="forbid")


#: The variables' and the file's settings of the :func:`load_config` call in progress.
_SOURCES: ContextVar[tuple[dict[str, Any], dict[str, Any]]] = ContextVar("sparseety_config_sources")


class _Loaded(_Fields):  # type: ignore[misc, valid-type]
    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # first wins: the overrides (init), the variables, the file
        variables, data = _SOURCES.get()
        return (
            init_settings,
            InitSettingsSource(settings_cls, variables),
            InitSettingsSource(settings_cls, data),
        )


def _variables() -> set[str]:
    """Every ``SPARSEETY_*`` variable that names a setting."""
    out = {ENV_PREFIX + "CONFIG"}
    for name, f in Config.model_fields.items():
        model = f.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            out.update(f"{ENV_PREFIX}{name}_{field}".upper() for field in model.model_fields)
        else:
            out.add(f"{ENV_PREFIX}{name}".upper())
    return out


_VARIABLES = frozenset(_variables())


def _check_variables(env: Mapping[str, str]) -> None:
    for var in sorted(env):
        if var.upper().startswith(ENV_PREFIX) and var.upper() not in _VARIABLES:
            raise ConfigError(f"unknown configuration variable {var}", variable=var)


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """The ``SPARSEETY_*`` variables as a nested dict of overrides (pydantic-settings' reading).

    Raises:
        ConfigError: a variable names no known section or field, or holds bad JSON.
    """
    _check_variables(env)
    try:
        return dict(_Variables(_Fields, env)())
    except SettingsError as exc:
        section = str(exc).split('"')[1] if '"' in str(exc) else ""
        names = sorted(v for v in env if v.upper().startswith(f"{ENV_PREFIX}{section}_".upper()))
        raise ConfigError(
            f"{' or '.join(names) or 'a variable'} must be JSON: {exc}", variable=names
        ) from None


def load_config(
    path: str | Path | None = None, env: Mapping[str, str] | None = None, **overrides: Any
) -> Config:
    """Build the configuration from a TOML file, the environment and explicit overrides.

    pydantic-settings reads the sources and deep-merges them, later over earlier: the file, the
    ``SPARSEETY_*`` variables, then ``overrides``.

    Args:
        path: TOML file; default ``env['SPARSEETY_CONFIG']`` when set, else none.
        env: Environment to read ``SPARSEETY_*`` from; pass ``os.environ`` at entry points.
            Default: no environment at all (library code never reads it implicitly).
        overrides: Top-level fields or sections (dicts) applied last.

    Raises:
        ConfigError: unreadable file, unknown variable, or a value that fails validation.
    """
    env = env or {}
    path = path or env.get(ENV_PREFIX + "CONFIG") or None
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).expanduser().read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}", path=str(path)) from None
    origin = str(path) if path else "defaults+environment"
    variables = env_overrides(env)

    token = _SOURCES.set((variables, data))
    try:
        loaded = _Loaded(**overrides)
    except ValidationError as exc:
        raise ConfigError(f"invalid configuration ({origin}): {_problems(exc)}", origin=origin) from None
    finally:
        _SOURCES.reset(token)
    return _validate(dict(loaded), origin)


MASK = "**********"


def masked_dict(cfg: Config) -> dict[str, Any]:
    """The configuration as plain data with every secret replaced by ``MASK`` (for printing)."""
    data = cfg.model_dump(mode="json")  # SecretStr fields dump as "**********"
    data["kafka"]["client"] = {k: (MASK if _is_secret_option(k) else v) for k, v in cfg.kafka.client.items()}
    data["otel"]["headers"] = {k: MASK for k in cfg.otel.headers}
    # Bearer tokens are the keys: show each one's tenant scope under a placeholder name.
    data["api"]["tokens"] = {
        f"<token {i + 1}>": t if isinstance(t, list) else t.model_dump()
        for i, t in enumerate(cfg.api.tokens.values())
    }
    return data


def to_toml(cfg: Config) -> str:
    """The effective configuration as a TOML file (secrets masked): what ``--config`` reads.

    Unset optional values (``None``) are left out: TOML has no null, and leaving them out means
    the same default.
    """
    data = {
        k: {f: x for f, x in v.items() if x is not None} if isinstance(v, dict) else v
        for k, v in masked_dict(cfg).items()
        if v is not None
    }
    return tomli_w.dumps(data)


def to_env(cfg: Config) -> dict[str, str]:
    """``SPARSEETY_*`` variables that reproduce ``cfg`` in a child process (secrets included:
    pass them only to processes you start, never print them)."""
    out: dict[str, str] = {}
    for name, value in cfg:
        if isinstance(value, BaseModel):
            for field_name, v in value:
                if v is None:
                    continue
                if isinstance(v, SecretStr):
                    v = v.get_secret_value()
                if isinstance(v, BaseModel):  # a section within a section (api.limits): JSON
                    v = v.model_dump()
                text = (
                    json.dumps(v, default=lambda o: o.model_dump())  # api.tokens may hold ApiTokens
                    if isinstance(v, (dict, list))
                    else str(v).lower()
                    if isinstance(v, bool)
                    else str(v)
                )
                out[f"{ENV_PREFIX}{name}_{field_name}".upper()] = text
        else:
            out[f"{ENV_PREFIX}{name}".upper()] = str(value)
    return out


def is_configured(env: Mapping[str, str]) -> bool:
    """Whether SparSEEty was asked for in this environment (the vLLM plugin's activation rule)."""
    return bool(env.get(ENV_PREFIX + "CONFIG") or env.get(ENV_PREFIX + "KAFKA_BOOTSTRAP"))
