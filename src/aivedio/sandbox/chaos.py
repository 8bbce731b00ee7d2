"""Chaos knobs: what the sandbox provider does wrong on purpose, and the dice that decide when.

``Chaos`` is the whole knob set as plain data; ``apply_patch`` validates a JSON patch from
``PUT /_sandbox/chaos`` into a new ``Chaos``. Rates are probabilities in 0..1 (``true`` means 1,
``false`` 0); ranges are ``[min, max]`` milliseconds (a single number means ``[n, n]``).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

RATE_FIELDS = frozenset(
    {
        "duplicate_rate",
        "reorder",
        "drop_rate",
        "forge_signature_rate",
        "stale_signature_rate",
        "callback_before_submit_response",
        "contradictory_terminal",
        "query_429_rate",
        "query_5xx_rate",
        "submit_timeout_after_accept",
    }
)
RANGE_FIELDS = frozenset({"delay_ms", "query_slow_ms"})
BOOL_FIELDS = frozenset({"webhooks_enabled", "fast"})
SECONDS_FIELDS = frozenset({"query_not_found_for_s", "retry_after_s"})


class ChaosError(ValueError):
    """A chaos patch names an unknown knob or gives a value of the wrong kind."""


@dataclass(frozen=True, slots=True)
class Chaos:
    """Every knob, off by default."""

    webhooks_enabled: bool = True
    duplicate_rate: float = 0.0
    reorder: float = 0.0
    delay_ms: tuple[int, int] = (0, 0)
    drop_rate: float = 0.0
    forge_signature_rate: float = 0.0
    stale_signature_rate: float = 0.0
    callback_before_submit_response: float = 0.0
    contradictory_terminal: float = 0.0
    fast: bool = False
    query_429_rate: float = 0.0
    retry_after_s: float = 1.0
    query_5xx_rate: float = 0.0
    query_slow_ms: tuple[int, int] = (0, 0)
    query_not_found_for_s: float = 0.0
    submit_timeout_after_accept: float = 0.0
    seed: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for name in RANGE_FIELDS:
            out[name] = list(out[name])
        return out


def _rate(name: str, value: object) -> float:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float) and 0.0 <= float(value) <= 1.0:
        return float(value)
    raise ChaosError(f"{name} is a probability in 0..1 (or true/false)")


def _range(name: str, value: object) -> tuple[int, int]:
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = [value, value]
    if (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    ):
        low, high = int(value[0]), int(value[1])
        if 0 <= low <= high:
            return (low, high)
    raise ChaosError(f"{name} is [min_ms, max_ms] with 0 <= min <= max")


def _seconds(name: str, value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise ChaosError(f"{name} is a number of seconds >= 0")


def _bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise ChaosError(f"{name} is true or false")


def _seed(value: object) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ChaosError("seed is an integer or null")


def apply_patch(current: Chaos, patch: object) -> Chaos:
    """A new ``Chaos`` with the knobs named in ``patch`` changed; the others keep their values."""
    if not isinstance(patch, dict):
        raise ChaosError("the chaos body is a JSON object of knobs")
    known = {f.name for f in fields(Chaos)}
    unknown = sorted(set(patch) - known)
    if unknown:
        raise ChaosError(f"unknown chaos knobs: {', '.join(unknown)}")
    changes: dict[str, Any] = {}
    for name, value in patch.items():
        if name in RATE_FIELDS:
            changes[name] = _rate(name, value)
        elif name in RANGE_FIELDS:
            changes[name] = _range(name, value)
        elif name in BOOL_FIELDS:
            changes[name] = _bool(name, value)
        elif name in SECONDS_FIELDS:
            changes[name] = _seconds(name, value)
        else:
            changes[name] = _seed(value)
    return replace(current, **changes)


class Dice:
    """The one random source of the chaos decisions; reseedable for reproducible runs."""

    def __init__(self, seed: int | None) -> None:
        self._random = random.Random(seed)

    def reseed(self, seed: int | None) -> None:
        self._random.seed(seed)

    def roll(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        if rate >= 1.0:
            return True
        return self._random.random() < rate

    def millis(self, span: tuple[int, int]) -> float:
        """A duration in seconds drawn uniformly from a ``[min_ms, max_ms]`` range."""
        low, high = span
        if high <= 0:
            return 0.0
        return self._random.uniform(low, high) / 1000.0

    def uniform(self, low: float, high: float) -> float:
        return self._random.uniform(low, high)

    def choice(self, options: tuple[int, ...]) -> int:
        return self._random.choice(options)
