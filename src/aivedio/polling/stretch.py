"""How much the rate limits stretch the poll intervals of a scope: the poll demand in flight at
each level of the limits (global, provider, model, tenant) against that level's rate.
"""

from __future__ import annotations

from collections.abc import Mapping

from aivedio.polling.config import RateLimitConfig
from aivedio.polling.policy import stretch_factor
from aivedio.polling.ratelimit import Scope

__all__ = ["scope_stretch"]


def scope_stretch(
    demand: Mapping[tuple[str, str, str], float],
    limits: RateLimitConfig,
    scope: Scope,
    utilization: float,
) -> float:
    """The stretch of ``scope`` for ``demand`` (queries/s by ``(provider, model, tenant)``)."""
    total = provider = model = tenant = 0.0
    for (p, m, t), qps in demand.items():
        total += qps
        if p == scope.provider:
            provider += qps
            if m == scope.model:
                model += qps
        if t == scope.tenant:
            tenant += qps
    levels = [
        (total, limits.global_limit.qps),
        (provider, limits.provider_limit(scope.provider).qps),
        (tenant, limits.tenant_limit(scope.tenant).qps),
    ]
    model_limit = limits.model_limit(scope.provider, scope.model)
    if model_limit is not None:
        levels.append((model, model_limit.qps))
    return stretch_factor(levels, utilization)
