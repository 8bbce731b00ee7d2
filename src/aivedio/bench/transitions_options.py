"""The options of ``aivedio bench transitions``, and the figures of its two sides."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from aivedio.bench.common import BenchUsageError


@dataclass(frozen=True, slots=True)
class Options:
    tasks: int = 2000
    projects: int = 4
    workers: int = 16
    seconds: float = 10.0
    observations: int = 0  # stop after this many observations (0: run for ``seconds``)
    pgbench_seconds: int = 0  # 0: as long as our run took
    pgbench_jobs: int = 2
    batch: int = 32  # observations per apply_many transaction (1: StateService.apply)

    def check(self) -> None:
        for name in ("tasks", "projects", "workers", "pgbench_jobs", "batch"):
            if getattr(self, name) < 1:
                raise BenchUsageError(f"{name} must be at least 1")
        if self.seconds <= 0 and self.observations <= 0:
            raise BenchUsageError("give seconds > 0 or observations > 0")
        if self.observations < 0 or self.pgbench_seconds < 0:
            raise BenchUsageError("observations and pgbench_seconds cannot be negative")


@dataclass(slots=True)
class _Track:
    """One task as the workers see it: its attempt and the next progress to report."""

    attempt_id: uuid.UUID
    progress: int = 0
    sequence: int = 1


@dataclass(slots=True)
class ApplyFigures:
    applied: int = 0
    ignored: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time while the workers ran
    latencies_ms: list[float] = field(default_factory=list)
    exhausted: bool = False  # every task reached 100 % before the time was up

    @property
    def per_s(self) -> float:
        return self.applied / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us_per_observation(self) -> float:
        count = self.applied + self.ignored
        return self.cpu_seconds / count * 1e6 if count else float("nan")


@dataclass(frozen=True, slots=True)
class PgbenchFigures:
    tps: float
    latency_avg_ms: float | None
    transactions: int | None
    failed: int | None
    command: str
