"""What a claimed inbox row becomes on its way to the state service, outside any transaction.

A row is normalized by its adapter (:class:`Normalized`), mapped to its attempt with the one
statement of its claim (:class:`Attempts`), re-fetched from the provider when its body is only a
hint (:func:`refetch`), and then :class:`Ready` to apply: :func:`take_claimed` is the first
statement of the transaction that applies ready rows. A row that cannot go on now raises
:class:`Defer` (see :mod:`aivedio.ingest.retries` for what becomes of it).
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
from prometheus_client import Counter

from aivedio.db.handoff import HandedRow
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.db.wakeup import Signal
from aivedio.domain.observation import ProviderObservation
from aivedio.providers.port import (
    InboxFields,
    JobState,
    MalformedResponse,
    NotFoundYet,
    ProviderAdapter,
    ProviderError,
    RateLimited,
)

__all__ = [
    "Attempt",
    "Attempts",
    "Defer",
    "InboxRecord",
    "Normalized",
    "Ready",
    "fields_of",
    "refetch",
]

InboxRecord = asyncpg.Record | HandedRow
"""A row to process: as ``inbox_claim`` returned it, or as the group commit handed it over."""

REFETCHES = Counter(
    "aivedio_inbox_refetches_total",
    "Provider queries made for unsigned callbacks before applying them, by result",
    ["provider", "result"],
)


@dataclass(frozen=True, slots=True)
class Attempt:
    id: uuid.UUID
    client_request_id: str
    provider_task_id: str | None
    project_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class Normalized:
    """A claimed row as its adapter read it, not mapped yet."""

    row: InboxRecord
    adapter: ProviderAdapter
    fields: InboxFields
    claimed: JobState
    started: float  # perf_counter at the start of its processing

    @property
    def task_id(self) -> str | None:
        return self.claimed.provider_task_id or self.fields.provider_task_id

    @property
    def request_id(self) -> str | None:
        return self.claimed.client_request_id or self.fields.client_request_id


class Attempts:
    """The attempts the rows of one claim may belong to, read with one statement; ``resolve``
    maps a row: the attempt id a callback token authenticated, else ``(provider,
    provider_task_id)``, else ``(provider, client_request_id)`` (a callback before the submit
    response; refused if the attempt already has another provider task id)."""

    def __init__(self, rows: list[asyncpg.Record]) -> None:
        self.by_id = {r["id"]: r for r in rows}
        self.by_task = {(r["provider"], r["provider_task_id"]): r for r in rows}
        self.by_request = {(r["provider"], r["client_request_id"]): r for r in rows}

    @classmethod
    async def read(cls, db: Database, items: list[Normalized]) -> Attempts:
        ids: list[uuid.UUID] = []
        tasks: list[tuple[str, str]] = []
        requests: list[tuple[str, str]] = []
        for item in items:
            provider = item.fields.provider
            if item.fields.attempt_id is not None:
                with contextlib.suppress(ValueError):  # resolve() refuses it
                    ids.append(uuid.UUID(item.fields.attempt_id))
            if item.task_id is not None:
                tasks.append((provider, item.task_id))
            if item.request_id is not None:
                requests.append((provider, item.request_id))
        async with db.connection() as conn:
            rows = await conn.fetch(
                q("attempts_for_callbacks"),
                ids,
                [p for p, _ in tasks],
                [t for _, t in tasks],
                [p for p, _ in requests],
                [r for _, r in requests],
            )
        return cls(rows)

    def resolve(self, fields: InboxFields, claimed: JobState) -> Attempt:
        provider = fields.provider
        task_id = claimed.provider_task_id or fields.provider_task_id
        request_id = claimed.client_request_id or fields.client_request_id
        found = None
        if fields.attempt_id is not None:
            try:
                attempt_id = uuid.UUID(fields.attempt_id)
            except ValueError:
                raise Defer("parse", "bad_attempt_id") from None
            found = self.by_id.get(attempt_id)
            if found is None or found["provider"] != provider:
                raise Defer("orphan", "unknown_attempt")
        if found is None and task_id is not None:
            found = self.by_task.get((provider, task_id))
        if found is None and request_id is not None:
            found = self.by_request.get((provider, request_id))
            if found is not None and found["provider_task_id"] not in (None, task_id):
                raise Defer("orphan", "task_id_mismatch")
        if found is None:
            raise Defer("orphan", "unmapped")
        return Attempt(
            found["id"], found["client_request_id"], found["provider_task_id"], found["project_id"]
        )


@dataclass(frozen=True, slots=True)
class Ready:
    """A claimed row, prepared outside any transaction: what to apply, and where."""

    row: InboxRecord
    adapter: ProviderAdapter
    attempt: Attempt
    state: JobState
    obs: ProviderObservation
    started: float  # perf_counter at the start of its processing

    @property
    def teaches_task_id(self) -> bool:
        """The callback taught the attempt its provider task id (it came before the submit
        response)."""
        return self.attempt.provider_task_id is None and self.state.provider_task_id is not None


async def take_claimed(
    conn: asyncpg.Connection,
    group: Sequence[Ready],
    token: uuid.UUID,
    applied: Signal | None = None,
) -> list[asyncpg.Record]:
    """In the apply transaction: the rows of ``group`` still leased under ``token`` marked
    processed, and the tasks of their attempts locked (``inbox_take_claimed``), so the state
    service applies them with ``locked=True``. The rows taken, as records with an ``id``.
    ``applied``: the signal fired after the commit; while an outbox relay of this process
    listens to it, the transaction's outbox rows notify no relay (migration 0018)."""
    kicked = applied is not None and applied.subscribed
    return await conn.fetch(
        q("inbox_take_claimed"),
        [ready.row["id"] for ready in group],
        token,
        [ready.attempt.id for ready in group],
        "on" if kicked else "off",
    )


class Defer(Exception):
    """Control flow: the row is not processed now (orphan or retry)."""

    def __init__(
        self,
        kind: str,
        code: str,
        sample: str | None = None,
        min_delay_s: float | None = None,
    ) -> None:
        super().__init__(code)
        self.kind = kind  # "orphan" | "parse" | "refetch"
        self.code = code
        self.sample = sample
        self.min_delay_s = min_delay_s


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def fields_of(row: InboxRecord) -> InboxFields:
    return InboxFields(
        provider=row["provider"],
        dedup_key=row["dedup_key"],
        provider_event_id=row["provider_event_id"],
        provider_task_id=row["provider_task_id"],
        client_request_id=row["client_request_id"],
        provider_occurred_at=row["provider_occurred_at"],
        event_type=row["event_type"],
        attempt_id=row["attempt_id"],
        payload_authenticated=row["payload_authenticated"],
        received_at=row["received_at"],
    )


async def refetch(adapter: ProviderAdapter, attempt: Attempt, claimed: JobState) -> JobState:
    """The provider's own answer for the job, instead of the unauthenticated body."""
    task_id = attempt.provider_task_id or claimed.provider_task_id
    if task_id is None:
        raise Defer("orphan", "no_task_id")
    try:
        state = await adapter.query(task_id)
    except RateLimited as exc:
        REFETCHES.labels(adapter.name, "rate_limited").inc()
        raise Defer("refetch", "refetch_rate_limited", min_delay_s=exc.retry_after_s) from None
    except NotFoundYet:
        REFETCHES.labels(adapter.name, "not_found").inc()
        raise Defer("refetch", "refetch_not_found") from None
    except MalformedResponse as exc:
        REFETCHES.labels(adapter.name, "malformed").inc()
        raise Defer("refetch", "refetch_malformed", exc.sample) from None
    except ProviderError as exc:
        reason = snake(type(exc).__name__)
        REFETCHES.labels(adapter.name, reason).inc()
        raise Defer("refetch", f"refetch_{reason}") from None
    REFETCHES.labels(adapter.name, "ok").inc()
    if attempt.provider_task_id is None and (
        state.client_request_id is None or state.client_request_id != attempt.client_request_id
    ):
        # We only had the body's word for the job id: it must be the attempt's own job.
        raise Defer("orphan", "refetch_unconfirmed")
    return JobState(
        provider_task_id=state.provider_task_id or task_id,
        status=state.status,
        client_request_id=state.client_request_id,
        progress=state.progress,
        sequence=state.sequence,
        occurred_at=state.occurred_at,
        error_code=state.error_code,
        output_ref=state.output_ref,
    )
