"""Billing configuration: the price table and the consumer's knobs (built once at the edge)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from aivedio.consumers import ConsumerSettings


@dataclass(frozen=True, slots=True)
class PriceTable:
    """Whole credits per generation. Keys are ``"provider/model"`` or ``"provider/*"``; the most
    specific key wins, then ``default``."""

    prices: Mapping[str, int] = field(default_factory=dict)
    default: int = 100

    def __post_init__(self) -> None:
        for key, amount in self.prices.items():
            if "/" not in key or amount < 0:
                raise ValueError(f"price {key!r}: keys are 'provider/model', amounts >= 0")
        if self.default < 0:
            raise ValueError("the default price must not be negative")

    def price(self, provider: str, model: str) -> int:
        for key in (f"{provider}/{model}", f"{provider}/*"):
            if key in self.prices:
                return self.prices[key]
        return self.default


@dataclass(frozen=True, slots=True)
class BillingConfig:
    prices: PriceTable = field(default_factory=PriceTable)
    group: str = "billing"
    consumer: ConsumerSettings = field(default_factory=ConsumerSettings)
    remember_attempts: int = 100_000  # reserved attempts kept in memory (about 100 bytes each)
