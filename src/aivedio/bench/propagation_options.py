"""The options of ``aivedio bench propagation``."""

from __future__ import annotations

from dataclasses import dataclass

from aivedio.bench.common import BenchUsageError


@dataclass(frozen=True, slots=True)
class Options:
    events: int = 50_000
    tasks: int = 5_000
    relays: int = 3
    batch: int = 1000
    in_flight: int = 1024
    rate: int = 1000
    seconds: float = 10.0
    latency_tasks: int = 1000
    projects: int = 32
    workers: int = 32  # concurrent applies in the latency phase, split over the writers
    writers: int = 4  # writer processes in the latency phase
    writer_batch: int = 1
    """Observations per transaction in the latency phase: 1 = ``StateService.apply_in`` each (one
    commit per event); N > 1 = ``apply_many_in`` of N every N intervals (the inbox processor's and
    poller's batching), which costs the writers far less CPU for the same steady event rate."""
    probe: int = 100  # single events, one at a time, before the steady load
    latency_relays: int = 1  # relay processes in the latency phase
    timeout: float = 120.0

    def check(self) -> None:
        for name in (
            "tasks",
            "relays",
            "batch",
            "in_flight",
            "latency_tasks",
            "projects",
            "writers",
            "writer_batch",
        ):
            if getattr(self, name) < 1:
                raise BenchUsageError(f"{name} must be at least 1")
        if self.events < 0 or self.rate < 0 or self.seconds < 0 or self.workers < 1:
            raise BenchUsageError("events, rate and seconds cannot be negative")
