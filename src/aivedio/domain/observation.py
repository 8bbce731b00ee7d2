"""What the state service is asked to apply.

Webhooks, polling and reconciliation all produce a ``ProviderObservation`` (seed §12.5.1); the
platform's own steps (submitter, media worker, cancel command, query-failure tracking) produce a
``PlatformObservation``. Both go through the same ``transitions.decide``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from aivedio.domain.statuses import Stage


class ProviderStatus(StrEnum):
    """A provider's status after normalization by its adapter."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


PROVIDER_TERMINAL: frozenset[ProviderStatus] = frozenset(
    {ProviderStatus.SUCCEEDED, ProviderStatus.FAILED, ProviderStatus.CANCELED}
)

# Provider statuses an attempt may move to from each (a provider never goes back to queued once it
# reported running). Terminal provider statuses have no successors: a different one is a conflict.
PROVIDER_SUCCESSORS: dict[ProviderStatus | None, frozenset[ProviderStatus]] = {
    None: frozenset(ProviderStatus),
    ProviderStatus.QUEUED: frozenset(ProviderStatus) - {ProviderStatus.QUEUED},
    ProviderStatus.RUNNING: PROVIDER_TERMINAL,
    ProviderStatus.SUCCEEDED: frozenset(),
    ProviderStatus.FAILED: frozenset(),
    ProviderStatus.CANCELED: frozenset(),
}


class Source(StrEnum):
    WEBHOOK = "webhook"
    POLL = "poll"
    RECONCILE = "reconcile"
    SUBMIT = "submit"
    MEDIA = "media"
    API = "api"


class PlatformKind(StrEnum):
    """The platform's own observations of a task."""

    SUBMIT_ACCEPTED = "submit_accepted"
    SUBMIT_UNKNOWN = "submit_unknown"
    SUBMIT_REJECTED = "submit_rejected"
    STATUS_UNKNOWN = "status_unknown"
    CANCEL_REQUESTED = "cancel_requested"
    # The platform confirms a cancel itself: the attempt has no job at the provider (its submit
    # was never sent, or the provider refused it), so no provider confirmation will come.
    CANCEL_CONFIRMED = "cancel_confirmed"
    MEDIA_STAGE = "media_stage"
    MEDIA_READY = "media_ready"
    MEDIA_FAILED = "media_failed"


def _now() -> datetime:
    return datetime.now(UTC)


def _check_progress(progress: int | None) -> None:
    if progress is not None and not 0 <= progress <= 100:
        raise ValueError(f"progress must be within 0..100, got {progress}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProviderObservation:
    """One normalized look at a provider job, from a webhook, a poll or a reconciliation query."""

    provider: str
    attempt_id: uuid.UUID | None
    status: ProviderStatus
    source: Source
    provider_task_id: str | None = None
    client_request_id: str | None = None
    provider_event_id: str | None = None
    dedup_key: str | None = None
    provider_sequence: int | None = None
    provider_occurred_at: datetime | None = None
    received_at: datetime = field(default_factory=_now)
    progress: int | None = None
    error_code: str | None = None  # a public product code chosen by the adapter
    error_message: str | None = None  # a public, provider-neutral message
    output_refs: tuple[str, ...] = ()  # never public: may be signed URLs
    payload_hash: str | None = None
    inbox_id: int | None = None  # the callback inbox row this came from, marked processed
    trace_id: str | None = None

    def __post_init__(self) -> None:
        _check_progress(self.progress)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlatformObservation:
    """A step the platform itself took or saw (submit outcome, media stage, cancel request)."""

    kind: PlatformKind
    attempt_id: uuid.UUID | None
    source: Source
    stage: Stage | None = None
    progress: int | None = None
    asset_id: uuid.UUID | None = None
    error_code: str | None = None
    error_message: str | None = None
    received_at: datetime = field(default_factory=_now)
    trace_id: str | None = None

    def __post_init__(self) -> None:
        _check_progress(self.progress)
        if self.kind is PlatformKind.MEDIA_STAGE and self.stage is None:
            raise ValueError("a media_stage observation names its stage")


Observation = ProviderObservation | PlatformObservation
