"""Rule-by-rule tests of ``decide``."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from aivedio.domain.observation import (
    PlatformKind,
    PlatformObservation,
    ProviderObservation,
    ProviderStatus,
    Source,
)
from aivedio.domain.statuses import Stage, Status
from aivedio.domain.transitions import (
    AttemptView,
    Outcome,
    Reason,
    ReconcileKind,
    TaskChange,
    TaskView,
    decide,
    progress_only,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
ATTEMPT = uuid.uuid4()
OLD_ATTEMPT = uuid.uuid4()


def task(
    status: Status = Status.SUBMITTED,
    stage: Stage | None = None,
    progress: int | None = None,
    at: datetime | None = T0,
) -> TaskView:
    from aivedio.domain.statuses import info

    return TaskView(
        id=uuid.uuid4(),
        status=status,
        stage=stage or info(status).stage,
        progress=progress,
        version=3,
        current_attempt_id=ATTEMPT,
        progress_event_at=at,
    )


def attempt(seen: ProviderStatus | None = None, seq: int | None = None) -> AttemptView:
    return AttemptView(ATTEMPT, seen, seq, None)


def prov(
    status: ProviderStatus,
    *,
    seq: int | None = None,
    progress: int | None = None,
    attempt_id: uuid.UUID = ATTEMPT,
) -> ProviderObservation:
    return ProviderObservation(
        provider="sandbox",
        attempt_id=attempt_id,
        status=status,
        source=Source.WEBHOOK,
        provider_sequence=seq,
        progress=progress,
    )


def plat(
    kind: PlatformKind, stage: Stage | None = None, progress: int | None = None
) -> PlatformObservation:
    return PlatformObservation(
        kind=kind, attempt_id=ATTEMPT, source=Source.MEDIA, stage=stage, progress=progress
    )


def test_unknown_attempt_is_recorded_not_applied() -> None:
    d = decide(task(), None, prov(ProviderStatus.RUNNING), T0)
    assert (d.outcome, d.reason) == (Outcome.IGNORED, Reason.UNKNOWN_ATTEMPT)


def test_observation_of_an_old_attempt_is_audit_only() -> None:
    old = AttemptView(OLD_ATTEMPT, ProviderStatus.RUNNING, None, None)
    d = decide(task(), old, prov(ProviderStatus.FAILED, attempt_id=OLD_ATTEMPT), T0)
    assert (d.outcome, d.reason, d.change) == (Outcome.IGNORED, Reason.STALE_ATTEMPT, None)
    assert d.reconcile is None


def test_success_of_an_old_attempt_opens_a_cost_reconciliation() -> None:
    old = AttemptView(OLD_ATTEMPT, ProviderStatus.RUNNING, None, None)
    d = decide(task(), old, prov(ProviderStatus.SUCCEEDED, attempt_id=OLD_ATTEMPT), T0)
    assert d.reason is Reason.STALE_ATTEMPT
    assert d.reconcile is ReconcileKind.STALE_ATTEMPT_RESULT


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (ProviderStatus.SUCCEEDED, ProviderStatus.FAILED),
        (ProviderStatus.FAILED, ProviderStatus.SUCCEEDED),
        (ProviderStatus.CANCELED, ProviderStatus.SUCCEEDED),
        (ProviderStatus.SUCCEEDED, ProviderStatus.CANCELED),
    ],
)
def test_contradictory_terminals_are_a_conflict_never_last_writer_wins(
    first: ProviderStatus, second: ProviderStatus
) -> None:
    status = {
        ProviderStatus.SUCCEEDED: Status.PROVIDER_SUCCEEDED,
        ProviderStatus.FAILED: Status.FAILED,
        ProviderStatus.CANCELED: Status.CANCELED,
    }[first]
    d = decide(task(status), attempt(first, 9), prov(second, seq=10), T0)
    assert d.outcome is Outcome.CONFLICT
    assert d.reconcile is ReconcileKind.CONTRADICTORY_TERMINAL
    assert d.change is None


def test_same_terminal_again_is_a_no_op() -> None:
    d = decide(task(Status.FAILED), attempt(ProviderStatus.FAILED), prov(ProviderStatus.FAILED), T0)
    assert (d.outcome, d.reason) == (Outcome.IGNORED, Reason.NO_CHANGE)


def test_progress_after_terminal_is_absorbed() -> None:
    d = decide(
        task(Status.CANCELED),
        attempt(ProviderStatus.CANCELED, 5),
        prov(ProviderStatus.RUNNING, seq=9, progress=90),
        T0,
    )
    assert (d.outcome, d.reason) == (Outcome.IGNORED, Reason.AFTER_TERMINAL)


def test_stale_provider_sequence_is_ignored() -> None:
    d = decide(
        task(Status.RUNNING, progress=50),
        attempt(ProviderStatus.RUNNING, 7),
        prov(ProviderStatus.RUNNING, seq=7, progress=70),
        T0,
    )
    assert d.reason is Reason.STALE_SEQUENCE


def test_late_queued_after_running_is_a_stale_status_without_sequences() -> None:
    d = decide(
        task(Status.RUNNING, progress=70),
        attempt(ProviderStatus.RUNNING),
        prov(ProviderStatus.QUEUED),
        T0,
    )
    assert d.reason is Reason.STALE_STATUS


def test_provider_success_is_not_ready() -> None:
    d = decide(
        task(Status.RUNNING), attempt(ProviderStatus.RUNNING), prov(ProviderStatus.SUCCEEDED), T0
    )
    assert d.applied and d.change is not None
    assert d.change.status is Status.PROVIDER_SUCCEEDED
    assert not d.change.terminal


def test_callback_before_submit_response_moves_a_created_task() -> None:
    d = decide(task(Status.CREATED), attempt(), prov(ProviderStatus.RUNNING, progress=10), T0)
    assert d.applied and d.change is not None and d.change.status is Status.RUNNING
    late_accept = decide(
        task(Status.RUNNING),
        attempt(ProviderStatus.RUNNING),
        plat(PlatformKind.SUBMIT_ACCEPTED),
        T0,
    )
    assert late_accept.reason is Reason.NO_CHANGE


class TestCancel:
    def test_cancel_request_is_not_canceled(self) -> None:
        d = decide(
            task(Status.RUNNING),
            attempt(ProviderStatus.RUNNING),
            plat(PlatformKind.CANCEL_REQUESTED),
            T0,
        )
        assert d.change is not None and d.change.status is Status.CANCEL_REQUESTED

    def test_provider_confirmation_cancels(self) -> None:
        d = decide(
            task(Status.CANCEL_REQUESTED),
            attempt(ProviderStatus.RUNNING),
            prov(ProviderStatus.CANCELED),
            T0,
        )
        assert d.change is not None and d.change.status is Status.CANCELED

    def test_progress_while_cancel_pending_changes_nothing_public(self) -> None:
        d = decide(
            task(Status.CANCEL_REQUESTED),
            attempt(ProviderStatus.RUNNING, 3),
            prov(ProviderStatus.RUNNING, seq=4, progress=80),
            T0,
        )
        assert d.reason is Reason.CANCEL_PENDING
        assert d.attempt is not None and d.attempt.last_provider_seq == 4

    def test_success_that_arrives_first_wins(self) -> None:
        d = decide(
            task(Status.CANCEL_REQUESTED),
            attempt(ProviderStatus.RUNNING),
            prov(ProviderStatus.SUCCEEDED),
            T0,
        )
        assert d.change is not None and d.change.status is Status.PROVIDER_SUCCEEDED

    def test_cancel_after_provider_success_is_refused(self) -> None:
        d = decide(
            task(Status.PROVIDER_SUCCEEDED),
            attempt(ProviderStatus.SUCCEEDED),
            plat(PlatformKind.CANCEL_REQUESTED),
            T0,
        )
        assert d.reason is Reason.NOT_CANCELABLE


class TestProgress:
    def test_unchanged_observation_writes_nothing(self) -> None:
        d = decide(
            task(Status.RUNNING, progress=40),
            attempt(ProviderStatus.RUNNING),
            prov(ProviderStatus.RUNNING, progress=40),
            T0 + timedelta(seconds=10),
        )
        assert d.reason is Reason.NO_CHANGE

    def test_progress_never_goes_back_within_a_stage(self) -> None:
        d = decide(
            task(Status.RUNNING, progress=40),
            attempt(ProviderStatus.RUNNING),
            prov(ProviderStatus.RUNNING, progress=30),
            T0 + timedelta(seconds=10),
        )
        assert d.reason is Reason.PROGRESS_REGRESSION

    def test_small_fast_progress_is_coalesced(self) -> None:
        d = decide(
            task(Status.RUNNING, progress=40),
            attempt(ProviderStatus.RUNNING),
            prov(ProviderStatus.RUNNING, progress=44),
            T0 + timedelta(seconds=1),
        )
        assert d.reason is Reason.COALESCED

    def test_five_points_are_written_at_once(self) -> None:
        d = decide(
            task(Status.RUNNING, progress=40),
            attempt(ProviderStatus.RUNNING),
            prov(ProviderStatus.RUNNING, progress=45),
            T0 + timedelta(milliseconds=10),
        )
        assert d.applied and d.change is not None and d.change.progress == 45

    def test_small_progress_after_the_interval_is_written(self) -> None:
        d = decide(
            task(Status.RUNNING, progress=40),
            attempt(ProviderStatus.RUNNING),
            prov(ProviderStatus.RUNNING, progress=41),
            T0 + timedelta(seconds=1.5),
        )
        assert d.applied

    def test_stage_changes_and_terminals_are_never_coalesced(self) -> None:
        soon = T0 + timedelta(milliseconds=1)
        stage = decide(
            task(Status.PROVIDER_QUEUED, progress=0),
            attempt(ProviderStatus.QUEUED),
            prov(ProviderStatus.RUNNING, progress=1),
            soon,
        )
        assert stage.applied
        final = decide(
            task(Status.RUNNING, progress=99),
            attempt(ProviderStatus.RUNNING),
            prov(ProviderStatus.FAILED),
            soon,
        )
        assert final.applied and final.change is not None and final.change.status is Status.FAILED


class TestMedia:
    def test_stages_move_forward_only(self) -> None:
        t = task(Status.PROCESSING_MEDIA, stage=Stage.TRANSCODING, progress=10)
        back = decide(
            t, attempt(ProviderStatus.SUCCEEDED), plat(PlatformKind.MEDIA_STAGE, Stage.PROBING), T0
        )
        assert back.reason is Reason.STALE_STAGE
        fwd = decide(
            t,
            attempt(ProviderStatus.SUCCEEDED),
            plat(PlatformKind.MEDIA_STAGE, Stage.PUBLISHING),
            T0,
        )
        assert fwd.change is not None and fwd.change.stage is Stage.PUBLISHING

    def test_ready_only_after_provider_success(self) -> None:
        early = decide(
            task(Status.RUNNING),
            attempt(ProviderStatus.RUNNING),
            plat(PlatformKind.MEDIA_READY),
            T0,
        )
        assert early.reason is Reason.ILLEGAL_TRANSITION
        asset = uuid.uuid4()
        ready = decide(
            task(Status.PROCESSING_MEDIA, stage=Stage.PUBLISHING),
            attempt(ProviderStatus.SUCCEEDED),
            PlatformObservation(
                kind=PlatformKind.MEDIA_READY,
                attempt_id=ATTEMPT,
                source=Source.MEDIA,
                asset_id=asset,
            ),
            T0,
        )
        assert ready.change is not None
        assert (ready.change.status, ready.change.asset_id, ready.change.progress) == (
            Status.READY,
            asset,
            100,
        )

    def test_media_failure_after_ready_is_a_conflict(self) -> None:
        d = decide(
            task(Status.READY),
            attempt(ProviderStatus.SUCCEEDED),
            plat(PlatformKind.MEDIA_FAILED),
            T0,
        )
        assert d.outcome is Outcome.CONFLICT


def test_failed_without_code_gets_the_generic_public_code() -> None:
    d = decide(
        task(Status.RUNNING), attempt(ProviderStatus.RUNNING), prov(ProviderStatus.FAILED), T0
    )
    assert d.change is not None and d.change.error_code == "generation_failed"


def test_progress_outside_0_100_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="progress"):
        prov(ProviderStatus.RUNNING, progress=101)


# -- cancel confirmed by the platform (an attempt that never reached the provider) -------------


def test_platform_cancel_confirmation_cancels_a_cancel_requested_task() -> None:
    d = decide(task(Status.CANCEL_REQUESTED), attempt(), plat(PlatformKind.CANCEL_CONFIRMED), T0)
    assert d.applied
    assert d.change is not None
    assert (d.change.status, d.change.stage, d.change.error_code) == (
        Status.CANCELED,
        Stage.DONE,
        None,
    )


@pytest.mark.parametrize("status", [Status.CREATED, Status.SUBMITTED, Status.RUNNING])
def test_platform_cancel_confirmation_needs_a_cancel_request(status: Status) -> None:
    d = decide(task(status), attempt(), plat(PlatformKind.CANCEL_CONFIRMED), T0)
    assert (d.outcome, d.reason) == (Outcome.IGNORED, Reason.ILLEGAL_TRANSITION)


def test_platform_cancel_confirmation_is_refused_once_the_provider_reported() -> None:
    d = decide(
        task(Status.CANCEL_REQUESTED),
        attempt(ProviderStatus.RUNNING, 2),
        plat(PlatformKind.CANCEL_CONFIRMED),
        T0,
    )
    assert (d.outcome, d.reason) == (Outcome.IGNORED, Reason.ILLEGAL_TRANSITION)


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (Status.CANCELED, Reason.NO_CHANGE),
        (Status.FAILED, Reason.AFTER_TERMINAL),
        (Status.READY, Reason.AFTER_TERMINAL),
    ],
)
def test_platform_cancel_confirmation_never_contradicts_a_terminal(
    status: Status, reason: Reason
) -> None:
    d = decide(task(status), attempt(), plat(PlatformKind.CANCEL_CONFIRMED), T0)
    assert (d.outcome, d.reason, d.reconcile) == (Outcome.IGNORED, reason, None)


def test_a_version_that_moves_only_the_progress_is_a_progress_event() -> None:
    running = task(Status.RUNNING, progress=10)
    d = decide(
        running,
        attempt(ProviderStatus.RUNNING, 3),
        prov(ProviderStatus.RUNNING, seq=4, progress=40),
        T0,
    )
    assert d.outcome is Outcome.APPLIED and d.change is not None
    assert progress_only(running, d.change)
    started = decide(
        task(Status.SUBMITTED), attempt(), prov(ProviderStatus.RUNNING, progress=5), T0
    )
    assert started.change is not None and not progress_only(task(Status.SUBMITTED), started.change)
    done = decide(
        running, attempt(ProviderStatus.RUNNING, 3), prov(ProviderStatus.SUCCEEDED, seq=4), T0
    )
    assert done.change is not None and not progress_only(running, done.change)


@pytest.mark.parametrize(
    "field",
    [
        {"status": Status.SUBMITTED},
        {"stage": Stage.INGESTING},
        {"error_code": "provider_error"},
        {"error_message": "late"},
        {"asset_id": uuid.uuid4()},
        {"progress": 10},
    ],
)
def test_any_other_change_is_a_status_event(field: dict[str, object]) -> None:
    running = task(Status.RUNNING, progress=10)
    base = TaskChange(
        status=running.status,
        stage=running.stage,
        progress=40,
        error_code=None,
        error_message=None,
        asset_id=None,
    )
    assert progress_only(running, base)
    changed = TaskChange(**{**{f: getattr(base, f) for f in base.__slots__}, **field})
    assert not progress_only(running, changed)
