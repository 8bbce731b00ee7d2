"""Lock order and lock freshness of the writers of a task.

A writer that waited for a task's lock decides on the task AND the attempt as the lock's
previous holder committed them, never on an attempt read before the wait.

Found by ``aivedio chaos``: two inbox processors, one applying a provider's ``succeeded``
(sequence 4) while the other waited for the task row with a late ``running`` (sequence 3); the
waiter's attempt columns were the ones from before the wait, so ``running`` passed the sequence
check and its attempt change overwrote ``succeeded``.

Every writer takes the task row before the attempt row (an event updates its attempt), so the
submit response and a webhook of the same attempt never deadlock (also found by chaos: the
submitter recorded the provider task id on the attempt before it locked the task).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import Observation, ProviderObservation, ProviderStatus, Source
from aivedio.domain.transitions import Outcome, Reason
from aivedio.providers.port import SubmitResult
from aivedio.state.service import ApplyResult, StateService
from aivedio.submission.submitter import Claimed, Submitter
from tests.integration.helpers import make_project, make_task, store
from tests.waiting import eventually


def webhook(attempt: uuid.UUID, status: ProviderStatus, seq: int) -> Observation:
    return ProviderObservation(
        provider="sandbox",
        attempt_id=attempt,
        status=status,
        source=Source.WEBHOOK,
        provider_sequence=seq,
        progress=40 if status is ProviderStatus.RUNNING else None,
    )


async def waiting_for_a_lock(db: Database) -> bool:
    async with db.connection() as conn:
        return bool(
            await conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database())"
            )
        )


async def race(
    db: Database, late: Callable[[StateService, Observation], Awaitable[ApplyResult]]
) -> tuple[ApplyResult, str | None, int | None]:
    state = StateService(db)
    project = await make_project(db)
    _, attempt = await make_task(store(db, state), project)
    for seq, status in ((1, ProviderStatus.QUEUED), (2, ProviderStatus.RUNNING)):
        await state.apply(webhook(attempt, status, seq))
    async with db.transaction() as conn:
        await state.apply_in(conn, webhook(attempt, ProviderStatus.SUCCEEDED, 4))
        waiter = asyncio.create_task(late(state, webhook(attempt, ProviderStatus.RUNNING, 3)))
        await eventually(
            lambda: waiting_for_a_lock(db),
            "the late writer to wait for the task's lock",
            4,
            interval=0.01,
        )
    result = await waiter
    async with db.connection() as conn:
        row = await conn.fetchrow(
            "SELECT provider_status, last_provider_seq FROM task_attempts WHERE id = $1", attempt
        )
    assert row is not None
    return result, row["provider_status"], row["last_provider_seq"]


async def test_one_write_that_waited_sees_the_committed_attempt(db: Database) -> None:
    result, status, seq = await race(db, lambda state, obs: state.apply(obs))
    assert (result.outcome, result.reason) == (Outcome.IGNORED, Reason.AFTER_TERMINAL)
    assert (status, seq) == ("succeeded", 4)


async def test_a_batch_that_waited_sees_the_committed_attempt(db: Database) -> None:
    async def batch(state: StateService, obs: Observation) -> ApplyResult:
        (result,) = await state.apply_many([obs])
        return result

    result, status, seq = await race(db, batch)
    assert (result.outcome, result.reason) == (Outcome.IGNORED, Reason.AFTER_TERMINAL)
    assert (status, seq) == ("succeeded", 4)


async def test_a_submit_response_and_a_webhook_of_one_attempt_do_not_deadlock(
    db: Database,
) -> None:
    state = StateService(db)
    project = await make_project(db)
    task_id, attempt = await make_task(store(db, state), project)
    async with db.connection() as conn:
        crid = await conn.fetchval(
            "SELECT client_request_id FROM task_attempts WHERE id = $1", attempt
        )
    submitter = Submitter(db, state, {})
    claimed = Claimed(
        attempt_id=attempt,
        task_id=task_id,
        tries=1,
        maybe_sent=False,
        previous_state="pending",
        provider="sandbox",
        model="m1",
        client_request_id=crid,
        prompt="a cat",
        params={},
        trace_id=None,
        token=uuid.uuid4(),
    )
    # The webhook's transaction, as the inbox processor runs it: the task first ...
    async with db.transaction() as conn:
        await conn.execute(q("lock_task_for_attempt"), attempt)
        response = asyncio.create_task(
            submitter._accepted(claimed, SubmitResult(provider_task_id="gen_dl"))
        )
        await eventually(
            lambda: waiting_for_a_lock(db),
            "the submit response to wait for the task's lock",
            4,
            interval=0.01,
        )
        # ... then its event, which updates the attempt row
        await state.apply_in(conn, webhook(attempt, ProviderStatus.QUEUED, 1))
    await response  # a deadlock would have failed one of the two
    async with db.connection() as conn:
        row = await conn.fetchrow(
            "SELECT provider_task_id, provider_status FROM task_attempts WHERE id = $1", attempt
        )
    assert row is not None
    assert (row["provider_task_id"], row["provider_status"]) == ("gen_dl", "queued")
