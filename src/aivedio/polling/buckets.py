"""Token-bucket arithmetic, pure: what the Redis script does, and the local fallback runs.

A bucket holds at most ``burst`` tokens and refills at ``rate`` tokens per second. Taking from
several buckets is all or nothing: the grant is the largest whole number of tokens (up to what
was asked) that every bucket can give; when that is zero nothing is taken and the answer says
how long until one token is there in the slowest bucket.

Against a provider that counts requests in fixed one-second windows, a bucket admits at most
``burst + rate`` requests in any one window; so ``rate + burst`` (plus the requests that the
spread of network delays can shift into a window) must stay below the provider's cap.
docs/explanation/polling.md has the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limit:
    """``qps`` tokens per second, at most ``burst`` banked."""

    qps: float
    burst: float

    def __post_init__(self) -> None:
        if self.qps <= 0 or self.burst < 1:
            raise ValueError("a limit needs qps > 0 and burst >= 1")

    def share(self, parts: int) -> Limit:
        """This limit split over ``parts`` replicas (conservative: burst at least 1)."""
        parts = max(1, parts)
        return Limit(self.qps / parts, max(1.0, self.burst / parts))


@dataclass(slots=True)
class Bucket:
    tokens: float
    stamp: float

    def level(self, limit: Limit, now: float) -> float:
        """Tokens after refilling up to ``now`` (a clock that went back refills nothing)."""
        elapsed = max(0.0, now - self.stamp)
        return min(limit.burst, self.tokens + elapsed * limit.qps)


@dataclass(frozen=True, slots=True)
class Grant:
    granted: int
    wait_s: float
    """When nothing was granted: seconds until one token is there in every bucket."""


def take_all(
    buckets: Sequence[tuple[Bucket, Limit]], want: int, now: float, eps: float = 1e-9
) -> Grant:
    """Take up to ``want`` tokens from every bucket, all or nothing; mutates the buckets."""
    if want < 1:
        return Grant(0, 0.0)
    levels = [bucket.level(limit, now) for bucket, limit in buckets]
    grant = want
    for level in levels:
        grant = min(grant, math.floor(level + eps))
    if grant < 1:
        wait = 0.0
        for level, (_, limit) in zip(levels, buckets, strict=True):
            if level + eps < 1:
                wait = max(wait, (1 - level) / limit.qps)
        return Grant(0, wait)
    for level, (bucket, _) in zip(levels, buckets, strict=True):
        bucket.tokens = level - grant
        bucket.stamp = now
    return Grant(grant, 0.0)


__all__ = ["Bucket", "Grant", "Limit", "take_all"]
