"""The transition function: one observation, at most one new task version.

``decide`` is pure: it reads the task and attempt as the state service locked them, the
observation and the clock value it is given, and returns a ``Decision``. The state service turns
an applied decision into version + 1, one task event and one outbox row in one transaction; an
ignored one into an audit row; a conflict into an audit row and a reconciliation item.

Order of the checks (each one only sees what passed the ones before):

1. unknown attempt -> ignored, recorded;
2. attempt isolation: an observation of a non-current attempt is audit only (a success there
   also opens a cost reconciliation item);
3. contradictory terminals (provider said succeeded, now failed, or the reverse) -> conflict and a
   reconciliation item; never last-writer-wins;
4. terminal absorption: nothing changes a finished attempt or task;
5. provider sequence staleness (``sequence <= last seen``);
6. provider status regression (running -> queued) by the provider successor table;
7. legal platform successor, cancel semantics, media stage order;
8. progress: monotonic within a stage; coalesced unless it moved >= ``min_points`` or
   ``min_interval`` passed since the last progress event of the stage; stage changes and
   terminals are never coalesced; an unchanged observation writes nothing.

Last, an applied change that leaves every public field as it was (two internal statuses with one
public face: ``submitted`` -> ``provider_queued``, ``provider_succeeded`` -> ``processing_media``
at ``ingesting``) is still a new task version, but not a public event: the decision carries
``Reason.NO_PUBLIC_CHANGE`` and the state service writes the version, its outbox row (internal
consumers read internal statuses) and an audit row, and takes no stream seq.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum

from aivedio.domain.observation import (
    PROVIDER_SUCCESSORS,
    PROVIDER_TERMINAL,
    Observation,
    PlatformKind,
    PlatformObservation,
    ProviderObservation,
    ProviderStatus,
)
from aivedio.domain.public import public_fields
from aivedio.domain.statuses import (
    CANCELABLE,
    MEDIA_STAGES,
    STATUS_TABLE,
    SUCCESSORS,
    Stage,
    Status,
)


class Outcome(StrEnum):
    APPLIED = "applied"
    IGNORED = "ignored"
    CONFLICT = "conflict"


class Reason(StrEnum):
    """Why an observation did not produce a public event (``observation_audit.reason``)."""

    UNKNOWN_ATTEMPT = "unknown_attempt"
    STALE_ATTEMPT = "stale_attempt"
    STALE_SEQUENCE = "stale_sequence"
    STALE_STATUS = "stale_status"
    STALE_STAGE = "stale_stage"
    AFTER_TERMINAL = "after_terminal"
    CANCEL_PENDING = "cancel_pending"
    ILLEGAL_TRANSITION = "illegal_transition"
    NOT_CANCELABLE = "not_cancelable"
    PROGRESS_REGRESSION = "progress_regression"
    COALESCED = "coalesced"
    NO_CHANGE = "no_change"
    CONTRADICTORY_TERMINAL = "contradictory_terminal"
    # Applied: a new task version whose public fields equal the old ones (no public event).
    NO_PUBLIC_CHANGE = "no_public_change"


class ReconcileKind(StrEnum):
    CONTRADICTORY_TERMINAL = "contradictory_terminal"
    STALE_ATTEMPT_RESULT = "stale_attempt_result"


@dataclass(frozen=True, slots=True)
class CoalescePolicy:
    """When a progress-only change is worth an event (seed §12.11.1)."""

    min_points: int = 5
    min_interval: timedelta = timedelta(seconds=1.5)


@dataclass(frozen=True, slots=True)
class TaskView:
    """The task row as the state service locked it."""

    id: uuid.UUID
    status: Status
    stage: Stage
    progress: int | None
    version: int
    current_attempt_id: uuid.UUID | None
    progress_event_at: datetime | None  # when the last event of the current stage was written
    error_code: str | None = None
    error_message: str | None = None
    asset_id: uuid.UUID | None = None


@dataclass(frozen=True, slots=True)
class AttemptView:
    """The attempt row as the state service locked it."""

    id: uuid.UUID
    provider_status: ProviderStatus | None
    last_provider_seq: int | None
    last_provider_at: datetime | None


@dataclass(frozen=True, slots=True)
class TaskChange:
    """The task's new public state; the service adds version + 1 and the stream seq."""

    status: Status
    stage: Stage
    progress: int | None
    error_code: str | None
    error_message: str | None
    asset_id: uuid.UUID | None

    @property
    def terminal(self) -> bool:
        return STATUS_TABLE[self.status].terminal


@dataclass(frozen=True, slots=True)
class AttemptChange:
    provider_status: ProviderStatus | None
    last_provider_seq: int | None
    last_provider_at: datetime | None


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    reason: Reason | None = None
    change: TaskChange | None = None
    attempt: AttemptChange | None = None  # what to record on the attempt, whatever the outcome
    reconcile: ReconcileKind | None = None

    @property
    def applied(self) -> bool:
        """A new task version (public or not)."""
        return self.outcome is Outcome.APPLIED

    @property
    def public(self) -> bool:
        """A new task version that is also a public event (it takes a stream seq)."""
        return self.outcome is Outcome.APPLIED and self.reason is None


_PROVIDER_TARGET: dict[ProviderStatus, Status] = {
    ProviderStatus.QUEUED: Status.PROVIDER_QUEUED,
    ProviderStatus.RUNNING: Status.RUNNING,
    ProviderStatus.SUCCEEDED: Status.PROVIDER_SUCCEEDED,
    ProviderStatus.FAILED: Status.FAILED,
    ProviderStatus.CANCELED: Status.CANCELED,
}

_PLATFORM_TARGET: dict[PlatformKind, Status] = {
    PlatformKind.SUBMIT_ACCEPTED: Status.SUBMITTED,
    PlatformKind.SUBMIT_UNKNOWN: Status.SUBMIT_UNKNOWN,
    PlatformKind.SUBMIT_REJECTED: Status.FAILED,
    PlatformKind.STATUS_UNKNOWN: Status.STATUS_UNKNOWN,
    PlatformKind.CANCEL_REQUESTED: Status.CANCEL_REQUESTED,
    PlatformKind.CANCEL_CONFIRMED: Status.CANCELED,
    PlatformKind.MEDIA_STAGE: Status.PROCESSING_MEDIA,
    PlatformKind.MEDIA_READY: Status.READY,
    PlatformKind.MEDIA_FAILED: Status.FAILED,
}

# Where each platform observation may come from; anything else is an illegal transition.
_PLATFORM_FROM: dict[PlatformKind, frozenset[Status]] = {
    PlatformKind.SUBMIT_ACCEPTED: frozenset({Status.CREATED, Status.SUBMIT_UNKNOWN}),
    PlatformKind.SUBMIT_UNKNOWN: frozenset({Status.CREATED}),
    PlatformKind.SUBMIT_REJECTED: frozenset({Status.CREATED, Status.SUBMIT_UNKNOWN}),
    PlatformKind.STATUS_UNKNOWN: frozenset(
        {Status.SUBMITTED, Status.PROVIDER_QUEUED, Status.RUNNING, Status.SUBMIT_UNKNOWN}
    ),
    PlatformKind.CANCEL_REQUESTED: CANCELABLE,
    PlatformKind.CANCEL_CONFIRMED: frozenset({Status.CANCEL_REQUESTED}),
    PlatformKind.MEDIA_STAGE: frozenset({Status.PROVIDER_SUCCEEDED, Status.PROCESSING_MEDIA}),
    PlatformKind.MEDIA_READY: frozenset({Status.PROVIDER_SUCCEEDED, Status.PROCESSING_MEDIA}),
    PlatformKind.MEDIA_FAILED: frozenset({Status.PROVIDER_SUCCEEDED, Status.PROCESSING_MEDIA}),
}

# Statuses whose progress figure means something (the provider's or the media step's percentage).
_HAS_PROGRESS: frozenset[Status] = frozenset(
    {Status.PROVIDER_QUEUED, Status.RUNNING, Status.PROCESSING_MEDIA}
)


# While a cancel is pending, a provider that still reports progress changes nothing public.
_CANCEL_PENDING_TARGETS: frozenset[Status] = frozenset({Status.PROVIDER_QUEUED, Status.RUNNING})
_SUBMIT_PENDING: frozenset[Status] = frozenset({Status.CREATED, Status.SUBMIT_UNKNOWN})


def _ignored(reason: Reason, attempt: AttemptChange | None = None) -> Decision:
    return Decision(Outcome.IGNORED, reason, attempt=attempt)


def changes_public(task: TaskView | TaskChange, change: TaskChange) -> bool:
    """Whether a client could tell the task after ``change`` from the task before it."""
    before = public_fields(task.status, task.stage, task.progress, task.asset_id, task.error_code)
    after = public_fields(
        change.status, change.stage, change.progress, change.asset_id, change.error_code
    )
    return before != after


def decide(
    task: TaskView,
    attempt: AttemptView | None,
    obs: Observation,
    now: datetime,
    policy: CoalescePolicy = CoalescePolicy(),
) -> Decision:
    """Decide what one observation does to a task. Pure; see the module docstring."""
    decision = _decide(task, attempt, obs, now, policy)
    if decision.change is not None and not changes_public(task, decision.change):
        return replace(decision, reason=Reason.NO_PUBLIC_CHANGE)
    return decision


def _decide(
    task: TaskView,
    attempt: AttemptView | None,
    obs: Observation,
    now: datetime,
    policy: CoalescePolicy,
) -> Decision:
    if attempt is None:
        return _ignored(Reason.UNKNOWN_ATTEMPT)
    if attempt.id != task.current_attempt_id:
        stale_success = (
            isinstance(obs, ProviderObservation) and obs.status is ProviderStatus.SUCCEEDED
        )
        return Decision(
            Outcome.IGNORED,
            Reason.STALE_ATTEMPT,
            reconcile=ReconcileKind.STALE_ATTEMPT_RESULT if stale_success else None,
        )
    if isinstance(obs, ProviderObservation):
        return _decide_provider(task, attempt, obs, now, policy)
    if obs.kind is PlatformKind.CANCEL_CONFIRMED:
        # Only for an attempt the provider never reported on; never a contradiction of a
        # terminal the task already reached (that terminal simply stands).
        if attempt.provider_status is not None:
            return _ignored(Reason.ILLEGAL_TRANSITION)
        if STATUS_TABLE[task.status].terminal:
            return _ignored(
                Reason.NO_CHANGE if task.status is Status.CANCELED else Reason.AFTER_TERMINAL
            )
    return _decide_platform(task, obs, now, policy)


def _decide_provider(
    task: TaskView,
    attempt: AttemptView,
    obs: ProviderObservation,
    now: datetime,
    policy: CoalescePolicy,
) -> Decision:
    target = _PROVIDER_TARGET[obs.status]
    refused = _refuse_provider(task, attempt, obs, target)
    if refused is not None:
        return refused
    recorded = _recorded_attempt(attempt, obs)
    if task.status is Status.CANCEL_REQUESTED and target in _CANCEL_PENDING_TARGETS:
        # Still working at the provider: the user already sees "canceling".
        return _ignored(Reason.CANCEL_PENDING, recorded)
    if target is task.status:
        return _progress_only(task, obs.progress, now, policy, recorded)
    if target not in SUCCESSORS[task.status]:
        return _ignored(Reason.ILLEGAL_TRANSITION, recorded)
    return Decision(Outcome.APPLIED, change=_provider_change(target, obs), attempt=recorded)


def _refuse_provider(
    task: TaskView, attempt: AttemptView, obs: ProviderObservation, target: Status
) -> Decision | None:
    """The decision for a provider report that records nothing, or None to go on."""
    seen = attempt.provider_status
    if seen in PROVIDER_TERMINAL:
        if obs.status in PROVIDER_TERMINAL and obs.status is not seen:
            return Decision(
                Outcome.CONFLICT,
                Reason.CONTRADICTORY_TERMINAL,
                reconcile=ReconcileKind.CONTRADICTORY_TERMINAL,
            )
        return _ignored(Reason.NO_CHANGE if obs.status is seen else Reason.AFTER_TERMINAL)
    if STATUS_TABLE[task.status].terminal:
        # A task can finish without a provider terminal (submit rejected); a provider terminal
        # that disagrees with it is a contradiction, anything else comes too late.
        if STATUS_TABLE[target].terminal and target is not task.status:
            return Decision(
                Outcome.CONFLICT,
                Reason.CONTRADICTORY_TERMINAL,
                reconcile=ReconcileKind.CONTRADICTORY_TERMINAL,
            )
        return _ignored(Reason.AFTER_TERMINAL)
    if (
        obs.provider_sequence is not None
        and attempt.last_provider_seq is not None
        and obs.provider_sequence <= attempt.last_provider_seq
    ):
        return _ignored(Reason.STALE_SEQUENCE)
    if seen is not None and obs.status is not seen and obs.status not in PROVIDER_SUCCESSORS[seen]:
        return _ignored(Reason.STALE_STATUS)
    return None


def _recorded_attempt(attempt: AttemptView, obs: ProviderObservation) -> AttemptChange:
    """What the attempt remembers of an accepted provider report."""
    return AttemptChange(
        provider_status=obs.status,
        last_provider_seq=(
            obs.provider_sequence
            if obs.provider_sequence is not None
            else attempt.last_provider_seq
        ),
        last_provider_at=obs.provider_occurred_at or attempt.last_provider_at,
    )


def _provider_change(target: Status, obs: ProviderObservation) -> TaskChange:
    """The task change for a provider report that moves the task to `target`."""
    error_code = obs.error_code if target is Status.FAILED else None
    error_message = obs.error_message if target is Status.FAILED else None
    if target is Status.FAILED and error_code is None:
        error_code = "generation_failed"
    return TaskChange(
        status=target,
        stage=STATUS_TABLE[target].stage,
        progress=obs.progress if target in _HAS_PROGRESS else None,
        error_code=error_code,
        error_message=error_message,
        asset_id=None,
    )


def _decide_platform(
    task: TaskView,
    obs: PlatformObservation,
    now: datetime,
    policy: CoalescePolicy,
) -> Decision:
    target = _PLATFORM_TARGET[obs.kind]
    if STATUS_TABLE[task.status].terminal:
        if STATUS_TABLE[target].terminal and target is not task.status:
            return Decision(
                Outcome.CONFLICT,
                Reason.CONTRADICTORY_TERMINAL,
                reconcile=ReconcileKind.CONTRADICTORY_TERMINAL,
            )
        return _ignored(Reason.NO_CHANGE if target is task.status else Reason.AFTER_TERMINAL)
    if obs.kind is PlatformKind.SUBMIT_ACCEPTED and task.status not in _SUBMIT_PENDING:
        # A callback or poll already moved the task on; the accept adds nothing.
        return _ignored(Reason.NO_CHANGE)
    if obs.kind is PlatformKind.MEDIA_STAGE and task.status is Status.PROCESSING_MEDIA:
        assert obs.stage is not None  # checked by PlatformObservation
        if obs.stage == task.stage:
            return _progress_only(task, obs.progress, now, policy, None)
        if _media_rank(obs.stage) < _media_rank(task.stage):
            return _ignored(Reason.STALE_STAGE)
    elif target is task.status:
        return _ignored(Reason.NO_CHANGE)
    if task.status not in _PLATFORM_FROM[obs.kind]:
        reason = (
            Reason.NOT_CANCELABLE
            if obs.kind is PlatformKind.CANCEL_REQUESTED
            else Reason.ILLEGAL_TRANSITION
        )
        return _ignored(reason)
    if target is not task.status and target not in SUCCESSORS[task.status]:
        return _ignored(Reason.ILLEGAL_TRANSITION)
    stage = obs.stage if obs.kind is PlatformKind.MEDIA_STAGE else STATUS_TABLE[target].stage
    assert stage is not None
    progress: int | None = None
    if target in _HAS_PROGRESS:
        progress = obs.progress
    elif target is Status.READY:
        progress = 100
    error_code = error_message = None
    if target is Status.FAILED:
        error_code = obs.error_code or (
            "media_failed" if obs.kind is PlatformKind.MEDIA_FAILED else "submit_rejected"
        )
        error_message = obs.error_message
    change = TaskChange(
        status=target,
        stage=stage,
        progress=progress,
        error_code=error_code,
        error_message=error_message,
        asset_id=obs.asset_id if target is Status.READY else task.asset_id,
    )
    return Decision(Outcome.APPLIED, change=change)


def _media_rank(stage: Stage) -> int:
    return MEDIA_STAGES.index(stage) if stage in MEDIA_STAGES else -1


def _progress_only(
    task: TaskView,
    progress: int | None,
    now: datetime,
    policy: CoalescePolicy,
    recorded: AttemptChange | None,
) -> Decision:
    if progress is None or progress == task.progress:
        return _ignored(Reason.NO_CHANGE, recorded)
    if task.progress is not None and progress < task.progress:
        return _ignored(Reason.PROGRESS_REGRESSION, recorded)
    moved = progress - (task.progress or 0)
    waited = task.progress_event_at is None or now - task.progress_event_at >= policy.min_interval
    if moved < policy.min_points and not waited:
        return _ignored(Reason.COALESCED, recorded)
    change = TaskChange(
        status=task.status,
        stage=task.stage,
        progress=progress,
        error_code=task.error_code,
        error_message=task.error_message,
        asset_id=task.asset_id,
    )
    return Decision(Outcome.APPLIED, change=change, attempt=recorded)


def progress_only(task: TaskView, change: TaskChange) -> bool:
    """Whether ``change`` moves only the task's progress: same status, stage, error and asset.

    Such a version is a progress event: the browser's concern alone. The outbox routes it to
    the bus topic ``task.progress``, which only the notification dispatcher reads; every other
    version (a status or stage change, a terminal, a retry) goes to ``task.status``, which the
    internal consumers (media, billing) read as well."""
    return (
        change.progress != task.progress
        and change.status == task.status
        and change.stage == task.stage
        and change.error_code == task.error_code
        and change.error_message == task.error_message
        and change.asset_id == task.asset_id
    )


# A new attempt starts the task over: the fields a retry resets, in one place.
RETRY_CHANGE = TaskChange(
    status=Status.CREATED,
    stage=STATUS_TABLE[Status.CREATED].stage,
    progress=None,
    error_code=None,
    error_message=None,
    asset_id=None,
)
