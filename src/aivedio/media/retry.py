"""Retry arithmetic for media operations: pure, no I/O."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``max_tries`` runs in all (the first included); run ``n`` failing waits
    ``min(cap, base * 2^(n-1))`` scaled by a uniform jitter in ``[1 - jitter, 1 + jitter]``."""

    max_tries: int = 5
    base_s: float = 2.0
    cap_s: float = 120.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_tries < 1 or self.base_s < 0 or self.cap_s < 0 or not 0 <= self.jitter < 1:
            raise ValueError("max_tries >= 1, delays >= 0, 0 <= jitter < 1")

    def exhausted(self, tries: int) -> bool:
        return tries >= self.max_tries

    def delay(self, tries: int, rng: random.Random | None = None) -> float:
        raw = min(self.cap_s, self.base_s * 2.0 ** max(tries - 1, 0))
        spread: float = (rng or random.Random()).uniform(1 - self.jitter, 1 + self.jitter)
        return raw * spread
