"""Reconciler configuration (built once at the edge)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ReconcilerConfig:
    interval_s: float = 30.0
    """Pause between rounds (each round runs every sweep once)."""
    batch_size: int = 100
    expected_max_duration_s: float = 1800.0
    """A provider-active task with no change for longer than this is queried (never
    regenerated). Overridden per ``"provider/model"`` or ``"provider/*"`` in ``max_durations``."""
    max_durations: Mapping[str, float] = field(default_factory=dict)
    check_interval_s: float = 300.0
    """An overdue attempt is queried at most once per this many seconds (all replicas)."""
    lookup_interval_s: float = 15.0
    """Between two lookups of one unknown submit."""
    lookup_grace_s: float = 120.0
    """An unknown submit not found for this long becomes an operator's ``submit_unknown`` item."""
    inbox_stuck_s: float = 300.0
    """An inbox row pending / retry this long past its due time (and not leased) is requeued."""
    inbox_max_tries: int = 10
    """... or dead-lettered once it used this many tries (the processor's refetch_max_tries)."""
    inbox_retention_s: float = 7 * 24 * 3600.0
    """Processed inbox payloads older than this are nulled (the rows stay for dedup)."""
    sessions_retention_s: float = 24 * 3600.0
    """Browser sessions expired (or revoked) longer ago than this are deleted."""

    def __post_init__(self) -> None:
        for key, seconds in self.max_durations.items():
            if "/" not in key or seconds < 0:
                raise ValueError(f"max duration {key!r}: keys are 'provider/model', seconds >= 0")

    def max_duration(self, provider: str, model: str) -> float:
        for key in (f"{provider}/{model}", f"{provider}/*"):
            if key in self.max_durations:
                return self.max_durations[key]
        return self.expected_max_duration_s
