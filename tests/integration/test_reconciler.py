"""The reconciler, the reconciliation queue and the audited resubmit, on real PostgreSQL and the
real sandbox provider over HTTP."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import timedelta

import pytest

from aivedio.db.pool import Database
from aivedio.errors import Conflict, NotFound
from aivedio.providers.http import HttpConfig
from aivedio.providers.port import ProviderAdapter
from aivedio.reconcile.config import ReconcilerConfig
from aivedio.reconcile.items import list_items, resolve_item
from aivedio.reconcile.reconciler import Reconciler
from aivedio.state.service import StateService
from aivedio.submission.config import SubmitterConfig
from aivedio.submission.resubmit import resubmit
from aivedio.submission.submitter import Submitter
from tests.integration.helpers import Project, make_project, make_task, store
from tests.integration.sandbox_harness import (
    LONG,
    QUICK,
    NoLookupSandbox,
    Sandbox,
    make_due,
    running_sandbox,
    task_row,
)
from tests.waiting import eventually

NOW = ReconcilerConfig(expected_max_duration_s=0, lookup_grace_s=0, check_interval_s=3600)


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    async with running_sandbox(submit_hold_s=1.5) as running:
        yield running


@pytest.fixture
async def project(db: Database) -> Project:
    return await make_project(db)


def reconciler(
    db: Database, adapter: ProviderAdapter, config: ReconcilerConfig = NOW
) -> Reconciler:
    return Reconciler(db, StateService(db), {"sandbox": adapter}, config)


async def submitted_task(
    db: Database, project: Project, adapter: ProviderAdapter, script: Mapping[str, object]
) -> uuid.UUID:
    task_id, _ = await make_task(store(db), project, params={"sandbox": script})
    await Submitter(db, StateService(db), {"sandbox": adapter}, SubmitterConfig()).run_once()
    return task_id


async def unknown_task(db: Database, project: Project, sandbox: Sandbox) -> uuid.UUID:
    """A task whose submit timed out after the provider accepted it, through an adapter that
    can neither trust keys nor look jobs up: only an operator can decide."""
    await sandbox.chaos(submit_timeout_after_accept=True)
    adapter = sandbox.adapter(NoLookupSandbox, http=HttpConfig(create_read_timeout_s=0.3))
    try:
        task_id = await submitted_task(db, project, adapter, LONG)
    finally:
        await adapter.aclose()
    await sandbox.chaos(submit_timeout_after_accept=False)
    assert (await task_row(db, task_id))["status"] == "submit_unknown"
    return task_id


async def test_an_overdue_attempt_is_queried_and_moved_to_its_true_state(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    adapter = sandbox.adapter()
    try:
        task_id = await submitted_task(db, project, adapter, QUICK)
        provider_task_id = str((await task_row(db, task_id))["provider_task_id"])

        async def succeeded() -> bool:
            return bool((await sandbox.generation(provider_task_id))["status"] == "succeeded")

        await eventually(succeeded, what="the provider's success")
        assert (await task_row(db, task_id))["status"] == "submitted"  # no webhook, no poller
        patient = reconciler(db, adapter, ReconcilerConfig(expected_max_duration_s=3600))
        assert await patient.sweep_overdue() == 0  # not overdue yet
        assert await reconciler(db, adapter).sweep_overdue() == 1
        assert await reconciler(db, adapter).sweep_overdue() == 0  # once per check interval
    finally:
        await adapter.aclose()
    assert (await task_row(db, task_id))["status"] == "provider_succeeded"
    async with db.connection() as conn:
        source = await conn.fetchval(
            "SELECT source FROM task_events WHERE task_id = $1 ORDER BY task_version DESC LIMIT 1",
            task_id,
        )
    assert source == "reconcile"
    stats = await sandbox.stats()
    assert stats["generations"]["created"] == 1  # queried, never regenerated


async def test_per_model_max_duration_overrides_the_default(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    adapter = sandbox.adapter()
    try:
        await submitted_task(db, project, adapter, LONG)
        slow_model = ReconcilerConfig(expected_max_duration_s=0, max_durations={"sandbox/m1": 3600})
        assert await reconciler(db, adapter, slow_model).sweep_overdue() == 0
        assert await reconciler(db, adapter).sweep_overdue() == 1
    finally:
        await adapter.aclose()


async def test_an_unknown_submit_not_found_becomes_an_item_and_resubmit_is_audited(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    task_id = await unknown_task(db, project, sandbox)
    adapter = sandbox.adapter(NoLookupSandbox)
    try:
        assert await reconciler(db, adapter).sweep_unknown_submits() == 1
        [item] = await list_items(db, "open")
        assert (item["kind"], item["task_id"], item["task_status"]) == (
            "submit_unknown",
            str(task_id),
            "submit_unknown",
        )
        before = await task_row(db, task_id)
        done = await resubmit(db, task_id, "provider support confirmed no job", "alice")
        after = await task_row(db, task_id)
        assert (after["status"], after["attempt_no"], after["intent_state"]) == (
            "created",
            2,
            "pending",
        )
        assert after["version"] == before["version"] + 1
        async with db.connection() as conn:  # submit_unknown -> created: the same public face
            published = await conn.fetchval(
                "SELECT count(*) FROM task_events WHERE task_id = $1 AND task_version = $2",
                task_id,
                after["version"],
            )
            audited = await conn.fetchrow(
                "SELECT outcome, reason, observed FROM observation_audit"
                " WHERE task_id = $1 AND task_version = $2",
                task_id,
                after["version"],
            )
        assert published == 0
        assert tuple(audited.values()) == ("applied", "no_public_change", "resubmit")
        assert after["reason"] == "resubmit by alice: provider support confirmed no job"
        assert after["client_request_id"] != before["client_request_id"]
        assert done.resolved_items == (item["id"],)
        assert await list_items(db, "open") == []
        resolved = {i["kind"]: i for i in await list_items(db, "resolved")}
        assert resolved["submit_unknown"]["resolved_by"] == "alice"
        assert resolved["resubmit"]["detail"]["reason"] == "provider support confirmed no job"
        # The compensation is the one way to a second generation, and it is sent once.
        await make_due(db)
        await Submitter(db, StateService(db), {"sandbox": adapter}, SubmitterConfig()).run_once()
    finally:
        await adapter.aclose()
    assert (await task_row(db, task_id))["status"] == "submitted"
    assert (await sandbox.stats())["generations"]["created"] == 2


async def test_resubmit_is_refused_for_a_healthy_task(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    adapter = sandbox.adapter()
    try:
        task_id = await submitted_task(db, project, adapter, LONG)
    finally:
        await adapter.aclose()
    with pytest.raises(Conflict) as refused:
        await resubmit(db, task_id, "just because", "mallory")
    assert refused.value.code == "not_resubmittable"
    with pytest.raises(NotFound):
        await resubmit(db, uuid.uuid4(), "no such task", "alice")
    with pytest.raises(ValueError, match="reason"):
        await resubmit(db, task_id, "  ", "alice")
    row = await task_row(db, task_id)
    assert (row["status"], row["attempt_no"]) == ("submitted", 1)


async def test_unknown_submit_within_the_grace_opens_nothing(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    await unknown_task(db, project, sandbox)
    adapter = sandbox.adapter(NoLookupSandbox)
    try:
        patient = reconciler(db, adapter, ReconcilerConfig(lookup_grace_s=3600))
        assert await patient.sweep_unknown_submits() == 1
        assert await patient.sweep_unknown_submits() == 0  # next lookup is scheduled later
    finally:
        await adapter.aclose()
    assert await list_items(db, "open") == []


async def test_reconcile_list_and_resolve(db: Database, project: Project, sandbox: Sandbox) -> None:
    await unknown_task(db, project, sandbox)
    adapter = sandbox.adapter(NoLookupSandbox)
    try:
        await reconciler(db, adapter).sweep_unknown_submits()
    finally:
        await adapter.aclose()
    [item] = await list_items(db)
    resolved = await resolve_item(db, item["id"], "refunded the user", "bob")
    assert (resolved["state"], resolved["resolved_by"]) == ("resolved", "bob")
    assert await list_items(db, "open") == []
    assert [i["id"] for i in await list_items(db, None)] == [item["id"]]
    with pytest.raises(Conflict):
        await resolve_item(db, item["id"], "again", "bob")
    with pytest.raises(NotFound):
        await resolve_item(db, 10**9, "nothing", "bob")
    with pytest.raises(ValueError, match="state"):
        await list_items(db, "closed")


async def _inbox_row(db: Database, dedup: str, **columns: object) -> int:
    names = ["provider", "dedup_key", "payload_hash", "payload", *columns]
    values = ["sandbox", dedup, b"\x00", {"type": "generation.updated"}, *columns.values()]
    placeholders = ", ".join(f"${i}" for i in range(1, len(values) + 1))
    async with db.connection() as conn:
        row_id: int = await conn.fetchval(
            f"INSERT INTO provider_callback_inbox ({', '.join(names)}) "
            f"VALUES ({placeholders}) RETURNING id",
            *values,
        )
    return row_id


async def test_stuck_inbox_rows_are_requeued_or_dead_lettered_and_payloads_expire(
    db: Database, sandbox: Sandbox
) -> None:
    old = "now() - interval '2 hours'"
    async with db.connection() as conn:
        past = await conn.fetchval(f"SELECT {old}")
    stuck = await _inbox_row(db, "a", received_at=past)
    tired = await _inbox_row(db, "b", received_at=past, process_status="retry", retry_count=10)
    fresh = await _inbox_row(db, "c")
    leased = await _inbox_row(db, "d", received_at=past, lease_until=past.replace(year=2999))
    done = await _inbox_row(
        db, "e", received_at=past, process_status="processed", processed_at=past
    )
    adapter = sandbox.adapter()
    try:
        config = ReconcilerConfig(inbox_stuck_s=3600, inbox_max_tries=10, inbox_retention_s=60)
        result = await reconciler(db, adapter, config).run_once()
    finally:
        await adapter.aclose()
    assert (result.inbox_requeued, result.inbox_dead, result.payloads_expired) == (1, 1, 1)
    async with db.connection() as conn:
        rows = {
            r["id"]: r
            for r in await conn.fetch(
                "SELECT id, process_status, next_retry_at IS NOT NULL AS due,"
                " payload IS NULL AS expired FROM provider_callback_inbox"
            )
        }
    assert (rows[stuck]["process_status"], rows[stuck]["due"]) == ("pending", True)
    assert rows[tired]["process_status"] == "dead"
    assert (rows[fresh]["process_status"], rows[fresh]["due"]) == ("pending", False)
    assert (rows[leased]["process_status"], rows[leased]["due"]) == ("pending", False)
    assert rows[done]["expired"]


async def test_poll_items_are_resolved_once_the_facts_overtake_them(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    """An attempt that answers polls well again, or that no longer matters, closes its poll item;
    one that still fails keeps it open for an operator."""
    attempts = {}
    for name in ("recovered", "still_failing", "finished"):
        _, attempts[name] = await make_task(store(db), project)
    async with db.connection() as conn:
        for name, attempt_id in attempts.items():
            kind = "poll_malformed" if name == "recovered" else "poll_not_found"
            await conn.execute(
                "INSERT INTO reconciliation_items (kind, task_id, attempt_id, project_id, detail)"
                " SELECT $2, task_id, id, $3, '{}' FROM task_attempts WHERE id = $1",
                attempt_id,
                kind,
                project.project_id,
            )
        # The item was opened a moment ago; since then: a good poll, another failure, an end.
        await conn.execute(
            "UPDATE task_attempts SET poll_error = NULL, polled_at = now() + interval '1 second'"
            " WHERE id = $1",
            attempts["recovered"],
        )
        await conn.execute(
            "UPDATE task_attempts SET poll_error = 'not_found',"
            " polled_at = now() + interval '1 second' WHERE id = $1",
            attempts["still_failing"],
        )
        await conn.execute(
            "UPDATE generation_tasks SET status = 'canceled' WHERE current_attempt_id = $1",
            attempts["finished"],
        )
    adapter = sandbox.adapter(NoLookupSandbox)
    try:
        rec = reconciler(db, adapter)
        assert await rec.sweep_poll_items() == 2
        assert await rec.sweep_poll_items() == 0  # resolved items are not touched again
    finally:
        await adapter.aclose()
    by_attempt = {str(item["attempt_id"]): item for item in await list_items(db, None)}
    assert by_attempt[str(attempts["recovered"])]["resolution"] == "recovered"
    assert by_attempt[str(attempts["finished"])]["resolution"] == "attempt_finished"
    assert by_attempt[str(attempts["finished"])]["resolved_by"] == "reconciler"
    assert by_attempt[str(attempts["still_failing"])]["state"] == "open"


async def test_old_browser_sessions_are_purged_live_ones_kept(
    db: Database, project: Project, sandbox: Sandbox
) -> None:
    ages = {  # name -> (expires_at offset, revoked_at offset), relative to now
        "live": (timedelta(hours=8), None),
        "just_expired": (timedelta(hours=-1), None),
        "long_expired": (timedelta(days=-2), None),
        "long_revoked": (timedelta(hours=8), timedelta(days=-2)),
        "just_revoked": (timedelta(hours=8), timedelta(minutes=-1)),
    }
    async with db.connection() as conn:
        key_id = await conn.fetchval(
            "SELECT id FROM api_keys WHERE tenant_id = $1 LIMIT 1", project.tenant_id
        )
        ids = {}
        for name, (expires, revoked) in ages.items():
            ids[name] = uuid.uuid4()
            await conn.execute(
                "INSERT INTO browser_sessions (id, secret_hash, tenant_id, user_id, key_id,"
                " created_at, expires_at, revoked_at) VALUES ($1, $2, $3, $4, $5,"
                " now() - interval '3 days', now() + $6, now() + $7)",
                ids[name],
                uuid.uuid4().bytes,
                project.tenant_id,
                project.principal.user_id,
                key_id,
                expires,
                revoked,
            )
    adapter = sandbox.adapter(NoLookupSandbox)
    try:
        assert await reconciler(db, adapter).purge_sessions() == 2
    finally:
        await adapter.aclose()
    async with db.connection() as conn:
        left = {r["id"] for r in await conn.fetch("SELECT id FROM browser_sessions")}
    assert left == {ids["live"], ids["just_expired"], ids["just_revoked"]}
