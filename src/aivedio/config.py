"""Configuration: one typed settings object read from ``AIVEDIO_*`` once, at the edge.

``Settings.from_env()`` is called by the CLI only. Each component receives the small config object
it needs (``settings.database``, ``settings.api`` ...); no other module reads the environment.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from aivedio.channels import broadcast_channel

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(d|h|m|s)?\s*$")
_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, None: 1.0}


def parse_duration(value: object) -> object:
    """``7d``, ``72h``, ``30m``, ``90s`` or plain seconds; anything else goes to pydantic's own
    timedelta parsing (ISO 8601 ``P7D``)."""
    if isinstance(value, int | float):
        return timedelta(seconds=value)
    if isinstance(value, str) and (match := _DURATION.match(value.lower())):
        return timedelta(seconds=float(match[1]) * _UNIT_S[match[2]])
    return value


# The longest provider retry window we know of (OpenAI retries webhooks for up to 72 h; fal 10
# times in 2 h; Svix-style senders about 28 h): the callback dedup window must exceed it.
LONGEST_PROVIDER_RETRY = timedelta(hours=72)


@dataclass(frozen=True, slots=True)
class DatabaseConfig:
    url: str
    min_size: int = 2
    max_size: int = 10
    acquire_timeout_s: float = 2.0
    command_timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class StateConfig:
    """The state service's progress coalescing policy."""

    coalesce_min_points: int = 5
    coalesce_min_interval: timedelta = timedelta(seconds=1.5)


@dataclass(frozen=True, slots=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    public_url: str = "http://127.0.0.1:8000"
    idempotency_ttl: timedelta = timedelta(hours=24)
    retry_after_s: int = 2  # the Retry-After of a 503 when the database is unavailable
    page_size_max: int = 200
    body_limit_bytes: int = 64 * 1024
    providers: frozenset[str] = frozenset({"sandbox"})


@dataclass(frozen=True, slots=True)
class ServicesConfig:
    """Where the embedded servers live when no URL is configured."""

    data_dir: Path
    database_url: str | None
    redis_url: str | None
    nats_url: str | None


class Settings(BaseSettings):
    """Every ``AIVEDIO_*`` variable, typed. Read once by the CLI."""

    model_config = SettingsConfigDict(env_prefix="AIVEDIO_", extra="ignore", frozen=True)

    database_url: str | None = None
    redis_url: str | None = None
    nats_url: str | None = None
    data_dir: Path = Field(default=Path(".aivedio"))
    public_url: str = "http://127.0.0.1:8000"
    host: str = "127.0.0.1"
    port: int = 8000
    reuse_port: bool = False  # SO_REUSEPORT: several `aivedio run` processes on one port
    callback_max_inflight: int = Field(default=2, ge=1)  # group-commit batches at once
    db_pool_min: int = 2
    db_pool_max: int = 10
    db_acquire_timeout_s: float = 2.0
    db_command_timeout_s: float = 10.0
    coalesce_min_points: int = 5
    coalesce_min_interval_s: float = 1.5
    idempotency_ttl_s: int = 24 * 3600
    sandbox_url: str = "http://127.0.0.1:8100"
    sandbox_api_key: str = "sandbox-key"
    sandbox_webhook_secrets: str = "whsec_c2FuZGJveC1kZWZhdWx0LXNlY3JldC0wMDAwMDAwMA=="
    sandbox_enabled: bool = True
    # The other provider dialects are configured when their credential is set (see
    # providers.registry.providers_config and docs/reference/configuration.md).
    replicate_api_token: str | None = None
    replicate_webhook_secrets: str = ""
    replicate_url: str = "https://api.replicate.com"
    fal_api_key: str | None = None
    fal_app_id: str = ""
    fal_url: str = "https://queue.fal.run"
    fal_jwks_url: str = "https://rest.alpha.fal.ai/.well-known/jwks.json"
    fal_user_ids: str = ""
    runway_api_key: str | None = None
    runway_url: str = "https://api.dev.runwayml.com"
    runway_api_version: str = "2024-11-06"
    kling_access_key: str | None = None
    kling_secret_key: str = ""
    kling_url: str = "https://api-singapore.klingai.com"
    kling_callback_secrets: str = ""
    log_level: str = "INFO"
    secret_key: str | None = None
    gateway_channel: str = broadcast_channel()
    gateway_heartbeat_s: float = 20.0
    gateway_session_cap_s: float = 1800.0
    gateway_replay_cap: int = 1000
    gateway_tailcheck_s: float = 5.0
    gateway_max_conns_per_user: int = 50
    gateway_max_conns_per_tenant: int = 5000
    gateway_connect_rate_per_s: float = 2000.0
    gateway_timing: bool = False  # diagnostic timing comments in SSE frames (GatewayConfig)
    # Fan-out from the dispatcher to the gateways: one broadcast channel, or node-directed
    # (each gateway node its own channel and project -> node routes in Redis).
    fanout: Literal["broadcast", "node"] = "broadcast"
    gateway_node_id: str = ""  # node fan-out: this process's node id ("" -> generated)
    stream_token_ttl_s: int = 60
    session_ttl_s: int = 8 * 3600
    ws_allowed_origins: str = ""  # comma-separated; empty: only the request's own origin
    # The bus: a NATS URL may list several servers, comma-separated (a NATS cluster); streams
    # are created with this many replicas (3 on a three-node JetStream cluster).
    # Which bus adapter: NATS JetStream (AIVEDIO_NATS_URL) or Redis Streams on the Redis /
    # Valkey of AIVEDIO_REDIS_URL (docs/reference/configuration.md).
    bus: Literal["jetstream", "redis-streams"] = "jetstream"
    bus_replicas: int = Field(default=1, ge=1, le=5)
    # The JetStream stream and the subject prefix (deployments sharing one NATS keep apart by
    # these; the tests give each session its own).
    bus_stream: str = Field(default="AIVEDIO", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    bus_subject_prefix: str = Field(default="aivedio", pattern=r"^[a-z0-9_-]{1,64}$")
    # Leases: how long a claim keeps work away from the other replicas; a replica that dies or
    # freezes holding one delays that work by this much (aivedio chaos runs with short ones).
    inbox_lease_s: float = Field(default=60.0, gt=0)
    # A signed terminal callback (succeeded / failed / canceled) applied only after the
    # provider's own record confirms it (one query each): for a provider whose webhooks may
    # contradict its record (the sandbox's contradictory_terminal chaos; aivedio chaos sets it).
    inbox_confirm_terminals: bool = False
    poll_lease_s: float = Field(default=30.0, gt=0)
    submit_lease_s: float = Field(default=120.0, gt=0)
    cancel_lease_s: float = Field(default=60.0, gt=0)
    media_lease_s: float = Field(default=60.0, gt=0)
    bus_ack_wait_s: float = Field(default=30.0, gt=0)  # an unacked delivery comes back after it
    poll_limits: str = ""
    poll_replicas: int = 1
    poll_concurrency: int = 64
    # Retention (the maintenance role; docs/explanation/retention.md). Durations: 7d, 72h, 30m,
    # 90s, seconds, or ISO 8601.
    event_retention: timedelta = timedelta(days=7)
    event_partitions_ahead: int = Field(default=7, ge=1, le=366)
    outbox_retention: timedelta = timedelta(days=1)
    callback_dedup_window: timedelta = timedelta(days=7)
    maintenance_interval_s: float = Field(default=300.0, gt=0)
    maintenance_batch: int = Field(default=1000, ge=1)

    _durations = field_validator(
        "event_retention", "outbox_retention", "callback_dedup_window", mode="before"
    )(parse_duration)

    @field_validator("event_retention")
    @classmethod
    def _one_partition_at_least(cls, value: timedelta) -> timedelta:
        if value < timedelta(days=1):
            raise ValueError("must be at least 1 day (task_events keeps whole days)")
        return value

    @field_validator("callback_dedup_window")
    @classmethod
    def _outlasts_provider_retries(cls, value: timedelta) -> timedelta:
        if value <= LONGEST_PROVIDER_RETRY:
            raise ValueError(
                "must exceed the longest provider retry window (72h: OpenAI); a duplicate "
                "arriving later would be stored as a new callback"
            )
        return value

    def master_secret(self) -> bytes:
        """The key every signing secret is derived from (stream tokens, callback tokens,
        playback links). ``AIVEDIO_SECRET_KEY`` when set (share it between processes); else a
        random key kept in ``<data_dir>/secret.key``, created on first use with mode 0600."""
        if self.secret_key:
            return self.secret_key.encode()
        path = self.data_dir / "secret.key"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".secret.key.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_hex(32))
            try:
                os.link(tmp, path)  # atomic: a concurrent first start keeps one key
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        return path.read_text().strip().encode()

    def derived_secret(self, purpose: str) -> bytes:
        """A separate key per purpose, so a leak of one signing key exposes nothing else."""
        return hmac.new(self.master_secret(), purpose.encode(), hashlib.sha256).digest()

    @classmethod
    def from_env(cls) -> Settings:
        return cls()

    def listening_on(self, port: int) -> Settings:
        """These settings for a process that listens on ``port``; unless AIVEDIO_PUBLIC_URL was
        given, providers call back at this host and port."""
        update: dict[str, object] = {"port": port}
        if "public_url" not in self.model_fields_set:
            update["public_url"] = f"http://{self.host}:{port}"
        return self.model_copy(update=update)

    def database(self, url: str | None = None) -> DatabaseConfig:
        resolved = url or self.database_url
        if resolved is None:
            raise ValueError("no database URL: set AIVEDIO_DATABASE_URL or run `services up`")
        return DatabaseConfig(
            url=resolved,
            min_size=self.db_pool_min,
            max_size=self.db_pool_max,
            acquire_timeout_s=self.db_acquire_timeout_s,
            command_timeout_s=self.db_command_timeout_s,
        )

    @property
    def state(self) -> StateConfig:
        return StateConfig(
            coalesce_min_points=self.coalesce_min_points,
            coalesce_min_interval=timedelta(seconds=self.coalesce_min_interval_s),
        )

    def provider_names(self) -> frozenset[str]:
        """The providers these settings configure (a task may name only these)."""
        configured = {
            "sandbox": self.sandbox_enabled,
            "replicate": self.replicate_api_token is not None,
            "fal": self.fal_api_key is not None,
            "runway": self.runway_api_key is not None,
            "kling": self.kling_access_key is not None,
        }
        return frozenset(name for name, on in configured.items() if on)

    @property
    def api(self) -> ApiConfig:
        return ApiConfig(
            host=self.host,
            port=self.port,
            public_url=self.public_url,
            idempotency_ttl=timedelta(seconds=self.idempotency_ttl_s),
            providers=self.provider_names(),
        )

    @property
    def services(self) -> ServicesConfig:
        return ServicesConfig(
            data_dir=self.data_dir,
            database_url=self.database_url,
            redis_url=self.redis_url,
            nats_url=self.nats_url,
        )
