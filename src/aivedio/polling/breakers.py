"""The poller's circuit breakers, one per provider and one per provider credential: which claimed
attempts they let out, and what a query's outcome does to them.
"""

from __future__ import annotations

from prometheus_client import Gauge

from aivedio.polling.config import PollerConfig
from aivedio.polling.policy import Breaker, BreakerState, Outcome

__all__ = ["Breakers", "allowance", "feed"]

BREAKER = Gauge("aivedio_poll_breaker_state", "0 closed, 1 half-open, 2 open", ["kind", "name"])
_BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}

Breakers = dict[tuple[str, str], Breaker]
"""The breakers of one poller replica, by ``(provider, "provider" | "credential")``."""


def allowance(breakers: Breakers, provider: str, wanted: int, now: float) -> tuple[int, float]:
    """How many of ``wanted`` claimed rows of ``provider`` the breakers let out now, and how long
    the others wait."""
    allowed = wanted
    wait = 0.0
    for key in ((provider, "provider"), (provider, "credential")):
        breaker = breakers.get(key)
        if breaker is None:
            continue
        b = breaker.current(now)
        if b.state is BreakerState.CLOSED:
            continue
        if b.state is BreakerState.HALF_OPEN and allowed > 0:
            b, ok = b.allow(now)
            allowed = 1 if ok else 0
        else:
            allowed = 0
        breakers[key] = b
        wait = max(wait, b.retry_in(now), 0.5)
    return allowed, wait


def feed(
    breakers: Breakers,
    provider: str,
    credential: str,
    outcome: Outcome,
    config: PollerConfig,
    now: float,
) -> None:
    """A query's outcome for the provider's breaker and its credential's."""
    for kind, name, failed, breaker_config in (
        (
            "provider",
            provider,
            outcome is Outcome.UNAVAILABLE,
            config.provider_breaker,
        ),
        (
            "credential",
            f"{provider}:{credential}",
            outcome is Outcome.AUTH_FAILED,
            config.credential_breaker,
        ),
    ):
        key = (provider, kind)
        breaker = breakers.get(key) or Breaker(breaker_config)
        if failed:
            breaker = breaker.on_failure(now)
        elif outcome is not Outcome.RATE_LIMITED:
            # Any answer but 429 proves the provider (and our credential) work.
            breaker = breaker.on_success(now)
        breakers[key] = breaker
        BREAKER.labels(kind, name).set(_BREAKER_VALUE[breaker.current(now).state])
