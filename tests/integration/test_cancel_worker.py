"""The cancel worker against real PostgreSQL and the real sandbox provider over HTTP."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from aivedio.db.pool import Database
from aivedio.errors import DatabaseUnavailable
from aivedio.providers.sandbox import SandboxAdapter
from aivedio.state.service import StateService
from aivedio.state.tasks import TaskStore
from aivedio.submission.cancel import CancelWorker
from aivedio.submission.config import CancelConfig, SubmitterConfig
from aivedio.submission.submitter import Submitter
from tests.integration.helpers import (
    CutAfter,
    Project,
    database_behind_a_proxy,
    make_project,
    make_task,
    store,
)
from tests.integration.sandbox_harness import (
    LONG,
    QUICK,
    Sandbox,
    make_due,
    running_sandbox,
    task_row,
)
from tests.waiting import eventually


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    async with running_sandbox() as running:
        yield running


@pytest.fixture
async def adapter(sandbox: Sandbox) -> AsyncIterator[SandboxAdapter]:
    made = sandbox.adapter()
    yield made
    await made.aclose()


@pytest.fixture
async def project(db: Database) -> Project:
    return await make_project(db)


def workers(db: Database, adapter: SandboxAdapter) -> tuple[TaskStore, Submitter, CancelWorker]:
    state = StateService(db)
    adapters = {"sandbox": adapter}
    return (
        store(db, state),
        Submitter(db, state, adapters, SubmitterConfig()),
        CancelWorker(db, state, adapters, CancelConfig(wait_submit_s=0.01)),
    )


async def cancel(tasks: TaskStore, project: Project, task_id: uuid.UUID) -> str:
    snapshot = await tasks.cancel(project.principal, project.project_id, task_id, None)
    return str(snapshot["status"])


async def cancel_intent(db: Database, task_id: uuid.UUID) -> dict[str, object]:
    async with db.connection() as conn:
        row = await conn.fetchrow("SELECT * FROM cancel_intents WHERE task_id = $1", task_id)
    assert row is not None
    return dict(row)


async def test_cancel_before_submit_cancels_locally_without_calling_the_provider(
    db: Database, project: Project, sandbox: Sandbox, adapter: SandboxAdapter
) -> None:
    tasks, submitter, canceler = workers(db, adapter)
    task_id, _ = await make_task(tasks, project, params={"sandbox": LONG})
    assert await cancel(tasks, project, task_id) == "cancel_requested"
    assert (await cancel_intent(db, task_id))["state"] == "pending"
    assert await canceler.run_once() == 1
    row = await task_row(db, task_id)
    assert (row["status"], row["intent_state"]) == ("canceled", "canceled")
    assert (await cancel_intent(db, task_id))["result"] == "local"
    await make_due(db)
    assert await submitter.run_once() == 0  # the taken-back intent is never sent
    stats = await sandbox.stats()
    assert stats["generations"]["create_requests"] == 0
    assert stats["requests"].get("cancel", 0) == 0


async def test_cancel_of_a_running_job_calls_the_provider_and_its_confirmation_cancels(
    db: Database, project: Project, sandbox: Sandbox, adapter: SandboxAdapter
) -> None:
    tasks, submitter, canceler = workers(db, adapter)
    task_id, _ = await make_task(tasks, project, params={"sandbox": LONG})
    await submitter.run_once()
    row = await task_row(db, task_id)
    assert row["status"] == "submitted"
    assert await cancel(tasks, project, task_id) == "cancel_requested"
    assert await canceler.run_once() == 1
    row = await task_row(db, task_id)
    assert row["status"] == "canceled"
    assert (await cancel_intent(db, task_id))["result"] == "accepted"
    generation = await sandbox.generation(str(row["provider_task_id"]))
    assert generation["status"] == "canceled"
    stats = await sandbox.stats()
    assert stats["requests"]["cancel"] == 1
    assert stats["generations"]["created"] == 1


async def test_success_reported_first_wins_over_the_cancel(
    db: Database, project: Project, sandbox: Sandbox, adapter: SandboxAdapter
) -> None:
    tasks, submitter, canceler = workers(db, adapter)
    task_id, _ = await make_task(tasks, project, params={"sandbox": QUICK})
    await submitter.run_once()
    provider_task_id = str((await task_row(db, task_id))["provider_task_id"])

    async def succeeded() -> bool:
        return bool((await sandbox.generation(provider_task_id))["status"] == "succeeded")

    await eventually(succeeded, what="the provider's success")
    assert await cancel(tasks, project, task_id) == "cancel_requested"  # we did not know yet
    await canceler.run_once()
    row = await task_row(db, task_id)
    assert row["status"] == "provider_succeeded"
    assert (await cancel_intent(db, task_id))["result"] == "already_terminal"


async def test_cancel_waits_while_the_submit_is_in_flight(
    db: Database, project: Project, sandbox: Sandbox, adapter: SandboxAdapter
) -> None:
    tasks, _, canceler = workers(db, adapter)
    task_id, attempt_id = await make_task(tasks, project, params={"sandbox": LONG})
    async with db.connection() as conn:  # a submitter holds the intent right now
        await conn.execute(
            "UPDATE submit_intents SET state = 'sending', lease_until = now() + interval '1 h',"
            " lease_token = $2 WHERE attempt_id = $1",
            attempt_id,
            uuid.uuid4(),
        )
    await cancel(tasks, project, task_id)
    await canceler.run_once()
    intent = await cancel_intent(db, task_id)
    assert (intent["state"], intent["last_error_code"]) == ("pending", "submit_sending")
    assert (await task_row(db, task_id))["status"] == "cancel_requested"


async def test_a_cancel_the_database_kept_from_being_recorded_is_sent_again_once_it_is_back(
    db: Database, database_url: str, project: Project, sandbox: Sandbox, adapter: SandboxAdapter
) -> None:
    tasks, submitter, _ = workers(db, adapter)
    task_id, _ = await make_task(tasks, project, params={"sandbox": LONG})
    await submitter.run_once()
    assert await cancel(tasks, project, task_id) == "cancel_requested"
    async with database_behind_a_proxy(database_url) as (proxy, cut_db):
        cutting = CutAfter(adapter, "cancel", proxy)
        config = CancelConfig(wait_submit_s=0.01, lease_s=600)
        canceler = CancelWorker(cut_db, StateService(cut_db), {"sandbox": cutting}, config)  # type: ignore[dict-item]
        with pytest.raises(DatabaseUnavailable):
            await canceler.run_once()
        assert (await cancel_intent(db, task_id))["state"] == "sending"
        await proxy.start()  # back: the lease ends now, not in ten minutes
        assert await canceler.run_once() == 1
        assert len(canceler.left) == 0
    assert (await task_row(db, task_id))["status"] == "canceled"
    assert (await cancel_intent(db, task_id))["state"] == "done"
    assert (await sandbox.stats())["requests"]["cancel"] == 2  # a cancel is idempotent
