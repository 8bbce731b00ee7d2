"""apply_observation on real PostgreSQL: one transaction, all or nothing."""

from __future__ import annotations

import uuid

import pytest

from aivedio.db.pool import Database
from aivedio.domain.observation import (
    PlatformKind,
    PlatformObservation,
    ProviderObservation,
    ProviderStatus,
    Source,
)
from aivedio.domain.transitions import Outcome, Reason
from aivedio.state.service import StateService
from tests.integration.helpers import make_project, make_task, store


def prov(attempt_id: uuid.UUID | None, status: ProviderStatus, **kw: object) -> ProviderObservation:
    return ProviderObservation(
        provider="sandbox", attempt_id=attempt_id, status=status, source=Source.WEBHOOK, **kw
    )  # type: ignore[arg-type]


async def counts(db: Database) -> dict[str, int]:
    async with db.connection() as conn:
        return {
            t: await conn.fetchval(f"SELECT count(*) FROM {t}")
            for t in ("task_events", "outbox_events", "observation_audit", "reconciliation_items")
        }


async def test_create_writes_version_one_event_and_outbox(db: Database) -> None:
    project = await make_project(db)
    task_id, attempt_id = await make_task(store(db), project)
    async with db.connection() as conn:
        task = await conn.fetchrow("SELECT * FROM generation_tasks WHERE id = $1", task_id)
        event = await conn.fetchrow("SELECT * FROM task_events WHERE task_id = $1", task_id)
        outbox = await conn.fetchrow("SELECT * FROM outbox_events WHERE aggregate_id = $1", task_id)
        stream = await conn.fetchrow(
            "SELECT * FROM event_streams WHERE project_id = $1", project.project_id
        )
        attempt = await conn.fetchrow("SELECT * FROM task_attempts WHERE id = $1", attempt_id)
    assert (task["status"], task["version"], task["last_event_id"]) == ("created", 1, 1)
    assert (event["seq"], event["task_version"], event["epoch"]) == (1, 1, stream["epoch"])
    # stored without what the row's columns say (task id, version, seq) and without nulls
    assert event["public_payload"] == {"status": "queued", "stage": "submitting"}
    assert outbox["payload"]["event_id"] == 1 and outbox["payload"]["status"] == "created"
    assert outbox["publish_status"] == "pending"
    assert stream["head"] == 1
    assert attempt["attempt_no"] == 1 and attempt["client_request_id"].startswith("cr_")


async def test_applied_observation_is_one_version_one_event_one_outbox_row(db: Database) -> None:
    project = await make_project(db)
    state = StateService(db)
    task_id, attempt_id = await make_task(store(db, state), project)
    async with db.connection() as conn:
        inbox_id = await conn.fetchval(
            "INSERT INTO provider_callback_inbox (provider, dedup_key, payload_hash) "
            "VALUES ('sandbox', 'evt-1', '\\x00') RETURNING id"
        )
    result = await state.apply(
        prov(
            attempt_id, ProviderStatus.RUNNING, progress=30, provider_sequence=4, inbox_id=inbox_id
        )
    )
    assert result.outcome is Outcome.APPLIED and result.event is not None
    assert (result.task_version, result.event.seq) == (2, 2)
    async with db.connection() as conn:
        task = await conn.fetchrow("SELECT * FROM generation_tasks WHERE id = $1", task_id)
        attempt = await conn.fetchrow("SELECT * FROM task_attempts WHERE id = $1", attempt_id)
        inbox = await conn.fetchrow("SELECT * FROM provider_callback_inbox WHERE id = $1", inbox_id)
        events = await conn.fetch("SELECT seq, task_version FROM task_events ORDER BY seq")
    assert (task["status"], task["stage"], task["progress"], task["version"]) == (
        "running",
        "generating",
        30,
        2,
    )
    assert task["last_event_id"] == 2
    assert (attempt["provider_status"], attempt["last_provider_seq"]) == ("running", 4)
    assert inbox["process_status"] == "processed" and inbox["processed_at"] is not None
    assert [(e["seq"], e["task_version"]) for e in events] == [(1, 1), (2, 2)]
    assert (await counts(db))["outbox_events"] == 2


async def test_ignored_observation_writes_audit_only(db: Database) -> None:
    project = await make_project(db)
    state = StateService(db)
    _, attempt_id = await make_task(store(db, state), project)
    await state.apply(prov(attempt_id, ProviderStatus.RUNNING, progress=30, provider_sequence=4))
    before = await counts(db)
    result = await state.apply(prov(attempt_id, ProviderStatus.QUEUED, provider_sequence=3))
    assert (result.outcome, result.reason) == (Outcome.IGNORED, Reason.STALE_SEQUENCE)
    after = await counts(db)
    assert after["task_events"] == before["task_events"]
    assert after["outbox_events"] == before["outbox_events"]
    assert after["observation_audit"] == before["observation_audit"] + 1


async def test_unknown_attempt_is_recorded_not_applied(db: Database) -> None:
    state = StateService(db)
    result = await state.apply(prov(uuid.uuid4(), ProviderStatus.SUCCEEDED))
    assert result.reason is Reason.UNKNOWN_ATTEMPT
    async with db.connection() as conn:
        row = await conn.fetchrow("SELECT * FROM observation_audit")
    assert (row["reason"], row["observed"], row["task_id"]) == (
        "unknown_attempt",
        "succeeded",
        None,
    )
    assert (await counts(db))["task_events"] == 0


async def test_contradictory_terminal_opens_one_reconciliation_item(db: Database) -> None:
    project = await make_project(db)
    state = StateService(db)
    task_id, attempt_id = await make_task(store(db, state), project)
    await state.apply(prov(attempt_id, ProviderStatus.FAILED, error_code="content_rejected"))
    for _ in range(3):
        result = await state.apply(prov(attempt_id, ProviderStatus.SUCCEEDED))
        assert result.outcome is Outcome.CONFLICT
    async with db.connection() as conn:
        task = await conn.fetchrow(
            "SELECT status, error_code FROM generation_tasks WHERE id = $1", task_id
        )
        items = await conn.fetch("SELECT kind, state FROM reconciliation_items")
        audit = await conn.fetch("SELECT outcome FROM observation_audit")
    assert (task["status"], task["error_code"]) == ("failed", "content_rejected")
    assert [(i["kind"], i["state"]) for i in items] == [("contradictory_terminal", "open")]
    assert [a["outcome"] for a in audit] == ["conflict"] * 3


async def test_a_failure_inside_the_transaction_writes_nothing(db: Database) -> None:
    project = await make_project(db)
    state = StateService(db)
    task_id, attempt_id = await make_task(store(db, state), project)
    before = await counts(db)
    async with db.connection() as conn:
        await conn.execute(
            """CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN RAISE EXCEPTION 'outbox down'; END $$;
               CREATE TRIGGER boom BEFORE INSERT ON outbox_events
               FOR EACH ROW EXECUTE FUNCTION boom();"""
        )
    with pytest.raises(Exception, match="outbox down"):
        await state.apply(prov(attempt_id, ProviderStatus.RUNNING, progress=50))
    async with db.connection() as conn:
        task = await conn.fetchrow(
            "SELECT status, version FROM generation_tasks WHERE id = $1", task_id
        )
        head = await conn.fetchval("SELECT head FROM event_streams")
        attempt = await conn.fetchval(
            "SELECT provider_status FROM task_attempts WHERE id = $1", attempt_id
        )
    assert (task["status"], task["version"], head, attempt) == ("created", 1, 1, None)
    assert await counts(db) == before


async def test_media_stages_then_ready(db: Database) -> None:
    from aivedio.domain.statuses import Stage

    project = await make_project(db)
    state = StateService(db)
    task_id, attempt_id = await make_task(store(db, state), project)
    await state.apply(prov(attempt_id, ProviderStatus.SUCCEEDED))
    for stage in (Stage.INGESTING, Stage.PROBING, Stage.TRANSCODING, Stage.PUBLISHING):
        r = await state.apply(
            PlatformObservation(
                kind=PlatformKind.MEDIA_STAGE,
                attempt_id=attempt_id,
                source=Source.MEDIA,
                stage=stage,
            )
        )
        assert r.outcome is Outcome.APPLIED
    asset = uuid.uuid4()
    r = await state.apply(
        PlatformObservation(
            kind=PlatformKind.MEDIA_READY,
            attempt_id=attempt_id,
            source=Source.MEDIA,
            asset_id=asset,
        )
    )
    assert r.outcome is Outcome.APPLIED
    async with db.connection() as conn:
        task = await conn.fetchrow("SELECT * FROM generation_tasks WHERE id = $1", task_id)
        events = await conn.fetch(
            "SELECT seq, task_version, public_payload FROM task_events ORDER BY seq"
        )
        audit = await conn.fetch("SELECT outcome, reason, task_version FROM observation_audit")
    assert (task["status"], task["asset_id"], task["terminal_at"] is not None) == (
        "ready",
        asset,
        True,
    )
    # provider_succeeded -> processing_media at ingesting changes nothing a client sees: version
    # 3 is written (and audited) but is no public event; the seqs stay contiguous.
    assert [e["public_payload"]["stage"] for e in events] == [
        "submitting",
        "ingesting",
        "probing",
        "transcoding",
        "publishing",
        "done",
    ]
    assert [e["seq"] for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e["task_version"] for e in events] == [1, 2, 4, 5, 6, 7]
    assert [tuple(a.values()) for a in audit] == [("applied", "no_public_change", 3)]
    assert (task["version"], task["last_event_id"]) == (7, 6)


@pytest.mark.parametrize("batched", [False, True])
async def test_a_webhook_pushes_the_next_poll_only_when_it_is_due_soon(
    db: Database, batched: bool
) -> None:
    """A webhook moves next_poll_at (indexed) out to 30 s only when the poll is due within 15 s;
    otherwise the attempt's update leaves every indexed column alone and is a HOT update (in
    write_event and in the batch's write_events alike)."""
    project = await make_project(db)
    state = StateService(db)
    _, soon = await make_task(store(db, state), project)
    _, later = await make_task(store(db, state), project)
    async with db.connection() as conn:
        for attempt, due_s in ((soon, 5), (later, 25)):
            await conn.execute(
                "UPDATE task_attempts SET provider_task_id = $2,"
                " next_poll_at = now() + make_interval(secs => $3) WHERE id = $1",
                attempt,
                f"gen_{attempt.hex[:8]}",
                float(due_s),
            )
        planned = await conn.fetchval("SELECT next_poll_at FROM task_attempts WHERE id = $1", later)
    steps = [
        prov(attempt, ProviderStatus.RUNNING, progress=10 * n, provider_sequence=n)
        for n in (1, 2, 3)
        for attempt in (soon, later)
    ]
    async with db.transaction() as conn:
        if batched:
            results = await state.apply_many_in(conn, steps)
        else:
            results = [await state.apply_in(conn, obs) for obs in steps]
        hot = await conn.fetchval(
            "SELECT pg_stat_get_xact_tuples_hot_updated('task_attempts'::regclass)"
        )
        pushed = await conn.fetchval(  # now(): this transaction's start, the writes' too
            "SELECT extract(epoch FROM next_poll_at - now())::float8 FROM task_attempts"
            " WHERE id = $1",
            soon,
        )
        kept = await conn.fetchval("SELECT next_poll_at FROM task_attempts WHERE id = $1", later)
    assert [r.outcome for r in results] == [Outcome.APPLIED] * 6
    assert pushed == 30.0 and kept == planned
    # one update per attempt per statement: 6 one by one (5 of them HOT: all but the push),
    # 2 in one batch (the later attempt's HOT)
    assert hot == (5 if batched is False else 1)
