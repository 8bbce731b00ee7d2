"""The options of ``aivedio bench retention``."""

from __future__ import annotations

from dataclasses import dataclass

from aivedio.bench.common import BenchUsageError


@dataclass(frozen=True, slots=True)
class Options:
    events: int = 10_000_000
    days: int = 30
    projects: int = 100
    tasks: int = 100_000  # rows of generation_tasks (the snapshot's table)
    replay: int = 1000  # events per replay
    samples: int = 200  # replays measured at the head, and as many deep
    writers: int = 4
    readers: int = 2
    probe_s: float = 3.0  # the writers' load before the drop (the baseline), and after it
    outbox_rows: int = 0  # published outbox rows to purge; 0: one day of events
    inbox_rows: int = 10_000  # processed inbox rows (the claim's EXPLAIN), 100 of them pending

    def check(self) -> None:
        if self.days < 2:
            raise BenchUsageError("days must be at least 2 (one is dropped, one is written)")
        if self.events < self.days * self.projects or self.projects < 1:
            raise BenchUsageError("events must give every project at least one event a day")
        if self.writers < 1 or self.samples < 1 or self.replay < 1:
            raise BenchUsageError("writers, samples and replay must be at least 1")


def _ms(seconds: float) -> float:
    return seconds * 1000.0
