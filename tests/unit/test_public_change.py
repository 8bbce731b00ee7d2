"""Public events only on public change: ``decide`` marks every applied change that leaves the
public fields as they were (``Reason.NO_PUBLIC_CHANGE``), over the whole status table."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from hypothesis import HealthCheck, given, settings

from aivedio.domain.observation import (
    Observation,
    PlatformKind,
    PlatformObservation,
    ProviderObservation,
    ProviderStatus,
    Source,
)
from aivedio.domain.public import public_fields
from aivedio.domain.statuses import MEDIA_STAGES, STATUS_TABLE, Stage, Status
from aivedio.domain.transitions import (
    AttemptView,
    Outcome,
    Reason,
    TaskChange,
    TaskView,
    changes_public,
    decide,
)
from tests.model import Script, clock_after, evolve, fresh, scripts

T0 = datetime(2026, 1, 1, tzinfo=UTC)
ATTEMPT = uuid.UUID(int=1)
OLD = uuid.UUID(int=2)
ASSET = uuid.UUID(int=3)
PROGRESS = (None, 0, 40, 100)


def _fields(t: TaskView | TaskChange) -> dict[str, object]:
    return public_fields(t.status, t.stage, t.progress, t.asset_id, t.error_code)


def tasks() -> Iterator[TaskView]:
    """Every status with every stage it can hold, several progress figures, with and without
    an error and an asset where the status has them."""
    for status, row in STATUS_TABLE.items():
        stages = MEDIA_STAGES if status is Status.PROCESSING_MEDIA else (row.stage,)
        errors = ("generation_failed", "media_failed") if status is Status.FAILED else (None,)
        assets = (None, ASSET) if status is Status.READY else (None,)
        for stage, progress, error, asset in itertools.product(stages, PROGRESS, errors, assets):
            yield TaskView(
                id=uuid.UUID(int=9),
                status=status,
                stage=stage,
                progress=progress,
                version=4,
                current_attempt_id=ATTEMPT,
                progress_event_at=T0,
                error_code=error,
                asset_id=asset,
            )


def attempts() -> Iterator[AttemptView]:
    for seen in (None, *ProviderStatus):
        yield AttemptView(ATTEMPT, seen, None, None)


def observations() -> Iterator[Observation]:
    for status, progress in itertools.product(ProviderStatus, PROGRESS):
        yield ProviderObservation(
            provider="sandbox",
            attempt_id=ATTEMPT,
            status=status,
            source=Source.WEBHOOK,
            progress=progress,
            error_code="content_rejected" if status is ProviderStatus.FAILED else None,
        )
    for kind in PlatformKind:
        stages: tuple[Stage | None, ...] = (None,)
        if kind is PlatformKind.MEDIA_STAGE:
            stages = MEDIA_STAGES
        for stage, progress in itertools.product(stages, PROGRESS):
            yield PlatformObservation(
                kind=kind,
                attempt_id=ATTEMPT,
                source=Source.MEDIA,
                stage=stage,
                progress=progress,
                asset_id=ASSET if kind is PlatformKind.MEDIA_READY else None,
            )


CASES = [(t, a, o) for t, a, o in itertools.product(tasks(), attempts(), observations())]
NOW = T0 + timedelta(seconds=10)  # past every coalescing interval


def test_every_applied_change_is_public_exactly_when_a_public_field_differs() -> None:
    internal: set[tuple[Status, Status]] = set()
    for task, attempt, obs in CASES:
        decision = decide(task, attempt, obs, NOW)
        if not decision.applied:
            assert not decision.public
            assert decision.reason is not Reason.NO_PUBLIC_CHANGE
            continue
        assert decision.change is not None
        differs = _fields(task) != _fields(decision.change)
        assert changes_public(task, decision.change) is differs
        assert decision.public is differs, (task, obs)
        assert (decision.reason is Reason.NO_PUBLIC_CHANGE) is not differs
        if not differs:
            internal.add((task.status, decision.change.status))
    # Only a change between two internal statuses of one public face can look the same (and
    # only while no progress figure tells them apart); these are all of them.
    assert internal == {
        (Status.CREATED, Status.SUBMIT_UNKNOWN),  # queued / submitting
        (Status.SUBMITTED, Status.PROVIDER_QUEUED),  # queued / queued
        (Status.RUNNING, Status.STATUS_UNKNOWN),  # running / generating
        (Status.STATUS_UNKNOWN, Status.RUNNING),
        (Status.PROVIDER_SUCCEEDED, Status.PROCESSING_MEDIA),  # processing_media / ingesting
    }


def test_the_two_repeated_public_events_of_a_task_are_gone() -> None:
    """v2 -> v3 (``submitted`` -> ``provider_queued``, both queued/queued) and v8 -> v9
    (``provider_succeeded`` -> ``processing_media`` at ``ingesting``) of issue 13."""
    submitted = fresh(ATTEMPT)
    queued = decide(
        submitted,
        AttemptView(ATTEMPT, None, None, None),
        ProviderObservation(
            provider="sandbox",
            attempt_id=ATTEMPT,
            status=ProviderStatus.QUEUED,
            source=Source.WEBHOOK,
        ),
        NOW,
    )
    assert (queued.outcome, queued.reason) == (Outcome.APPLIED, Reason.NO_PUBLIC_CHANGE)
    assert queued.change is not None and queued.change.status is Status.PROVIDER_QUEUED
    succeeded = TaskView(ATTEMPT, Status.PROVIDER_SUCCEEDED, Stage.INGESTING, None, 8, ATTEMPT, T0)
    media = decide(
        succeeded,
        AttemptView(ATTEMPT, ProviderStatus.SUCCEEDED, None, None),
        PlatformObservation(
            kind=PlatformKind.MEDIA_STAGE,
            attempt_id=ATTEMPT,
            source=Source.MEDIA,
            stage=Stage.INGESTING,
        ),
        NOW,
    )
    assert (media.outcome, media.reason) == (Outcome.APPLIED, Reason.NO_PUBLIC_CHANGE)
    # With a progress figure the same step is public: the payload differs in `progress`.
    with_progress = decide(
        succeeded,
        AttemptView(ATTEMPT, ProviderStatus.SUCCEEDED, None, None),
        PlatformObservation(
            kind=PlatformKind.MEDIA_STAGE,
            attempt_id=ATTEMPT,
            source=Source.MEDIA,
            stage=Stage.INGESTING,
            progress=10,
        ),
        NOW,
    )
    assert with_progress.public


def _public_stream(script: Script) -> list[dict[str, object]]:
    """The public fields of every public event the model writes for a script."""
    task = fresh(ATTEMPT)
    attempt = AttemptView(ATTEMPT, None, None, None)
    shown = [_fields(task)]
    arrivals: list[Observation] = list(script.arrivals)
    for obs, now in zip(arrivals, clock_after([*script.gaps_ms, 0]), strict=False):
        if obs.attempt_id == OLD:
            continue
        decision = decide(task, attempt, obs, now)
        task, attempt = evolve(task, attempt, decision, now)
        if decision.public:
            shown.append(_fields(task))
    return shown


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(scripts(ATTEMPT, OLD))
def test_no_two_consecutive_public_events_look_the_same(script: Script) -> None:
    shown = _public_stream(script)
    assert all(a != b for a, b in itertools.pairwise(shown))
