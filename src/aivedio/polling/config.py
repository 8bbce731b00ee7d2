"""Poller and rate-limit configuration: frozen objects built at the edge, passed to constructors.

``parse_limits`` reads the one-line form an operator writes in ``AIVEDIO_POLL_LIMITS``::

    global=400/20,provider:sandbox=160/8,model:sandbox/m1=100/5,tenant=60/5,tenant:<uuid>=10/2

each ``qps/burst``. Unnamed levels keep their defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from aivedio.channels import INTEREST_PREFIX, RATE_LIMIT_PREFIX
from aivedio.polling.buckets import Limit
from aivedio.polling.policy import BreakerConfig, PollPolicy


def _sandbox_default() -> dict[str, Limit]:
    return {"sandbox": Limit(160.0, 8.0)}


@dataclass(frozen=True, slots=True)
class RateLimitConfig:
    """Token buckets at four levels: global, provider, provider+model, tenant.

    - ``providers`` / ``models`` (key ``"provider/model"``) / ``tenants`` (key: tenant id)
      override the ``default_*`` limits; a model without its own limit has no model bucket
      beyond its provider's (``default_model`` None).
    - ``replicas``: how many poller processes share the limits. When Redis is unreachable each
      one takes from LOCAL buckets holding ``limit / max(replicas, replicas seen in Redis)``,
      which start empty: slower, never over.
    - ``prefix``: Redis key prefix; every bucket key carries it as a hash tag so the one script
      that takes from all four buckets runs on one Redis Cluster slot.
    - ``redis_timeout_s``: a Redis call slower than this counts as Redis unavailable.
    - ``redis_retry_s``: how often a limiter in fallback mode tries Redis again.
    """

    global_limit: Limit = field(default_factory=lambda: Limit(400.0, 20.0))
    providers: Mapping[str, Limit] = field(default_factory=_sandbox_default)
    default_provider: Limit = field(default_factory=lambda: Limit(50.0, 5.0))
    models: Mapping[str, Limit] = field(default_factory=dict)
    default_model: Limit | None = None
    tenant: Limit = field(default_factory=lambda: Limit(100.0, 10.0))
    tenants: Mapping[str, Limit] = field(default_factory=dict)
    replicas: int = 1
    prefix: str = RATE_LIMIT_PREFIX
    redis_timeout_s: float = 0.25
    redis_retry_s: float = 1.0
    heartbeat_s: float = 5.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if min(self.redis_timeout_s, self.redis_retry_s, self.heartbeat_s) <= 0:
            raise ValueError("redis_timeout_s, redis_retry_s and heartbeat_s must be positive")

    def provider_limit(self, provider: str) -> Limit:
        return self.providers.get(provider, self.default_provider)

    def model_limit(self, provider: str, model: str) -> Limit | None:
        return self.models.get(f"{provider}/{model}", self.default_model)

    def tenant_limit(self, tenant: str) -> Limit:
        return self.tenants.get(tenant, self.tenant)


@dataclass(frozen=True, slots=True)
class PollerConfig:
    """One poller process.

    - ``concurrency``: queries in flight at once.
    - ``batch``: attempts claimed per statement.
    - ``lease_s``: how long a claim holds an attempt (a query is cut off at half of it).
    - ``idle_s``: sleep when nothing is due.
    - ``stretch_refresh_s``: how often the in-flight poll demand is re-read to stretch intervals.
    - ``utilization``: the share of each rate limit the scheduler plans to use.
    - ``skip_unchanged``: a query whose sequence and status equal what the attempt already
      recorded changes nothing; skip the state-service transaction (no audit row).
    - ``credential``: the name of the credential each provider adapter uses (breaker key).
    """

    concurrency: int = 64
    batch: int = 64
    lease_s: float = 30.0
    idle_s: float = 0.25
    stretch_refresh_s: float = 5.0
    utilization: float = 0.9
    skip_unchanged: bool = True
    policy: PollPolicy = field(default_factory=PollPolicy)
    provider_breaker: BreakerConfig = field(default_factory=BreakerConfig)
    credential_breaker: BreakerConfig = field(
        default_factory=lambda: BreakerConfig(threshold=1, cool_down_s=60.0, max_cool_down_s=900.0)
    )
    limits: RateLimitConfig = field(default_factory=RateLimitConfig)
    interest_prefix: str = INTEREST_PREFIX

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.batch < 1:
            raise ValueError("concurrency and batch must be at least 1")
        if self.lease_s <= 0 or self.idle_s <= 0 or self.stretch_refresh_s <= 0:
            raise ValueError("lease_s, idle_s and stretch_refresh_s must be positive")
        if not 0 < self.utilization <= 1:
            raise ValueError("utilization must be within (0, 1]")


def _limit(text: str) -> Limit:
    qps, sep, burst = text.partition("/")
    try:
        return Limit(float(qps), float(burst) if sep else max(1.0, float(qps) / 20))
    except ValueError as exc:
        raise ValueError(f"bad limit {text!r}: expected qps/burst") from exc


def parse_limits(text: str, base: RateLimitConfig | None = None) -> RateLimitConfig:
    """``global=400/20,provider:sandbox=160/8,model:sandbox/m1=100/5,tenant=60/5``."""
    config = base or RateLimitConfig()
    providers = dict(config.providers)
    models = dict(config.models)
    tenants = dict(config.tenants)
    global_limit, default_provider = config.global_limit, config.default_provider
    default_model, tenant = config.default_model, config.tenant
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"bad limit {item!r}: expected level=qps/burst")
        level, _, key = name.strip().partition(":")
        limit = _limit(value.strip())
        if level == "global" and not key:
            global_limit = limit
        elif level == "provider":
            if key:
                providers[key] = limit
            else:
                default_provider = limit
        elif level == "model":
            if key:
                models[key] = limit
            else:
                default_model = limit
        elif level == "tenant":
            if key:
                tenants[key] = limit
            else:
                tenant = limit
        else:
            raise ValueError(f"unknown limit level {name!r}")
    return replace(
        config,
        global_limit=global_limit,
        providers=providers,
        default_provider=default_provider,
        models=models,
        default_model=default_model,
        tenant=tenant,
        tenants=tenants,
    )


__all__ = ["PollerConfig", "RateLimitConfig", "parse_limits"]
