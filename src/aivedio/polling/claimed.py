"""What the poller works on and reports: the statuses it polls, a claimed attempt, the record of
one query and the replica's counters.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import asyncpg

from aivedio.domain.observation import ProviderStatus
from aivedio.domain.statuses import STATUS_TABLE, Status
from aivedio.polling.policy import Outcome
from aivedio.polling.ratelimit import Scope
from aivedio.providers.port import JobState

__all__ = ["POLLED_STATUSES", "Claimed", "PollRecord", "PollerStats", "teaches"]

# Statuses whose attempts the poller queries: those the provider may still change, and
# ``created`` (a submitter that recorded the provider task id before its accept was applied).
POLLED_STATUSES: tuple[str, ...] = tuple(
    [str(s) for s, row in STATUS_TABLE.items() if row.provider_active] + [str(Status.CREATED)]
)


@dataclass(frozen=True, slots=True)
class Claimed:
    """One claimed attempt, as ``poll_claim`` returned it."""

    attempt_id: uuid.UUID
    task_id: uuid.UUID
    project_id: uuid.UUID
    status: Status
    provider: str
    provider_task_id: str
    provider_status: ProviderStatus | None
    last_seq: int | None
    failures: int
    unchanged: int
    token: uuid.UUID
    age_s: float
    lag_s: float
    scope: Scope

    @classmethod
    def of(cls, row: asyncpg.Record) -> Claimed:
        status = row["provider_status"]
        return cls(
            attempt_id=row["id"],
            task_id=row["task_id"],
            project_id=row["project_id"],
            status=Status(row["status"]),
            provider=row["provider"],
            provider_task_id=row["provider_task_id"],
            provider_status=ProviderStatus(status) if status is not None else None,
            last_seq=row["last_provider_seq"],
            failures=row["poll_failures"],
            unchanged=row["poll_unchanged"],
            token=row["poll_lease_token"],
            age_s=max(0.0, row["age_s"] or 0.0),
            lag_s=row["lag_s"] or 0.0,
            scope=Scope(row["provider"], row["model"], str(row["tenant_id"])),
        )


@dataclass(frozen=True, slots=True)
class PollRecord:
    """One query, for benchmarks and tests (``on_poll``). Times are ``time.time()``."""

    attempt_id: uuid.UUID
    replica: str
    sent_at: float
    answered_at: float
    outcome: Outcome
    delay_s: float | None
    """The interval the scheduler targeted for the next poll; None once polling stopped or
    when the lease had been lost."""
    nominal_s: float
    stretch: float
    lag_s: float


@dataclass(slots=True)
class PollerStats:
    claims: int = 0
    claimed: int = 0
    polls: int = 0
    released: int = 0
    stopped: int = 0
    statements: int = 0
    applied: int = 0
    skipped: int = 0
    leases_lost: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def teaches(row: Claimed, job: JobState) -> bool:
    """Did the query teach something the attempt had not recorded?"""
    if job.sequence is not None and row.last_seq is not None:
        return job.sequence > row.last_seq
    return job.status is not row.provider_status or job.sequence is not None
