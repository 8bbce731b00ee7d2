"""The submitter against real PostgreSQL and the real sandbox provider over HTTP.

The invariant under every fault: exactly one generation per attempt at the provider
(``/_sandbox/stats`` ``generations.created``), and a second attempt only by an audited resubmit.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta

import httpx
import pytest

from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.errors import DatabaseUnavailable
from aivedio.providers.http import HttpConfig
from aivedio.providers.port import ProviderAdapter
from aivedio.reconcile.config import ReconcilerConfig
from aivedio.reconcile.reconciler import Reconciler
from aivedio.state.service import StateService
from aivedio.submission.config import SubmitterConfig
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
    FaultyCreates,
    NoKeySandbox,
    Sandbox,
    make_due,
    running_sandbox,
    task_row,
)
from tests.waiting import eventually

FAST = SubmitterConfig(backoff_base_s=0.01, backoff_cap_s=0.05, auth_backoff_s=300)


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    async with running_sandbox(submit_hold_s=1.5) as running:
        yield running


@pytest.fixture
async def project(db: Database) -> Project:
    return await make_project(db)


def submitter(db: Database, adapter: ProviderAdapter, config: SubmitterConfig = FAST) -> Submitter:
    return Submitter(db, StateService(db), {"sandbox": adapter}, config)


async def new_task(db: Database, project: Project, **params: object) -> uuid.UUID:
    task_id, _ = await make_task(store(db), project, params={"sandbox": params or LONG})
    return task_id


async def submit_until(
    db: Database, worker: Submitter, task_id: uuid.UUID, states: set[str]
) -> dict[str, object]:
    seen: dict[str, object] = {}

    async def done() -> bool:
        await make_due(db)
        await worker.run_once()
        seen.update(await task_row(db, task_id))
        return seen["intent_state"] in states

    await eventually(done, what=f"intent in {states}")
    return seen


async def test_creation_writes_a_pending_intent_in_the_same_transaction(
    db: Database, project: Project
) -> None:
    task_id = await new_task(db, project)
    row = await task_row(db, task_id)
    assert (row["status"], row["intent_state"], row["tries"]) == ("created", "pending", 0)


async def test_submits_once_and_records_the_provider_task_id(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    task_id = await new_task(db, project)
    adapter = sandbox.adapter()
    try:
        assert await submitter(db, adapter).run_once() == 1
        assert await submitter(db, adapter).run_once() == 0  # nothing left to send
    finally:
        await adapter.aclose()
    row = await task_row(db, task_id)
    assert (row["status"], row["intent_state"]) == ("submitted", "accepted")
    assert row["provider_task_id"]
    assert row["next_poll_at"] is not None
    generation = await sandbox.generation(str(row["provider_task_id"]))
    assert generation["metadata"]["client_request_id"] == row["client_request_id"]
    stats = await sandbox.stats()
    assert stats["generations"]["created"] == 1
    assert stats["generations"]["create_requests"] == 1


async def test_timeout_after_accept_is_retried_with_the_same_key_one_generation(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    task_id = await new_task(db, project)
    await sandbox.chaos(submit_timeout_after_accept=True)
    adapter = sandbox.adapter(http=HttpConfig(create_read_timeout_s=0.3))
    try:
        worker = submitter(db, adapter)
        await worker.run_once()
        row = await task_row(db, task_id)
        assert (row["status"], row["intent_state"], row["maybe_sent"]) == (
            "created",
            "pending",
            True,
        )
        assert row["last_error_code"] == "outcome_unknown"
        await sandbox.chaos(submit_timeout_after_accept=False)
        row = await submit_until(db, worker, task_id, {"accepted"})
    finally:
        await adapter.aclose()
    assert row["status"] == "submitted"
    stats = await sandbox.stats()
    assert stats["generations"]["created"] == 1
    assert stats["generations"]["idempotent_replays"] >= 1
    assert stats["chaos"]["submit_timeout_after_accept"] == 1


async def test_without_key_trust_an_unknown_submit_is_never_resent_and_lookup_maps_it(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    task_id = await new_task(db, project)
    await sandbox.chaos(submit_timeout_after_accept=True)
    adapter = sandbox.adapter(NoKeySandbox, http=HttpConfig(create_read_timeout_s=0.3))
    try:
        worker = submitter(db, adapter)
        await worker.run_once()
        row = await task_row(db, task_id)
        assert (row["status"], row["intent_state"]) == ("submit_unknown", "unknown")
        await make_due(db)
        assert await worker.run_once() == 0  # never sent again
        reconciler = Reconciler(db, StateService(db), {"sandbox": adapter}, ReconcilerConfig())
        assert await reconciler.sweep_unknown_submits() == 1
    finally:
        await adapter.aclose()
    row = await task_row(db, task_id)
    assert (row["status"], row["intent_state"]) == ("submitted", "accepted")
    assert row["provider_task_id"]
    stats = await sandbox.stats()
    assert stats["generations"]["created"] == 1
    assert stats["generations"]["create_requests"] == 1


@pytest.mark.parametrize("faults", [[503], [429], [502, 429, 500]])
async def test_5xx_and_429_on_create_are_retried_with_one_generation(
    db: Database, project: Project, sandbox: Sandbox, faults: list[int]
) -> None:
    task_id = await new_task(db, project)
    client = httpx.AsyncClient(transport=FaultyCreates(faults), trust_env=False)
    adapter = sandbox.adapter(client=client)
    try:
        row = await submit_until(db, submitter(db, adapter), task_id, {"accepted"})
    finally:
        await client.aclose()
    assert row["status"] == "submitted"
    assert row["tries"] == len(faults) + 1
    stats = await sandbox.stats()
    assert stats["generations"]["created"] == 1


async def test_5xx_without_key_trust_is_an_unknown_outcome(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    task_id = await new_task(db, project)
    client = httpx.AsyncClient(transport=FaultyCreates([500]), trust_env=False)
    adapter = sandbox.adapter(NoKeySandbox, client=client)
    try:
        await submitter(db, adapter).run_once()
    finally:
        await client.aclose()
    row = await task_row(db, task_id)
    assert (row["status"], row["intent_state"]) == ("submit_unknown", "unknown")


async def test_rejected_create_fails_the_task_with_the_public_code(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    task_id = await new_task(db, project, no_such_field=1)
    adapter = sandbox.adapter()
    try:
        await submitter(db, adapter).run_once()
    finally:
        await adapter.aclose()
    row = await task_row(db, task_id)
    assert (row["status"], row["error_code"], row["intent_state"]) == (
        "failed",
        "invalid_request",
        "rejected",
    )
    assert (await sandbox.stats())["generations"]["created"] == 0


async def test_auth_failure_is_not_retried_hot(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    task_id = await new_task(db, project)
    adapter = sandbox.adapter(api_key="wrong")
    try:
        worker = submitter(db, adapter)
        await worker.run_once()
        assert await worker.run_once() == 0
    finally:
        await adapter.aclose()
    row = await task_row(db, task_id)
    assert (row["status"], row["intent_state"], row["last_error_code"]) == (
        "created",
        "pending",
        "auth_failed",
    )
    async with db.connection() as conn:
        wait = await conn.fetchval(
            "SELECT next_attempt_at - now() FROM submit_intents WHERE task_id = $1", task_id
        )
    assert wait > timedelta(seconds=200)
    assert (await sandbox.stats())["generations"]["created"] == 0


async def test_two_replicas_never_submit_one_intent_twice(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    tasks = [await new_task(db, project) for _ in range(24)]
    adapters = [sandbox.adapter(), sandbox.adapter()]
    config = SubmitterConfig(batch_size=5)
    replicas = [submitter(db, a, config) for a in adapters]

    async def all_accepted() -> bool:
        await asyncio.gather(*(r.run_once() for r in replicas))
        async with db.connection() as conn:
            left = await conn.fetchval(
                "SELECT count(*) FROM submit_intents WHERE state <> 'accepted'"
            )
        return bool(left == 0)

    try:
        await eventually(all_accepted, what="every intent accepted")
    finally:
        for adapter in adapters:
            await adapter.aclose()
    stats = await sandbox.stats()
    assert stats["generations"]["created"] == len(tasks)
    assert stats["generations"]["create_requests"] == len(tasks)  # not one sent twice
    for task_id in tasks:
        assert (await task_row(db, task_id))["status"] == "submitted"


async def test_a_callback_before_the_submit_response_keeps_the_provider_task_id(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    task_id = await new_task(db, project)
    attempt_id = (await task_row(db, task_id))["current_attempt_id"]
    state = StateService(db)

    async def callback_first(response: httpx.Response) -> None:
        # What the inbox processor does with a callback mapped by client_request_id.
        generation_id = response.json()["id"]
        await state.apply(
            ProviderObservation(
                provider="sandbox",
                attempt_id=attempt_id,
                status=ProviderStatus.RUNNING,
                source=Source.WEBHOOK,
                provider_task_id=generation_id,
                provider_sequence=2,
                progress=0,
            )
        )

    client = httpx.AsyncClient(transport=FaultyCreates([], callback_first), trust_env=False)
    adapter = sandbox.adapter(client=client)
    try:
        await submitter(db, adapter).run_once()
    finally:
        await client.aclose()
    row = await task_row(db, task_id)
    assert (row["status"], row["intent_state"]) == ("running", "accepted")
    assert row["provider_task_id"]
    async with db.connection() as conn:
        reasons = await conn.fetch(
            "SELECT reason FROM observation_audit WHERE task_id = $1 AND source = 'submit'",
            task_id,
        )
    assert [r["reason"] for r in reasons] == ["no_change"]


async def test_an_outcome_the_database_kept_from_being_written_is_settled_once_it_is_back(
    db: Database, database_url: str, project: Project, sandbox: Sandbox
) -> None:
    task_id = await new_task(db, project)
    adapter = sandbox.adapter()
    try:
        async with database_behind_a_proxy(database_url) as (proxy, cut_db):
            cutting = CutAfter(adapter, "submit", proxy)
            worker = submitter(cut_db, cutting, replace(FAST, lease_s=600))  # type: ignore[arg-type]
            with pytest.raises(DatabaseUnavailable):
                await worker.run_once()
            row = await task_row(db, task_id)
            assert (row["intent_state"], row["status"]) == ("sending", "created")
            await proxy.start()  # back: the intent's lease ends now, not in ten minutes
            assert await worker.run_once() == 1
            assert len(worker.left) == 0
    finally:
        await adapter.aclose()
    row = await task_row(db, task_id)  # claimed as lapsed mid-send: the same key again
    assert (row["status"], row["intent_state"], row["tries"]) == ("submitted", "accepted", 2)
    stats = await sandbox.stats()
    assert stats["generations"]["created"] == 1
    assert stats["generations"]["create_requests"] == 2
