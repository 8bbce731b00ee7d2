"""One callback as the inbox stores it (:class:`InboxRow`), what became of it (:class:`Outcome`),
the errors of the inbox writer, and the row as the inbox processor reads it back
(:func:`handed_row`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

import orjson

from aivedio.db.handoff import HandedRow
from aivedio.errors import AivedioError

__all__ = [
    "InboxClosed",
    "InboxError",
    "InboxFull",
    "InboxRow",
    "Outcome",
    "check_row",
    "handed_row",
]


class Outcome(StrEnum):
    NEW = "new"
    """The row was inserted and committed by this batch."""
    DUPLICATE = "duplicate"
    """A row with this (provider, dedup_key) was already committed; nothing changed."""


class InboxError(AivedioError):
    """The database refused this row (not an outage): the gateway answers 500."""


class InboxFull(AivedioError):
    """The queue is at its bound: the gateway answers 503 at once rather than queue further."""


class InboxClosed(AivedioError):
    """The writer is shutting down and takes no more rows (503)."""


@dataclass(slots=True, kw_only=True)
class InboxRow:
    """One callback as stored. ``payload_json`` is the minimized payload, already serialized as
    one JSON document (the gateway's parse guarantees it; the batch splices it in as is).
    (Not frozen: a frozen dataclass's ``__init__`` costs 2x, once per callback; never changed
    after it is built all the same.)"""

    provider: str
    dedup_key: str
    payload_hash: bytes
    payload_json: str | None
    received_at: datetime
    provider_event_id: str | None = None
    provider_task_id: str | None = None
    client_request_id: str | None = None
    provider_occurred_at: datetime | None = None
    signature_key_version: str | None = None
    event_type: str | None = None
    attempt_id: str | None = None
    payload_authenticated: bool = True
    trace_id: str | None = None


def _utc(at: datetime | None) -> datetime | None:
    """As PostgreSQL gives a timestamptz back: aware (a naive one is UTC, as the batch sent it)."""
    return at.replace(tzinfo=UTC) if at is not None and at.tzinfo is None else at


def handed_row(row: InboxRow, inbox_id: int) -> HandedRow:
    """A stored row as the inbox processor's claim would have returned it (``inbox_claim``)."""
    return {
        "id": inbox_id,
        "provider": row.provider,
        "dedup_key": row.dedup_key,
        "provider_event_id": row.provider_event_id,
        "provider_task_id": row.provider_task_id,
        "client_request_id": row.client_request_id,
        "provider_occurred_at": _utc(row.provider_occurred_at),
        "received_at": _utc(row.received_at),
        "payload": None if row.payload_json is None else orjson.loads(row.payload_json),
        "process_status": "pending",
        "retry_count": 0,
        "event_type": row.event_type,
        "attempt_id": row.attempt_id,
        "payload_authenticated": row.payload_authenticated,
        "trace_id": row.trace_id,
    }


_UNENCODABLE = re.compile(r"[\x00\ud800-\udfff]")


def check_row(row: InboxRow) -> None:
    """Refuse, alone, a row the driver could not even send (NUL, lone surrogates): such a row
    must never reach a batch, where its encoding error would fail every other row with it."""
    text = "".join(
        (
            row.provider,
            row.dedup_key,
            row.payload_json or "",
            row.provider_event_id or "",
            row.provider_task_id or "",
            row.client_request_id or "",
            row.signature_key_version or "",
            row.trace_id or "",
            row.event_type or "",
            row.attempt_id or "",
        )
    )
    if text.isascii() and "\x00" not in text:  # the common case: two scans, no regex
        return
    if _UNENCODABLE.search(text):
        raise InboxError("the callback holds text PostgreSQL cannot store")
