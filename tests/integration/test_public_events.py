"""Public events only on public change, on real PostgreSQL: a version that changes no public
field is written, audited and sent to the bus for internal consumers, but takes no stream seq,
so the stream stays gap-free (one by one, in batches, and with concurrent writers)."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Callable

import pytest

from aivedio.consumers import parse_status_event
from aivedio.db.pool import Database
from aivedio.domain.observation import (
    Observation,
    PlatformKind,
    PlatformObservation,
    ProviderObservation,
    ProviderStatus,
    Source,
)
from aivedio.domain.statuses import Stage
from aivedio.domain.transitions import Outcome, Reason
from aivedio.propagation.dispatcher import parse_event
from aivedio.state.service import ApplyResult, StateService
from tests.integration.helpers import Project, make_project, make_task, store


def lifecycle(attempt_id: uuid.UUID) -> list[Observation]:
    """What the submitter, the provider and the media worker report for one task, in order."""

    def prov(status: ProviderStatus, progress: int | None = None) -> ProviderObservation:
        return ProviderObservation(
            provider="sandbox",
            attempt_id=attempt_id,
            status=status,
            source=Source.WEBHOOK,
            progress=progress,
            dedup_key=f"d-{status}-{progress}",
        )

    def plat(kind: PlatformKind, **kw: object) -> PlatformObservation:
        return PlatformObservation(kind=kind, attempt_id=attempt_id, source=Source.MEDIA, **kw)  # type: ignore[arg-type]

    return [
        plat(PlatformKind.SUBMIT_ACCEPTED),  # v2 queued/queued
        prov(ProviderStatus.QUEUED),  # v3 provider_queued: still queued/queued
        prov(ProviderStatus.RUNNING, 10),  # v4
        prov(ProviderStatus.RUNNING, 60),  # v5
        prov(ProviderStatus.SUCCEEDED),  # v6 processing_media/ingesting
        plat(PlatformKind.MEDIA_STAGE, stage=Stage.INGESTING),  # v7: the same face
        plat(PlatformKind.MEDIA_STAGE, stage=Stage.PROBING),  # v8
        plat(PlatformKind.MEDIA_READY, asset_id=uuid.uuid4()),  # v9 ready
    ]


UNPUBLISHED = [3, 7]
PUBLISHED = [1, 2, 4, 5, 6, 8, 9]


async def check_task(db: Database, task_id: uuid.UUID) -> None:
    async with db.connection() as conn:
        task = await conn.fetchrow("SELECT * FROM generation_tasks WHERE id = $1", task_id)
        events = await conn.fetch(
            "SELECT seq, task_version, public_payload FROM task_events WHERE task_id = $1"
            " ORDER BY seq",
            task_id,
        )
        audit = await conn.fetch(
            "SELECT outcome, reason, observed, task_version, dedup_key FROM observation_audit"
            " WHERE task_id = $1 ORDER BY task_version",
            task_id,
        )
        outbox = await conn.fetch(
            "SELECT aggregate_version, payload::text AS payload FROM outbox_events"
            " WHERE aggregate_id = $1 ORDER BY aggregate_version",
            task_id,
        )
    assert [e["task_version"] for e in events] == PUBLISHED
    public = [
        {k: v for k, v in e["public_payload"].items() if k not in ("event_id", "task_version")}
        for e in events
    ]
    assert all(a != b for a, b in itertools.pairwise(public))  # each one shows news
    assert [(a["outcome"], a["reason"], a["task_version"]) for a in audit] == [
        ("applied", "no_public_change", v) for v in UNPUBLISHED
    ]
    assert [a["observed"] for a in audit] == ["queued", "media_stage:ingesting"]
    assert audit[0]["dedup_key"] == "d-queued-None"
    assert (task["status"], task["version"], task["last_event_id"]) == (
        "ready",
        9,
        events[-1]["seq"],
    )
    # Every version reaches the bus (internal consumers read internal statuses); the dispatcher
    # publishes only the public ones.
    assert [o["aggregate_version"] for o in outbox] == list(range(1, 10))
    for row in outbox:
        raw = row["payload"].encode()
        body = json.loads(raw)
        status_event = parse_status_event(raw)
        assert status_event is not None and status_event.version == row["aggregate_version"]
        routed = parse_event(raw)
        if row["aggregate_version"] in UNPUBLISHED:
            assert (body["public"], body["event_id"], body["epoch"]) == (None, None, None)
            assert routed is None
        else:
            assert routed is not None and routed.task_version == row["aggregate_version"]


async def check_stream(db: Database, project: Project, public_events: int) -> None:
    async with db.connection() as conn:
        head = await conn.fetchval(
            "SELECT head FROM event_streams WHERE project_id = $1", project.project_id
        )
        seqs = [
            r["seq"]
            for r in await conn.fetch(
                "SELECT seq FROM task_events WHERE project_id = $1 ORDER BY seq",
                project.project_id,
            )
        ]
    assert seqs == list(range(1, head + 1)) and head == public_events


async def one_by_one(state: StateService, observations: list[Observation]) -> list[ApplyResult]:
    return [await state.apply(o) for o in observations]


async def one_batch(state: StateService, observations: list[Observation]) -> list[ApplyResult]:
    return await state.apply_many(observations)


@pytest.mark.parametrize("apply", [one_by_one, one_batch], ids=["apply", "apply_many"])
async def test_a_task_publishes_only_what_a_client_can_see(
    db: Database, apply: Callable[..., object]
) -> None:
    project = await make_project(db)
    state = StateService(db)
    task_id, attempt_id = await make_task(store(db, state), project)
    results = await apply(state, lifecycle(attempt_id))  # type: ignore[misc]
    assert [r.outcome for r in results] == [Outcome.APPLIED] * 8
    silent = [r.task_version for r in results if r.reason is Reason.NO_PUBLIC_CHANGE]
    assert silent == UNPUBLISHED
    assert all((r.event is not None and r.event.public) is (r.reason is None) for r in results)
    await check_task(db, task_id)
    await check_stream(db, project, len(PUBLISHED))


async def test_interleaved_writers_and_batches_keep_every_stream_gap_free(db: Database) -> None:
    """Tasks of two projects driven at once, some one by one, some in batches that mix both
    projects: every project's seqs are 1..head, one per public event."""
    state = StateService(db)
    tasks = store(db, state)
    projects = [await make_project(db, tenant=f"t{i}", project="p") for i in range(2)]
    made = [(p, *(await make_task(tasks, p))) for p in projects for _ in range(4)]

    async def drive_alone(attempt_id: uuid.UUID) -> None:
        for obs in lifecycle(attempt_id):
            await state.apply(obs)

    batched = [lifecycle(attempt_id) for _, _, attempt_id in made[::2]]

    async def drive_batched() -> None:
        for step in zip(*batched, strict=True):  # one step of every batched task per batch
            await state.apply_many(list(step))

    await asyncio.gather(drive_batched(), *(drive_alone(a) for _, _, a in made[1::2]))
    for _, task_id, _ in made:
        await check_task(db, task_id)
    for project in projects:
        await check_stream(db, project, 4 * len(PUBLISHED))
