"""A pure model of what the state service does with a decision, for property tests.

``evolve`` mirrors ``write_event``: version + 1, the change, progress time = now (a version
that is not a public event keeps it); the attempt takes what the decision recorded. The
integration tests check the real service against it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from hypothesis import strategies as st

from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.domain.statuses import Stage, Status
from aivedio.domain.transitions import AttemptView, Decision, TaskView

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def evolve(
    task: TaskView, attempt: AttemptView, decision: Decision, now: datetime
) -> tuple[TaskView, AttemptView]:
    if decision.attempt is not None:
        attempt = replace(
            attempt,
            provider_status=decision.attempt.provider_status,
            last_provider_seq=decision.attempt.last_provider_seq,
            last_provider_at=decision.attempt.last_provider_at,
        )
    if decision.applied:
        c = decision.change
        assert c is not None
        task = replace(
            task,
            status=c.status,
            stage=c.stage,
            progress=c.progress,
            version=task.version + 1,
            progress_event_at=now if decision.public else task.progress_event_at,
            error_code=c.error_code,
            error_message=c.error_message,
            asset_id=c.asset_id,
        )
    return task, attempt


def fresh(attempt_id: uuid.UUID, status: Status = Status.SUBMITTED) -> TaskView:
    return TaskView(
        id=uuid.uuid4(),
        status=status,
        stage=Stage.QUEUED if status is Status.SUBMITTED else Stage.SUBMITTING,
        progress=None,
        version=1,
        current_attempt_id=attempt_id,
        progress_event_at=T0,
    )


@dataclass
class Script:
    """The provider's true history of one attempt, and what arrives: duplicated, reordered,
    partly lost (never the terminal), mixed with a previous attempt's late observations."""

    final: ProviderStatus
    true_history: list[ProviderObservation]
    arrivals: list[ProviderObservation]
    gaps_ms: list[int] = field(default_factory=list)
    cancel_at: int | None = None  # index in arrivals before which the user asks to cancel


FINAL_TARGET = {
    ProviderStatus.SUCCEEDED: Status.PROVIDER_SUCCEEDED,
    ProviderStatus.FAILED: Status.FAILED,
    ProviderStatus.CANCELED: Status.CANCELED,
}


@st.composite
def scripts(
    draw: st.DrawFn,
    current: uuid.UUID,
    old: uuid.UUID,
    with_cancel: bool = False,
) -> Script:
    with_seq = draw(st.booleans())
    steps = draw(st.lists(st.integers(1, 99), max_size=8).map(sorted))
    final = draw(st.sampled_from(sorted(FINAL_TARGET)))
    statuses: list[tuple[ProviderStatus, int | None]] = [(ProviderStatus.QUEUED, None)]
    statuses += [(ProviderStatus.RUNNING, p) for p in steps]
    statuses.append((final, None))
    history = [
        ProviderObservation(
            provider="sandbox",
            attempt_id=current,
            status=s,
            source=Source.WEBHOOK,
            provider_sequence=(i + 1) if with_seq else None,
            progress=p,
        )
        for i, (s, p) in enumerate(statuses)
    ]
    kept = [o for o in history[:-1] if draw(st.booleans())] + [history[-1]]
    dups = draw(st.lists(st.sampled_from(kept), max_size=6))
    stale = [
        ProviderObservation(
            provider="sandbox",
            attempt_id=old,
            status=draw(st.sampled_from(list(ProviderStatus))),
            source=Source.POLL,
        )
        for _ in range(draw(st.integers(0, 3)))
    ]
    arrivals = draw(st.permutations(kept + dups + stale))
    gaps = draw(st.lists(st.integers(0, 3000), min_size=len(arrivals), max_size=len(arrivals)))
    cancel_at = draw(st.integers(0, len(arrivals))) if with_cancel else None
    return Script(final, history, list(arrivals), gaps, cancel_at)


def clock_after(gaps_ms: list[int]) -> list[datetime]:
    now, out = T0, []
    for gap in gaps_ms:
        now += timedelta(milliseconds=gap)
        out.append(now)
    return out
