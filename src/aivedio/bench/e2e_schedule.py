"""``bench e2e``, the pure parts: the webhook schedule, the saturation pick, the stage figures.

The schedule is built so that the chain may neither coalesce nor supersede any webhook, so every
one of them must reach the SSE clients as a frame of its own:

- Every webhook of a task moves its progress by exactly ``points`` (the state service's
  ``coalesce_min_points``) with the next provider sequence. ``domain.transitions._progress_only``
  writes a progress change of at least ``min_points`` whatever the time since the last one, so
  none is coalesced; the first one of a task is a status change (submitted or queued ->
  running), which is never coalesced. A task takes at most ``(100 - 1) // points`` of them
  (progress 5..95 with 5 points): progress stays below 100.
- Webhooks go round robin over all the tasks of the scenario, so one task's consecutive webhooks
  are ``tasks / rate`` seconds apart; the number of tasks is chosen so that this gap is at least
  ``min_gap_s`` at the highest rate and no task runs out of progress over the whole ramp. A
  webhook can only be superseded (its successor applied first, it then stale) if the chain is
  slower than that gap.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aivedio.bench.common import percentile

STAGES = ("received", "committed", "applied", "relayed", "dispatched", "written", "read")
"""Each stage is the time from the stamp before it to its own stamp (``sent`` comes first):
``received`` the callback gateway parsed it (inbox ``received_at``); ``committed`` its 204 was
read by the sender (after the inbox commit); ``applied`` the state service wrote its event (task
event ``created_at``, just before the commit); ``relayed`` the relay published it; ``dispatched``
the dispatcher PUBLISHed it to Redis; ``written`` the gateway framed it for the socket; ``read``
the SSE client read it."""


def per_task_limit(points: int) -> int:
    """How many webhooks one task can take at ``points`` per webhook, progress below 100."""
    if points < 1:
        raise ValueError("points must be at least 1")
    return 99 // points


def events_in(rate: float, duration_s: float) -> int:
    return max(1, round(rate * duration_s))


def plan_tasks(
    rates: Sequence[float], duration_s: float, points: int, min_gap_s: float, at_least: int = 0
) -> int:
    """Tasks per scenario: enough for the whole ramp at ``per_task_limit(points)`` webhooks each,
    for one task's webhooks to be ``min_gap_s`` apart at the highest rate, and ``at_least``."""
    total = sum(events_in(rate, duration_s) for rate in rates)
    by_progress = math.ceil(total / per_task_limit(points))
    by_gap = math.ceil(max(rates) * min_gap_s)
    return max(by_progress, by_gap, at_least, 1)


@dataclass(slots=True)
class Cursor:
    """Where the round robin stands: the next task, and how many webhooks each task has had."""

    next_task: int
    sent: array[int]

    @classmethod
    def start(cls, tasks: int) -> Cursor:
        return cls(0, array("i", [0] * tasks))


@dataclass(frozen=True, slots=True)
class Step:
    """One rate of the ramp: webhook ``i`` is due ``i / rate`` seconds after the step starts and
    goes to task ``tasks[i]`` as its ``nth[i]``-th webhook (progress ``nth * points``, provider
    sequence ``nth + 1``: the creation was sequence 1)."""

    rate: float
    tasks: array[int]
    nth: array[int]

    def __len__(self) -> int:
        return len(self.tasks)

    def due(self, i: int) -> float:
        return i / self.rate

    def gap_s(self, task_count: int) -> float:
        """The time between two webhooks of one task within this step."""
        return task_count / self.rate


def build_step(cursor: Cursor, rate: float, duration_s: float, points: int) -> Step:
    """The next ``rate * duration_s`` webhooks, round robin from ``cursor`` (advanced)."""
    if rate <= 0:
        raise ValueError("rates must be positive")
    limit = per_task_limit(points)
    count = len(cursor.sent)
    tasks, nth = array("i"), array("i")
    for _ in range(events_in(rate, duration_s)):
        task = cursor.next_task
        cursor.next_task = (task + 1) % count
        cursor.sent[task] += 1
        if cursor.sent[task] > limit:
            raise ValueError(f"task {task} would get more than {limit} webhooks: plan more tasks")
        tasks.append(task)
        nth.append(cursor.sent[task])
    return Step(rate, tasks, nth)


@dataclass(frozen=True, slots=True)
class RateResult:
    """What one step of the ramp gave, as the saturation pick needs it."""

    asked: float
    achieved: float
    p99_ms: float
    lost: int


def saturation(results: Sequence[RateResult], p99_limit_ms: float = 100.0) -> float | None:
    """The highest achieved rate of a step whose p99 is within ``p99_limit_ms`` with nothing
    lost; ``None`` when no step qualifies."""
    good = [
        r.achieved
        for r in results
        if r.lost == 0 and not math.isnan(r.p99_ms) and r.p99_ms <= p99_limit_ms
    ]
    return max(good) if good else None


def stage_samples(stamps: Mapping[str, Sequence[float]]) -> dict[str, list[float]]:
    """Milliseconds per stage from per-event stamps (Unix seconds, ``nan`` where an event has
    none): ``stamps["sent"]`` and one sequence per name in :data:`STAGES`, all of one length.
    A stage is sampled only from events that have both its stamp and the one before it (a frame
    repaired from PostgreSQL has no relay, dispatch or gateway stamp: it adds to ``received``,
    ``committed`` and ``applied`` only)."""
    order = ("sent", *STAGES)
    out: dict[str, list[float]] = {name: [] for name in STAGES}
    for before, name in itertools.pairwise(order):
        for start, end in zip(stamps[before], stamps[name], strict=True):
            if not (math.isnan(start) or math.isnan(end)):
                out[name].append((end - start) * 1000)
    return out


def summary_ms(samples: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(samples, 50),
        "p90": percentile(samples, 90),
        "p99": percentile(samples, 99),
        "max": max(samples) if samples else math.nan,
    }


def parse_rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or min(rates) <= 0:
        raise ValueError("rates is a comma-separated list of positive numbers")
    return rates
