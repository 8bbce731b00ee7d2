"""The status table, declared once.

Every behaviour that depends on a status reads a flag from this table; nothing is derived from
arithmetic on names or codes (seed 004: ``5600 % 1000 == 600`` closed every stream on the first
item done). Adding a status means adding one row here and its successors in ``SUCCESSORS``; the
unit tests walk the whole table.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Status(StrEnum):
    """Platform task status (``generation_tasks.status``)."""

    CREATED = "created"  # task + attempt + submit intent written; not yet sent to the provider
    SUBMIT_UNKNOWN = "submit_unknown"  # the submit call's outcome is unknown; reconcile by lookup
    SUBMITTED = "submitted"  # the provider accepted the job; provider task id known
    PROVIDER_QUEUED = "provider_queued"  # the provider reports it queued (or throttled)
    RUNNING = "running"  # the provider is generating
    STATUS_UNKNOWN = "status_unknown"  # N consecutive query failures; never a reason to fail
    CANCEL_REQUESTED = "cancel_requested"  # the user asked; the provider has not confirmed
    PROVIDER_SUCCEEDED = "provider_succeeded"  # the provider finished; our asset is not ready
    PROCESSING_MEDIA = "processing_media"  # ingest / probe / transcode / publish
    READY = "ready"  # the asset is published and playable
    FAILED = "failed"
    CANCELED = "canceled"


class Stage(StrEnum):
    """What the user sees as the step in progress (``generation_tasks.stage``)."""

    SUBMITTING = "submitting"
    QUEUED = "queued"
    GENERATING = "generating"
    CANCELING = "canceling"
    INGESTING = "ingesting"
    PROBING = "probing"
    TRANSCODING = "transcoding"
    PUBLISHING = "publishing"
    DONE = "done"


# The media pipeline's stages in order. A media observation may only move forward in this list.
MEDIA_STAGES: tuple[Stage, ...] = (
    Stage.INGESTING,
    Stage.PROBING,
    Stage.TRANSCODING,
    Stage.PUBLISHING,
)


@dataclass(frozen=True, slots=True)
class StatusInfo:
    """One row of the status table.

    - ``terminal``: the task is finished; no observation changes it any more.
    - ``public``: the status name a browser sees (internal statuses show as a public one).
    - ``stage``: the stage the task enters with this status unless the observation names one.
    - ``provider_active``: the provider may still change the attempt, so the poller queries it.
    """

    status: Status
    terminal: bool
    public: str
    stage: Stage
    provider_active: bool


_TABLE: tuple[StatusInfo, ...] = (
    StatusInfo(Status.CREATED, False, "queued", Stage.SUBMITTING, False),
    StatusInfo(Status.SUBMIT_UNKNOWN, False, "queued", Stage.SUBMITTING, True),
    StatusInfo(Status.SUBMITTED, False, "queued", Stage.QUEUED, True),
    StatusInfo(Status.PROVIDER_QUEUED, False, "queued", Stage.QUEUED, True),
    StatusInfo(Status.RUNNING, False, "running", Stage.GENERATING, True),
    StatusInfo(Status.STATUS_UNKNOWN, False, "running", Stage.GENERATING, True),
    StatusInfo(Status.CANCEL_REQUESTED, False, "cancel_requested", Stage.CANCELING, True),
    StatusInfo(Status.PROVIDER_SUCCEEDED, False, "processing_media", Stage.INGESTING, False),
    StatusInfo(Status.PROCESSING_MEDIA, False, "processing_media", Stage.INGESTING, False),
    StatusInfo(Status.READY, True, "ready", Stage.DONE, False),
    StatusInfo(Status.FAILED, True, "failed", Stage.DONE, False),
    StatusInfo(Status.CANCELED, True, "canceled", Stage.DONE, False),
)

STATUS_TABLE: dict[Status, StatusInfo] = {row.status: row for row in _TABLE}

PUBLIC_STATUSES: frozenset[str] = frozenset(row.public for row in _TABLE)
FINAL_PUBLIC_STATUSES: frozenset[str] = frozenset(row.public for row in _TABLE if row.terminal)


def info(status: Status | str) -> StatusInfo:
    return STATUS_TABLE[Status(status)]


def is_terminal(status: Status | str) -> bool:
    return STATUS_TABLE[Status(status)].terminal


# Legal successors of each status, written out (not computed from an order) so that a reviewer
# reads every edge. A status is never its own successor here: a same-status observation that only
# moves progress or stage is decided by the progress rules in ``transitions``.
_S = Status
SUCCESSORS: dict[Status, frozenset[Status]] = {
    _S.CREATED: frozenset(
        {
            _S.SUBMIT_UNKNOWN,
            _S.SUBMITTED,
            _S.PROVIDER_QUEUED,
            _S.RUNNING,
            _S.STATUS_UNKNOWN,
            _S.CANCEL_REQUESTED,
            _S.PROVIDER_SUCCEEDED,
            _S.FAILED,
            _S.CANCELED,
        }
    ),
    _S.SUBMIT_UNKNOWN: frozenset(
        {
            _S.SUBMITTED,
            _S.PROVIDER_QUEUED,
            _S.RUNNING,
            _S.STATUS_UNKNOWN,
            _S.CANCEL_REQUESTED,
            _S.PROVIDER_SUCCEEDED,
            _S.FAILED,
            _S.CANCELED,
        }
    ),
    _S.SUBMITTED: frozenset(
        {
            _S.PROVIDER_QUEUED,
            _S.RUNNING,
            _S.STATUS_UNKNOWN,
            _S.CANCEL_REQUESTED,
            _S.PROVIDER_SUCCEEDED,
            _S.FAILED,
            _S.CANCELED,
        }
    ),
    _S.PROVIDER_QUEUED: frozenset(
        {
            _S.RUNNING,
            _S.STATUS_UNKNOWN,
            _S.CANCEL_REQUESTED,
            _S.PROVIDER_SUCCEEDED,
            _S.FAILED,
            _S.CANCELED,
        }
    ),
    _S.RUNNING: frozenset(
        {
            _S.STATUS_UNKNOWN,
            _S.CANCEL_REQUESTED,
            _S.PROVIDER_SUCCEEDED,
            _S.FAILED,
            _S.CANCELED,
        }
    ),
    # A query that succeeds again resolves "unknown" to what the provider says; whether that is a
    # step back is judged against the attempt's last known provider status (see transitions).
    _S.STATUS_UNKNOWN: frozenset(
        {
            _S.SUBMITTED,
            _S.PROVIDER_QUEUED,
            _S.RUNNING,
            _S.CANCEL_REQUESTED,
            _S.PROVIDER_SUCCEEDED,
            _S.FAILED,
            _S.CANCELED,
        }
    ),
    # Cancel is a request. The provider's confirmation makes it canceled; a success or failure
    # that the provider reached first wins (documented in docs/explanation/state-machine.md).
    _S.CANCEL_REQUESTED: frozenset({_S.PROVIDER_SUCCEEDED, _S.FAILED, _S.CANCELED}),
    _S.PROVIDER_SUCCEEDED: frozenset({_S.PROCESSING_MEDIA, _S.READY, _S.FAILED}),
    _S.PROCESSING_MEDIA: frozenset({_S.READY, _S.FAILED}),
    _S.READY: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELED: frozenset(),
}
del _S


# Statuses from which a user may ask for a new attempt (REST retry). Retrying a finished success
# would pay twice for nothing; retrying an active task would run two generations at once.
RETRYABLE: frozenset[Status] = frozenset({Status.FAILED, Status.CANCELED})

# Statuses from which a user may ask to cancel. Once the provider finished, there is nothing to
# cancel at the provider; media processing of a paid result is not canceled.
CANCELABLE: frozenset[Status] = frozenset(
    {
        Status.CREATED,
        Status.SUBMIT_UNKNOWN,
        Status.SUBMITTED,
        Status.PROVIDER_QUEUED,
        Status.RUNNING,
        Status.STATUS_UNKNOWN,
    }
)
