"""Retention configuration (built once at the edge, from ``AIVEDIO_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from aivedio.config import LONGEST_PROVIDER_RETRY, Settings

__all__ = ["LONGEST_PROVIDER_RETRY", "RetentionConfig"]


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    event_retention: timedelta = timedelta(days=7)
    """A partition of task_events whose every row is older than this is dropped (after the
    floors of the streams it holds were raised past it)."""
    partitions_ahead_days: int = 7
    """Partitions exist for today and this many days ahead (writes fail without one)."""
    outbox_retention: timedelta = timedelta(days=1)
    """Published outbox rows older than this are deleted (pending and dead rows stay)."""
    callback_dedup_window: timedelta = timedelta(days=7)
    """A processed callback's row (its dedup key) lives at least this long after its receipt."""
    batch_size: int = 1000
    """Rows (outbox, inbox) or streams (floors) per transaction."""
    interval_s: float = 300.0
    """Between two maintenance rounds."""
    compact: bool = True
    """Rebuild the indexes of each closed day packed full, once (``partitions.compact``)."""
    detach_timeout_s: float = 60.0
    """How long a DETACH ... CONCURRENTLY may wait for older transactions (then next round)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> RetentionConfig:
        return cls(
            event_retention=settings.event_retention,
            partitions_ahead_days=settings.event_partitions_ahead,
            outbox_retention=settings.outbox_retention,
            callback_dedup_window=settings.callback_dedup_window,
            batch_size=settings.maintenance_batch,
            interval_s=settings.maintenance_interval_s,
        )

    def __post_init__(self) -> None:
        if self.partitions_ahead_days < 1:
            raise ValueError("partitions_ahead_days must be at least 1")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if self.event_retention < timedelta(days=1):
            raise ValueError("the event retention must be at least one day (one partition)")
