"""Counters the tests and benchmarks read at ``GET /_sandbox/stats``, and the optional rate cap.

Per-second counts are keyed by unix second and kept for ``window_s`` seconds:

- ``requests``: every ``/v1`` request that arrived, admitted or not;
- ``served``: those admitted past the rate cap (answered by the API, chaos included);
- ``rejected``: those answered 429 by the rate cap;
- ``queries`` / ``queries_served``: the same two for generation queries (``GET``).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

PER_SECOND = ("requests", "served", "rejected", "queries", "queries_served")


class Stats:
    def __init__(self, window_s: int) -> None:
        self.window_s = window_s
        self.reset()

    def reset(self) -> None:
        self.created = 0
        self.create_requests = 0
        self.replays = 0
        self.keys: Counter[str] = Counter()  # create requests per Idempotency-Key
        self.requests: Counter[str] = Counter()  # per endpoint
        self.webhooks: Counter[str] = Counter()
        self.delivered_ids: set[str] = set()  # webhook ids answered 2xx (genuine copies only)
        self.chaos: Counter[str] = Counter()
        self.per_second: dict[str, dict[int, int]] = {name: {} for name in PER_SECOND}
        self._oldest = 0

    def tick(self, name: str, second: int) -> None:
        series = self.per_second[name]
        series[second] = series.get(second, 0) + 1
        if second - self._oldest > self.window_s:
            self._prune(second - self.window_s)

    def _prune(self, floor: int) -> None:
        for series in self.per_second.values():
            for second in [s for s in series if s < floor]:
                del series[second]
        self._oldest = floor

    def to_json(
        self,
        *,
        in_flight: int,
        stored: int,
        by_status: dict[str, int],
        keys: bool,
        delivered: bool = False,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "generations": {
                "created": self.created,
                "create_requests": self.create_requests,
                "idempotent_replays": self.replays,
                "unique_idempotency_keys": len(self.keys),
                "in_flight": in_flight,
                "stored": stored,
                "by_status": by_status,
            },
            "requests": dict(self.requests),
            "per_second": {
                name: {str(s): n for s, n in sorted(series.items())}
                for name, series in self.per_second.items()
            },
            "max_per_second": {
                name: max(series.values(), default=0) for name, series in self.per_second.items()
            },
            "webhooks": dict(self.webhooks),
            "chaos": dict(self.chaos),
        }
        if keys:
            out["generations"]["create_requests_by_key"] = dict(self.keys)
        if delivered:
            out["webhooks_delivered_ids"] = sorted(self.delivered_ids)
        return out


class RateCap:
    """A fixed window per unix second: at most ``floor(qps)`` admitted requests in each."""

    def __init__(self, qps: float | None) -> None:
        self.limit = None if qps is None else max(1, math.floor(qps))
        self._second = -1
        self._count = 0

    def admit(self, second: int) -> bool:
        if self.limit is None:
            return True
        if second != self._second:
            self._second, self._count = second, 0
        if self._count >= self.limit:
            return False
        self._count += 1
        return True
