"""The credit ledger: which entry a task status writes, and the writes themselves.

* **reserve** when the provider has accepted the attempt: the first of ``submitted``,
  ``provider_queued``, ``running``, ``provider_succeeded``, ``processing_media`` the consumer sees
  (normally ``submitted``; the others cover the paths that skip it, e.g. a webhook that arrives
  before the submit response). The amount comes from the price table at that moment.
* **settle** on ``ready``: exactly the reserved amount (a reservation is written first if the
  consumer never saw one, since ``ready`` proves the provider accepted the attempt).
* **refund** on ``failed`` or ``canceled``: exactly the reserved amount, and only if there is a
  reservation (a task that failed before the provider accepted it owes nothing: no-op).

Every entry is ``INSERT ... ON CONFLICT DO NOTHING`` on UNIQUE(task_id, attempt_id, ledger_type),
plus one closing entry (settle or refund) per attempt, so redelivered or replayed messages never
write twice. Order does not matter either: a reservation that arrives after its attempt already
ended (a redelivered ``submitted`` after ``failed`` was handled) is closed at once from the task
row, so no hold is left open forever.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import StrEnum

import asyncpg

from aivedio.billing.config import PriceTable
from aivedio.consumers import StatusEvent
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.statuses import Status


class LedgerType(StrEnum):
    RESERVE = "reserve"
    SETTLE = "settle"
    REFUND = "refund"


# Statuses that prove the provider accepted the attempt.
PROVIDER_ACCEPTED: frozenset[Status] = frozenset(
    {
        Status.SUBMITTED,
        Status.PROVIDER_QUEUED,
        Status.RUNNING,
        Status.PROVIDER_SUCCEEDED,
        Status.PROCESSING_MEDIA,
    }
)
_REFUNDED: frozenset[Status] = frozenset({Status.FAILED, Status.CANCELED})


def entry_for(status: str) -> LedgerType | None:
    """The ledger entry an event with this internal status asks for (pure)."""
    try:
        known = Status(status)
    except ValueError:
        return None
    if known in PROVIDER_ACCEPTED:
        return LedgerType.RESERVE
    if known is Status.READY:
        return LedgerType.SETTLE
    if known in _REFUNDED:
        return LedgerType.REFUND
    return None


def closing_for(task_status: str, attempt_is_current: bool) -> LedgerType | None:
    """How an attempt's reservation closes given where the task is now (pure). An attempt that
    is no longer current was replaced by a retry, which is allowed only after failed/canceled."""
    if not attempt_is_current:
        return LedgerType.REFUND
    entry = entry_for(task_status)
    return entry if entry is not LedgerType.RESERVE else None


@dataclass(frozen=True, slots=True)
class Written:
    ledger_type: LedgerType
    amount: int


@dataclass(frozen=True, slots=True)
class Recorded:
    written: list[Written]
    reserved: bool
    """The attempt's reservation exists now (written here or before): a later reserve-class
    event of the attempt can write nothing (``BillingConsumer`` skips it without a query)."""


async def record(conn: asyncpg.Connection, event: StatusEvent, prices: PriceTable) -> Recorded:
    """Write what ``event`` asks for inside the caller's transaction; return the new rows."""
    wanted = entry_for(event.status)
    if wanted is None or event.attempt_id is None:
        return Recorded([], False)
    attempt = await conn.fetchrow(q("billing_attempt"), event.attempt_id, event.task_id)
    if attempt is None:
        return Recorded([], False)
    written: list[Written] = []
    reserves = wanted in (LedgerType.RESERVE, LedgerType.SETTLE)
    if reserves:
        amount = prices.price(attempt["provider"], attempt["model"])
        row = await conn.fetchrow(
            q("insert_reserve"),
            event.tenant_id,
            event.project_id,
            event.task_id,
            event.attempt_id,
            amount,
            attempt["provider"],
            attempt["model"],
            event.version,
            event.trace_id,
        )
        if row is not None:
            written.append(Written(LedgerType.RESERVE, amount))
            if wanted is LedgerType.RESERVE:
                current = attempt["current_attempt_id"] == event.attempt_id
                wanted = closing_for(attempt["task_status"], current) or wanted
    if wanted is not LedgerType.RESERVE:
        row = await conn.fetchrow(
            q("insert_closing"),
            event.task_id,
            event.attempt_id,
            str(wanted),
            event.version,
            event.trace_id,
        )
        if row is not None:
            written.append(Written(wanted, row["amount"]))
    return Recorded(written, reserved=reserves)


@dataclass(frozen=True, slots=True)
class Balance:
    """One tenant's ledger totals (see the ``tenant_credit_balances`` view):
    ``held = reserved - settled - refunded`` is on hold for attempts in flight,
    ``spent = settled`` is what the tenant was charged."""

    tenant_id: uuid.UUID
    reserved: int
    settled: int
    refunded: int
    held: int
    spent: int
    entries: int


async def tenant_balance(db: Database, tenant_id: uuid.UUID) -> Balance:
    async with db.connection() as conn:
        row = await conn.fetchrow(q("tenant_balance"), tenant_id)
    if row is None:
        return Balance(tenant_id, 0, 0, 0, 0, 0, 0)
    return Balance(
        tenant_id=row["tenant_id"],
        reserved=row["reserved"],
        settled=row["settled"],
        refunded=row["refunded"],
        held=row["held"],
        spent=row["spent"],
        entries=row["entries"],
    )
