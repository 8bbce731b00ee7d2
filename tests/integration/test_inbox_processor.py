"""The inbox processor on real PostgreSQL: callbacks stored by the real gateway route are mapped,
applied (inbox row processed in the same transaction), orphaned, retried, dead-lettered and
replayed; two processors never apply one row twice; unsigned callbacks are re-fetched; and an
end-to-end run against the real sandbox provider reaches the true final states, chaos included.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest
import standardwebhooks
from starlette.applications import Starlette

from aivedio.db.handoff import Handoff
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.db.wakeup import Signal
from aivedio.domain.observation import Observation, ProviderStatus
from aivedio.ingest.gateway import CallbackConfig, callback_routes
from aivedio.ingest.group_commit import InboxWriter
from aivedio.ingest.processor import IDLE_LOCK, InboxConfig, InboxProcessor
from aivedio.ingest.retries import list_dead_letters, replay
from aivedio.propagation import relay
from aivedio.providers.kling import KlingAdapter
from aivedio.providers.port import ProviderAdapter, SubmitRequest
from aivedio.providers.registry import callback_providers, versioned
from aivedio.providers.sandbox import SandboxAdapter
from aivedio.sandbox import SandboxConfig, create_app
from aivedio.state.service import ApplyResult, StateService
from tests.integration.helpers import (
    Project,
    holds_advisory_lock,
    make_project,
    make_task,
    notifications,
    store,
)
from tests.integration.test_lock_freshness import waiting_for_a_lock, webhook
from tests.integration.test_sandbox_provider import free_socket, run_app
from tests.waiting import eventually

SECRET = "whsec_" + base64.b64encode(os.urandom(24)).decode()
TOKEN_SECRET = os.urandom(32)
FAST = InboxConfig(
    orphan_backoff_base_s=30.0,
    parse_backoff_base_s=30.0,
    refetch_backoff_base_s=30.0,
    orphan_max_tries=3,
    parse_max_tries=2,
)


class KlingFake:
    """The Kling query API as a MockTransport: answers the task it holds, records requests."""

    def __init__(self) -> None:
        self.tasks: dict[str, dict[str, Any]] = {}
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        task_id = request.url.path.rsplit("/", 1)[-1]
        task = self.tasks.get(task_id)
        if task is None:
            return httpx.Response(404, json={"code": 1203, "message": "task not found"})
        return httpx.Response(200, json={"code": 0, "message": "SUCCEED", "data": task})


@dataclass
class Env:
    db: Database
    state: StateService
    project: Project
    client: httpx.AsyncClient
    adapters: dict[str, ProviderAdapter]
    kling: KlingFake

    def processor(
        self, config: InboxConfig = FAST, state: StateService | None = None
    ) -> InboxProcessor:
        return InboxProcessor(self.db, state or self.state, self.adapters, config)

    async def task(
        self, provider: str = "sandbox", provider_task_id: str | None = None
    ) -> tuple[uuid.UUID, uuid.UUID, str]:
        task_id, attempt_id = await make_task(
            store(self.db, self.state), self.project, provider=provider
        )
        async with self.db.connection() as conn:
            crid = await conn.fetchval(
                "UPDATE task_attempts SET provider_task_id = $2 WHERE id = $1 "
                "RETURNING client_request_id",
                attempt_id,
                provider_task_id,
            )
        return task_id, attempt_id, crid

    async def post_sandbox(self, data: dict[str, Any], msg_id: str | None = None) -> httpx.Response:
        body = json.dumps({"type": "generation.updated", "data": data})
        msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
        now = datetime.now(UTC)
        headers = {
            "content-type": "application/json",
            "webhook-id": msg_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": standardwebhooks.Webhook(SECRET).sign(msg_id, now, body),
        }
        return await self.client.post("/v1/callbacks/sandbox", content=body, headers=headers)

    async def post_kling(self, attempt_id: uuid.UUID, body: dict[str, Any]) -> httpx.Response:
        url = self.adapters["kling"].webhook_url_for(str(attempt_id))
        assert url is not None
        parts = urlsplit(url)
        return await self.client.post(
            f"{parts.path}?{parts.query}",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
        )

    async def status(self, task_id: uuid.UUID) -> str:
        async with self.db.connection() as conn:
            return str(
                await conn.fetchval("SELECT status FROM generation_tasks WHERE id = $1", task_id)
            )

    async def inbox(self) -> list[dict[str, Any]]:
        async with self.db.connection() as conn:
            rows = await conn.fetch("SELECT * FROM provider_callback_inbox ORDER BY id")
        return [dict(r) for r in rows]

    async def make_due(self) -> None:
        """Time passes: every waiting row is due now."""
        async with self.db.connection() as conn:
            await conn.execute("UPDATE provider_callback_inbox SET next_retry_at = now()")


def generation(
    gen: str, status: str, seq: int, crid: str | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "id": gen,
        "status": status,
        "progress": 50 if status == "running" else (100 if status == "succeeded" else 0),
        "sequence": seq,
        "updated_at": datetime.now(UTC).isoformat(),
        "error": None,
        "output": None,
        "metadata": {"client_request_id": crid} if crid else {},
        **extra,
    }


def kling_task(task_id: str, status: str, crid: str) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "task_status": status,
        "task_status_msg": "",
        "created_at": int(time.time() * 1000),
        "updated_at": int(time.time() * 1000),
        "task_info": {"external_task_id": crid},
        "task_result": {},
    }


@pytest.fixture
async def env(db: Database) -> AsyncIterator[Env]:
    kling = KlingFake()
    sandbox = SandboxAdapter(
        base_url="http://sandbox.invalid",
        api_key="k",
        webhook_secrets=versioned((SECRET,)),
        public_url="http://t",
    )
    kling_adapter = KlingAdapter(
        access_key="ak",
        secret_key="sk",
        callback_token_secrets=(("t0", TOKEN_SECRET),),
        public_url="http://t",
        base_url="http://kling.test",
        client=httpx.AsyncClient(transport=httpx.MockTransport(kling)),
    )
    adapters: dict[str, ProviderAdapter] = {"sandbox": sandbox, "kling": kling_adapter}
    writer = InboxWriter(db)
    writer.start()
    app = Starlette(routes=callback_routes(CallbackConfig(), callback_providers(adapters), writer))
    state = StateService(db)
    project = await make_project(db)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as client:
            yield Env(db, state, project, client, adapters, kling)
    finally:
        await writer.close()
        for adapter in adapters.values():
            await adapter.aclose()
        await kling_adapter.http.client.aclose()


async def drain(processor: InboxProcessor) -> int:
    total = 0
    while claimed := await processor.process_once():
        total += claimed
    return total


# --- mapping and applying --------------------------------------------------------------------


async def test_callback_is_mapped_by_provider_task_id_and_applied(env: Env) -> None:
    task_id, attempt_id, _ = await env.task(provider_task_id="gen_a")
    response = await env.post_sandbox(generation("gen_a", "running", 2), msg_id="msg_gen_a_2")
    assert response.status_code == 204
    assert await drain(env.processor()) == 1
    assert await env.status(task_id) == "running"
    (row,) = await env.inbox()
    assert row["process_status"] == "processed" and row["processed_at"] is not None
    assert row["lease_token"] is None
    async with env.db.connection() as conn:
        attempt = await conn.fetchrow("SELECT * FROM task_attempts WHERE id = $1", attempt_id)
        events = await conn.fetchval("SELECT count(*) FROM task_events WHERE task_id = $1", task_id)
    assert attempt["provider_status"] == "running" and attempt["last_provider_seq"] == 2
    assert events == 2  # created + running
    # the same event again: a duplicate at the door, nothing to process
    assert (
        await env.post_sandbox(generation("gen_a", "running", 2), msg_id="msg_gen_a_2")
    ).status_code == 204
    assert await drain(env.processor()) == 0


class FailingState(StateService):
    """Applies, then fails before commit: nothing of the row's transaction may survive."""

    async def apply_in(
        self, conn: asyncpg.Connection, obs: Observation, *, locked: bool = False
    ) -> ApplyResult:
        await super().apply_in(conn, obs, locked=locked)
        raise RuntimeError("crash after apply")

    async def apply_many_in(
        self,
        conn: asyncpg.Connection,
        observations: Sequence[Observation],
        *,
        locked: bool = False,
    ) -> list[ApplyResult]:
        await super().apply_many_in(conn, observations, locked=locked)
        raise RuntimeError("crash after apply")


async def test_state_change_and_inbox_mark_share_one_transaction(env: Env) -> None:
    task_id, _, _ = await env.task(provider_task_id="gen_t")
    await env.post_sandbox(generation("gen_t", "running", 2))
    await drain(env.processor(state=FailingState(env.db)))
    assert await env.status(task_id) == "created"  # the task change rolled back with it
    (row,) = await env.inbox()
    assert row["process_status"] == "retry" and row["last_error_code"] == "internal_error"
    assert row["processed_at"] is None
    await env.make_due()
    assert await drain(env.processor()) == 1
    assert await env.status(task_id) == "running"
    assert (await env.inbox())[0]["process_status"] == "processed"


async def test_callback_before_submit_response_maps_by_client_request_id(env: Env) -> None:
    task_id, attempt_id, crid = await env.task(provider_task_id=None)
    await env.post_sandbox(generation("gen_early", "queued", 1, crid))
    assert await drain(env.processor()) == 1
    assert await env.status(task_id) == "provider_queued"
    async with env.db.connection() as conn:
        recorded = await conn.fetchrow(
            "SELECT a.provider_task_id, a.next_poll_at IS NOT NULL AS polled, i.state"
            " FROM task_attempts a JOIN submit_intents i ON i.attempt_id = a.id WHERE a.id = $1",
            attempt_id,
        )
    assert recorded is not None
    assert recorded["provider_task_id"] == "gen_early"
    # polled from now on, and the submit intent settled: the provider evidently took the submit
    # (found by aivedio chaos: a submit that failed after the provider accepted it left the
    # intent pending, never claimed again once the task left `created`, and the attempt
    # unpolled, so a dropped terminal webhook left the task running forever)
    assert recorded["polled"]
    assert recorded["state"] == "accepted"
    # the next callback names only the provider id: mapped by it now
    await env.post_sandbox(generation("gen_early", "succeeded", 2))
    await drain(env.processor())
    assert await env.status(task_id) == "provider_succeeded"


async def test_client_request_id_with_another_task_id_is_not_applied(env: Env) -> None:
    task_id, _, crid = await env.task(provider_task_id="gen_ours")
    await env.post_sandbox(generation("gen_other", "succeeded", 5, crid))
    await drain(env.processor())
    (row,) = await env.inbox()
    assert row["process_status"] == "orphan" and row["last_error_code"] == "task_id_mismatch"
    assert await env.status(task_id) == "created"


# --- orphans, parse errors, dead letters -----------------------------------------------------


async def test_unmappable_callback_orphan_backoff_dead_list_replay(env: Env) -> None:
    await env.post_sandbox(generation("gen_nobody", "running", 1, "cr_nobody"))
    processor = env.processor()
    delays = []
    for tries in (1, 2):
        assert await drain(processor) == 1
        (row,) = await env.inbox()
        assert row["process_status"] == "orphan" and row["retry_count"] == tries
        assert row["last_error_code"] == "unmapped"
        delays.append((row["next_retry_at"] - datetime.now(UTC)).total_seconds())
        assert await drain(processor) == 0  # not due yet: it waits out its backoff
        await env.make_due()
    assert 20 < delays[0] < 40 and 45 < delays[1] < 75  # base 30 s, doubled, jitter +-20 %
    assert await drain(processor) == 1
    (row,) = await env.inbox()
    assert row["process_status"] == "dead" and row["retry_count"] == 3
    dead = await list_dead_letters(env.db, 10)
    assert [d["id"] for d in dead] == [row["id"]]
    assert dead[0]["last_error_code"] == "unmapped" and "payload" not in dead[0]
    # the attempt turns up (submit recorded it late); an operator replays the dead letter
    task_id, _, _ = await env.task(provider_task_id="gen_nobody")
    assert await replay(env.db, row["id"]) is True
    (row,) = await env.inbox()
    assert row["process_status"] == "pending" and row["retry_count"] == 0
    assert await drain(processor) == 1
    assert await env.status(task_id) == "running"
    assert await replay(env.db, row["id"]) is False  # processed rows stay processed
    assert await replay(env.db, 999_999) is False


async def test_parse_error_keeps_redacted_sample_and_dead_letters(env: Env) -> None:
    data = generation("gen_bad", "exploded", 1)
    data["output"] = {"url": "https://cdn.example/x.mp4?sig=TOPSECRET"}
    data["token"] = "ALSOSECRET"
    await env.post_sandbox(data)
    processor = env.processor()
    await drain(processor)
    (row,) = await env.inbox()
    assert row["process_status"] == "retry" and row["last_error_code"] == "payload_unknown_status"
    sample = row["last_error_sample"]
    assert sample and "exploded" in sample
    assert "TOPSECRET" not in sample and "ALSOSECRET" not in sample
    await env.make_due()
    await drain(processor)
    (row,) = await env.inbox()
    assert row["process_status"] == "dead" and row["retry_count"] == 2
    assert (await list_dead_letters(env.db, 5))[0]["last_error_sample"] == sample


# --- concurrency -----------------------------------------------------------------------------


class CountingState(StateService):
    def __init__(self, db: Database, seen: list[int]) -> None:
        super().__init__(db)
        self.seen = seen

    async def apply_in(
        self, conn: asyncpg.Connection, obs: Observation, *, locked: bool = False
    ) -> ApplyResult:
        result = await super().apply_in(conn, obs, locked=locked)
        inbox_id = getattr(obs, "inbox_id", None)
        assert inbox_id is not None
        self.seen.append(inbox_id)
        await asyncio.sleep(0.005)  # widen the window in which a second processor could interfere
        return result

    async def apply_many_in(
        self,
        conn: asyncpg.Connection,
        observations: Sequence[Observation],
        *,
        locked: bool = False,
    ) -> list[ApplyResult]:
        results = await super().apply_many_in(conn, observations, locked=locked)
        self.seen.extend(getattr(obs, "inbox_id", None) for obs in observations)
        await asyncio.sleep(0.005)
        return results


async def test_two_processors_never_process_one_row_twice(env: Env) -> None:
    tasks = []
    for i in range(24):
        task_id, _, _ = await env.task(provider_task_id=f"gen_{i}")
        tasks.append(task_id)
        for seq, status in enumerate(("queued", "running", "succeeded"), start=1):
            await env.post_sandbox(generation(f"gen_{i}", status, seq))
    seen: list[int] = []
    config = InboxConfig(batch_size=5, concurrency=3)
    one, two = (env.processor(config, CountingState(env.db, seen)) for _ in range(2))
    await asyncio.gather(drain(one), drain(two), drain(one), drain(two))
    rows = await env.inbox()
    assert len(rows) == 72 and {r["process_status"] for r in rows} == {"processed"}
    assert sorted(seen) == sorted(r["id"] for r in rows)  # each row applied exactly once
    assert {await env.status(t) for t in tasks} == {"provider_succeeded"}


async def test_a_taken_over_lease_cannot_apply(env: Env) -> None:
    task_id, _, _ = await env.task(provider_task_id="gen_l")
    await env.post_sandbox(generation("gen_l", "running", 2))
    stale_token = uuid.uuid4()
    async with env.db.connection() as conn:
        (claimed,) = await conn.fetch(
            "UPDATE provider_callback_inbox SET lease_until = now() - interval '1 s', "
            "lease_token = $1 RETURNING *",
            stale_token,
        )
    seen: list[int] = []
    assert await drain(env.processor(state=CountingState(env.db, seen))) == 1  # lease expired
    slow = env.processor(state=CountingState(env.db, seen))
    await slow._process(claimed, stale_token)  # the first claimer wakes up late
    assert seen == [claimed["id"]]
    assert await env.status(task_id) == "running"


async def test_the_take_locks_the_tasks_of_the_rows_it_takes_and_no_others(env: Env) -> None:
    (ours_task, ours_attempt, _), (lost_task, lost_attempt, _) = [
        await env.task(provider_task_id=f"gen_t{i}") for i in range(2)
    ]
    for i in range(2):
        await env.post_sandbox(generation(f"gen_t{i}", "running", 2))
    ours, lost = (r["id"] for r in await env.inbox())
    token = uuid.uuid4()
    async with env.db.connection() as conn:
        await conn.execute(
            "UPDATE provider_callback_inbox"
            " SET lease_token = CASE id WHEN $1 THEN $2::uuid ELSE $3::uuid END",
            ours,
            token,
            uuid.uuid4(),  # the other row's lease is another processor's
        )
    async with env.db.transaction() as conn:
        taken = await conn.fetch(
            q("inbox_take_claimed"), [ours, lost], token, [ours_attempt, lost_attempt], "off"
        )
        assert [r["id"] for r in taken] == [ours]
        async with env.db.connection() as other:
            lock = "SELECT id FROM generation_tasks WHERE id = $1 FOR UPDATE NOWAIT"
            with pytest.raises(asyncpg.LockNotAvailableError):
                await other.execute(lock, ours_task)
            async with other.transaction():
                assert await other.fetchval(lock, lost_task) == lost_task
    by_id = {r["id"]: r for r in await env.inbox()}
    assert (by_id[ours]["process_status"], by_id[lost]["process_status"]) == (
        "processed",
        "pending",
    )


async def test_a_row_whose_take_waited_for_its_task_decides_on_the_committed_attempt(
    env: Env,
) -> None:
    """The lock-freshness rule (tests/integration/test_lock_freshness.py) on the processor's
    path, where the take statement is the one that waits for the task's lock."""
    _, attempt, _ = await env.task(provider_task_id="gen_f")
    for seq, status in ((1, ProviderStatus.QUEUED), (2, ProviderStatus.RUNNING)):
        await env.state.apply(webhook(attempt, status, seq))
    await env.post_sandbox(generation("gen_f", "running", 3))  # late: stored, not yet applied
    async with env.db.transaction() as conn:
        await env.state.apply_in(conn, webhook(attempt, ProviderStatus.SUCCEEDED, 4))
        applying = asyncio.create_task(drain(env.processor()))
        await eventually(
            lambda: waiting_for_a_lock(env.db),
            "the processor to wait for the task's lock",
            4,
            interval=0.01,
        )
    assert await applying == 1
    async with env.db.connection() as conn:
        row = await conn.fetchrow(
            "SELECT provider_status, last_provider_seq FROM task_attempts WHERE id = $1", attempt
        )
        audit = await conn.fetchrow(
            "SELECT outcome, reason FROM observation_audit WHERE provider_sequence = 3"
            " AND attempt_id = $1",
            attempt,
        )
    assert row is not None and (row["provider_status"], row["last_provider_seq"]) == (
        "succeeded",
        4,
    )
    assert audit is not None and (audit["outcome"], audit["reason"]) == (
        "ignored",
        "after_terminal",
    )


# --- batches: one project's rows of a claim in one transaction -------------------------------


def burst(gen: str) -> list[dict[str, Any]]:
    """A whole generation in webhooks: queued, running by steps of 10 points, succeeded."""
    steps = [generation(gen, "queued", 1)]
    steps += [generation(gen, "running", 2 + i, progress=10 * (i + 1)) for i in range(8)]
    return [*steps, generation(gen, "succeeded", 10)]


async def task_history(env: Env, task_id: uuid.UUID) -> list[Any]:
    async with env.db.connection() as conn:
        task = await conn.fetchrow(
            "SELECT status, stage, progress, version FROM generation_tasks WHERE id = $1", task_id
        )
        events = await conn.fetch(
            "SELECT task_version, public_payload->>'status' AS status,"
            " public_payload->>'progress' AS progress FROM task_events"
            " WHERE task_id = $1 ORDER BY seq",
            task_id,
        )
        audit = await conn.fetch(
            "SELECT outcome, reason, provider_sequence FROM observation_audit"
            " WHERE task_id = $1 ORDER BY provider_sequence, id",
            task_id,
        )
    assert task is not None
    return [dict(task), [dict(e) for e in events], [dict(a) for a in audit]]


async def transactions_of(env: Env, task_id: uuid.UUID) -> int:
    """How many transactions wrote the task's webhook events (xmin: the inserting one)."""
    async with env.db.connection() as conn:
        return int(
            await conn.fetchval(
                "SELECT count(DISTINCT xmin::text) FROM task_events"
                " WHERE task_id = $1 AND source = 'webhook'",
                task_id,
            )
        )


async def test_a_burst_in_one_batch_ends_as_one_by_one_in_one_transaction(env: Env) -> None:
    one_task, _, _ = await env.task(provider_task_id="gen_single")
    batch_task, _, _ = await env.task(provider_task_id="gen_batch")
    for data in burst("gen_single"):
        await env.post_sandbox(data)
    assert await drain(env.processor(InboxConfig(batch_size=1))) == 10
    for data in burst("gen_batch"):
        await env.post_sandbox(data)
    assert await drain(env.processor(InboxConfig(batch_size=64))) == 10
    assert await task_history(env, one_task) == await task_history(env, batch_task)
    assert (await task_history(env, batch_task))[0]["status"] == "provider_succeeded"
    assert await transactions_of(env, one_task) == 10
    assert await transactions_of(env, batch_task) == 1
    assert {r["process_status"] for r in await env.inbox()} == {"processed"}


async def test_one_claim_across_projects_is_one_transaction(env: Env) -> None:
    others = [await make_project(env.db, tenant=f"t{n}", project=f"p{n}") for n in range(2)]
    tasks = []
    for n, project in enumerate([env.project, *others]):
        task_id, _ = await make_task(store(env.db, env.state), project)
        async with env.db.connection() as conn:
            await conn.execute(
                "UPDATE task_attempts SET provider_task_id = $2 WHERE task_id = $1",
                task_id,
                f"gen_x{n}",
            )
        tasks.append(task_id)
        for data in burst(f"gen_x{n}")[:3]:
            await env.post_sandbox(data)
    assert await drain(env.processor(InboxConfig(batch_size=64))) == 9
    async with env.db.connection() as conn:
        writers = await conn.fetchval(
            "SELECT count(DISTINCT xmin::text) FROM task_events"
            " WHERE task_id = ANY($1::uuid[]) AND source = 'webhook'",
            tasks,
        )
        projects = await conn.fetchval(
            "SELECT count(DISTINCT project_id) FROM task_events WHERE task_id = ANY($1::uuid[])",
            tasks,
        )
    assert (writers, projects) == (1, 3)
    assert {await env.status(t) for t in tasks} == {"running"}


async def test_stale_rows_in_a_batch_are_audited_not_applied(env: Env) -> None:
    task_id, old_attempt, _ = await env.task(provider_task_id="gen_old")
    await env.post_sandbox(generation("gen_old", "failed", 1, error={"code": "x", "message": "m"}))
    await drain(env.processor())
    assert await env.status(task_id) == "failed"
    tasks = store(env.db, env.state)
    await tasks.retry(env.project.principal, env.project.project_id, task_id, None)
    async with env.db.connection() as conn:
        new_attempt = await conn.fetchval(
            "UPDATE task_attempts SET provider_task_id = 'gen_new'"
            " WHERE task_id = $1 AND id <> $2 RETURNING id",
            task_id,
            old_attempt,
        )
    assert new_attempt is not None
    # one claim: the new attempt's webhooks, a stale sequence among them, the old attempt's late
    # success
    await env.post_sandbox(generation("gen_new", "queued", 1))
    await env.post_sandbox(generation("gen_new", "running", 3, progress=40))
    await env.post_sandbox(generation("gen_new", "running", 2, progress=20))
    await env.post_sandbox(generation("gen_old", "succeeded", 2))
    assert await drain(env.processor()) == 4
    assert await env.status(task_id) == "running"
    _, events, audit = await task_history(env, task_id)
    assert [e["progress"] for e in events if e["status"] == "running"] == ["40"]
    reasons = {(a["reason"], a["provider_sequence"]) for a in audit}
    assert ("stale_sequence", 2) in reasons and ("stale_attempt", 2) in reasons
    assert {r["process_status"] for r in await env.inbox()} == {"processed"}


class PoisonState(StateService):
    """Refuses to apply the observations of the given inbox rows, alone or in a batch."""

    def __init__(self, db: Database, poison: set[int]) -> None:
        super().__init__(db)
        self.poison = poison

    def _check(self, observations: Sequence[Observation]) -> None:
        if any(getattr(obs, "inbox_id", None) in self.poison for obs in observations):
            raise RuntimeError("poison")

    async def apply_in(
        self, conn: asyncpg.Connection, obs: Observation, *, locked: bool = False
    ) -> ApplyResult:
        self._check([obs])
        return await super().apply_in(conn, obs, locked=locked)

    async def apply_many_in(
        self,
        conn: asyncpg.Connection,
        observations: Sequence[Observation],
        *,
        locked: bool = False,
    ) -> list[ApplyResult]:
        self._check(observations)
        return await super().apply_many_in(conn, observations, locked=locked)


async def test_a_row_that_fails_in_a_batch_is_deferred_alone(env: Env) -> None:
    tasks = [(await env.task(provider_task_id=f"gen_p{i}"))[0] for i in range(4)]
    for i in range(4):
        await env.post_sandbox(generation(f"gen_p{i}", "running", 2))
    rows = await env.inbox()
    bad = rows[1]["id"]
    assert await drain(env.processor(state=PoisonState(env.db, {bad}))) == 4
    by_id = {r["id"]: r for r in await env.inbox()}
    assert by_id[bad]["process_status"] == "retry"
    assert by_id[bad]["last_error_code"] == "internal_error"
    assert {r["process_status"] for i, r in by_id.items() if i != bad} == {"processed"}
    statuses = [await env.status(t) for t in tasks]
    assert statuses == ["running", "created", "running", "running"]
    await env.make_due()
    assert await drain(env.processor()) == 1  # the retry, once the bug is gone
    assert await env.status(tasks[1]) == "running"


class StealingProcessor(InboxProcessor):
    """Another processor takes over the lease of some rows after they were prepared."""

    stolen: set[int]

    async def _prepare(self, item: Any, attempts: Any, token: uuid.UUID) -> Any:
        ready = await super()._prepare(item, attempts, token)
        row = item.row
        if row["id"] in self.stolen:
            async with self.db.connection() as conn:
                await conn.execute(
                    "UPDATE provider_callback_inbox SET lease_token = $2 WHERE id = $1",
                    row["id"],
                    uuid.uuid4(),
                )
        return ready


async def test_a_batch_that_lost_the_lease_of_some_rows_applies_none_of_them(env: Env) -> None:
    tasks = [(await env.task(provider_task_id=f"gen_s{i}"))[0] for i in range(4)]
    for i in range(4):
        await env.post_sandbox(generation(f"gen_s{i}", "running", 2))
    rows = await env.inbox()
    stolen = {rows[0]["id"], rows[2]["id"]}
    seen: list[int] = []
    thief = StealingProcessor(env.db, CountingState(env.db, seen), env.adapters, FAST)
    thief.stolen = stolen
    assert await thief.process_once() == 4
    assert sorted(seen) == sorted(r["id"] for r in rows if r["id"] not in stolen)
    by_id = {r["id"]: r for r in await env.inbox()}
    assert {by_id[i]["process_status"] for i in stolen} == {"pending"}
    assert [await env.status(t) for t in tasks] == [
        "created",
        "running",
        "created",
        "running",
    ]
    async with env.db.connection() as conn:
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM observation_audit WHERE inbox_id = ANY($1::bigint[])",
                list(stolen),
            )
            == 0
        )


# --- waking an idle processor ----------------------------------------------------------------

ASLEEP = replace(FAST, poll_s=300.0)  # a poll that never comes within a test: only a wake-up


async def applied_while_asleep(env: Env, processor: InboxProcessor, generation_id: str) -> None:
    """Run ``processor`` until it sleeps on the idle lock, store a callback for a new task of
    ``generation_id`` through env's writer (not the processor's process: no kick), and wait
    until the processor has applied it; then stop it."""
    task_id, _, _ = await env.task(provider_task_id=generation_id)
    stopping = asyncio.Event()
    job = asyncio.create_task(processor.run(stopping))
    try:
        await eventually(
            lambda: holds_advisory_lock(env.db, IDLE_LOCK),
            "the processor asleep on the idle lock",
            20,
        )
        await env.post_sandbox(generation(generation_id, "running", 2))

        async def applied() -> bool:
            return await env.status(task_id) == "running"

        await eventually(applied, "the callback applied", 20)
    finally:
        stopping.set()
        await job


async def test_an_idle_processor_is_woken_by_the_notify_of_a_stored_callback(env: Env) -> None:
    await applied_while_asleep(env, env.processor(ASLEEP), "gen_w")  # another writer, no kick
    assert not await holds_advisory_lock(env.db, IDLE_LOCK)  # the listening session is gone


async def test_a_kick_wakes_the_processor_when_it_cannot_listen(env: Env) -> None:
    task_id, _, _ = await env.task(provider_task_id="gen_k")
    processor = env.processor(ASLEEP)
    unreachable = replace(env.db.config, url="postgresql://127.0.0.1:1/none", acquire_timeout_s=1)
    processor.idle.db = Database(env.db.pool, unreachable)  # only the listener uses its URL
    stopping = asyncio.Event()
    job = asyncio.create_task(processor.run(stopping))
    try:

        async def asleep() -> bool:
            return processor.idle.waits > 0

        # Without a listener: only a kick (or the poll) wakes it.
        await eventually(asleep, "the processor asleep", 20)
        await env.post_sandbox(generation("gen_k", "running", 2))
        assert await env.status(task_id) == "created"
        processor.idle.kick()  # what the group commit of its process does after storing

        async def applied() -> bool:
            return await env.status(task_id) == "running"

        await eventually(applied, "the callback applied", 20)
    finally:
        stopping.set()
        await job


# --- unsigned providers: re-fetch ------------------------------------------------------------


async def test_unsigned_callback_is_refetched_before_applying(env: Env) -> None:
    task_id, attempt_id, crid = await env.task(provider="kling", provider_task_id="k_1")
    env.kling.tasks["k_1"] = kling_task("k_1", "succeed", crid)
    # the body claims something else (failed, another task): only the provider's answer counts
    forged = kling_task("k_evil", "failed", crid)
    assert (await env.post_kling(attempt_id, forged)).status_code == 204
    assert await drain(env.processor()) == 1
    assert [r.url.path for r in env.kling.requests] == ["/v1/videos/text2video/k_1"]
    assert await env.status(task_id) == "provider_succeeded"
    (row,) = await env.inbox()
    assert row["process_status"] == "processed" and row["payload_authenticated"] is False


async def test_unsigned_callback_before_submit_needs_a_confirming_refetch(env: Env) -> None:
    task_id, attempt_id, crid = await env.task(provider="kling", provider_task_id=None)
    env.kling.tasks["k_2"] = kling_task("k_2", "processing", "cr_someone_else")
    await env.post_kling(attempt_id, kling_task("k_2", "processing", crid))
    await drain(env.processor())
    (row,) = await env.inbox()
    assert row["process_status"] == "orphan" and row["last_error_code"] == "refetch_unconfirmed"
    assert await env.status(task_id) == "created"
    env.kling.tasks["k_2"] = kling_task("k_2", "processing", crid)  # now it is ours
    await env.make_due()
    await drain(env.processor())
    assert await env.status(task_id) == "running"
    async with env.db.connection() as conn:
        assert (
            await conn.fetchval(
                "SELECT provider_task_id FROM task_attempts WHERE id = $1", attempt_id
            )
            == "k_2"
        )


async def test_refetch_failure_is_retried(env: Env) -> None:
    task_id, attempt_id, crid = await env.task(provider="kling", provider_task_id="k_404")
    await env.post_kling(attempt_id, kling_task("k_404", "succeed", crid))
    await drain(env.processor())
    (row,) = await env.inbox()
    assert row["process_status"] == "retry" and row["last_error_code"] == "refetch_not_found"
    assert await env.status(task_id) == "created"


# --- end to end against the real sandbox provider ---------------------------------------------


@contextlib.asynccontextmanager
async def live_stack(
    db: Database, config: InboxConfig | None = None
) -> AsyncIterator[tuple[SandboxAdapter, InboxProcessor, httpx.AsyncClient]]:
    """The sandbox provider and the gateway, each in uvicorn on a free port, plus a processor."""
    gateway_sock, sandbox_sock = free_socket(), free_socket()
    gateway_url = "http://{}:{}".format(*gateway_sock.getsockname())
    sandbox_url = "http://{}:{}".format(*sandbox_sock.getsockname())
    sandbox_app = create_app(
        SandboxConfig(api_key="sk_e2e", webhook_secrets=(SECRET,), public_url=sandbox_url, seed=7)
    )
    adapter = SandboxAdapter(
        base_url=sandbox_url, api_key="sk_e2e", webhook_secrets=versioned((SECRET,)),
        public_url=gateway_url,
    )  # fmt: skip
    writer = InboxWriter(db)
    writer.start()
    gateway_app = Starlette(routes=callback_routes(CallbackConfig(), {"sandbox": adapter}, writer))
    sandbox = await run_app(sandbox_app, sandbox_sock)
    gateway = await run_app(gateway_app, gateway_sock)
    processor = InboxProcessor(db, StateService(db), {"sandbox": adapter}, config)
    stopping = asyncio.Event()
    loop = asyncio.create_task(processor.run(stopping))
    admin = httpx.AsyncClient(base_url=sandbox_url, headers={"Authorization": "Bearer sk_e2e"})
    try:
        yield adapter, processor, admin
    finally:
        stopping.set()
        await loop
        await admin.aclose()
        await gateway.stop()
        await sandbox.stop()
        await writer.close()
        await adapter.aclose()


async def submit(env: Env, adapter: SandboxAdapter, outcome: str) -> uuid.UUID:
    """What the submitter does: submit with the attempt's client_request_id, record the id."""
    task_id, attempt_id, crid = await env.task(provider_task_id=None)
    result = await adapter.submit(
        SubmitRequest(
            client_request_id=crid,
            model="m1",
            prompt="a cat",
            params={
                "sandbox": {"outcome": outcome, "queue_s": 0.05, "duration_s": 0.3, "steps": 3}
            },
            webhook_url=adapter.webhook_url_for(str(attempt_id)),
        )
    )
    async with env.db.connection() as conn:
        await conn.execute(
            "UPDATE task_attempts SET provider_task_id = $2 "
            "WHERE id = $1 AND provider_task_id IS NULL",
            attempt_id,
            result.provider_task_id,
        )
    return task_id


async def test_end_to_end_with_the_real_sandbox_provider(env: Env) -> None:
    async with live_stack(env.db) as (adapter, _, admin):
        task_id = await submit(env, adapter, "succeeded")

        async def done() -> bool:
            return await env.status(task_id) == "provider_succeeded"

        await eventually(done, "the task provider_succeeded", 20)

        # chaos: duplicates, reordering, delays, forged copies, callbacks before the submit response
        chaos = {
            "duplicate_rate": 1.0, "reorder": 0.5, "delay_ms": [0, 50],
            "forge_signature_rate": 0.3, "callback_before_submit_response": 0.5,
        }  # fmt: skip
        assert (await admin.put("/_sandbox/chaos", json=chaos)).status_code == 200
        outcomes = ["succeeded", "failed", "canceled", "succeeded", "failed", "succeeded"]
        expected = {"succeeded": "provider_succeeded", "failed": "failed", "canceled": "canceled"}
        task_ids = [await submit(env, adapter, outcome) for outcome in outcomes]

        async def all_final() -> bool:
            return [await env.status(t) for t in task_ids] == [expected[o] for o in outcomes]

        await eventually(all_final, "every task final", 30)
        stats = (await admin.get("/_sandbox/stats")).json()
        assert stats["webhooks"].get("forged_accepted", 0) == 0
        assert stats["webhooks"].get("duplicated", 0) > 0
    async with env.db.connection() as conn:
        statuses = await conn.fetch(
            "SELECT process_status, count(*) FROM provider_callback_inbox GROUP BY 1"
        )
    assert {r["process_status"] for r in statuses} == {"processed"}


@pytest.mark.parametrize("confirm", [False, True])
async def test_a_terminal_that_contradicts_the_providers_record_is_confirmed_first(
    env: Env, confirm: bool
) -> None:
    """The generation succeeded but its webhook was lost (webhooks off), and then the provider
    signs a ``failed`` with the next sequence (its contradictory_terminal chaos). Believed as
    it comes, the task fails; with ``confirm_terminals`` the processor asks for the record first
    and the task follows it to ``provider_succeeded``."""
    config = replace(FAST, confirm_terminals=confirm)
    async with live_stack(env.db, config) as (adapter, _, admin):
        await admin.put("/_sandbox/chaos", json={"webhooks_enabled": False})
        task_id = await submit(env, adapter, "succeeded")
        async with env.db.connection() as conn:
            gen, crid = await conn.fetchrow(
                "SELECT a.provider_task_id, a.client_request_id FROM task_attempts a"
                " JOIN generation_tasks t ON t.current_attempt_id = a.id WHERE t.id = $1",
                task_id,
            )

        async def record() -> dict[str, Any] | None:
            found: dict[str, Any] = (await admin.get(f"/v1/generations/{gen}")).json()
            return found if found["status"] == "succeeded" else None

        stored = await eventually(record, "the generation succeeded")
        contradiction = generation(gen, "failed", stored["sequence"] + 1, crid)
        assert (await env.post_sandbox(contradiction)).status_code == 204

        async def processed() -> bool:
            return {r["process_status"] for r in await env.inbox()} == {"processed"}

        await eventually(processed, "the callback processed")
    assert await env.status(task_id) == ("provider_succeeded" if confirm else "failed")


# --- handed over in memory (aivedio.db.handoff) ----------------------------------------------


@pytest.fixture
async def handed(env: Env) -> AsyncIterator[tuple[Env, Handoff]]:
    """The env with its callbacks stored by a group commit that hands them to a processor of
    the same process, as ``aivedio run --role all`` wires them."""
    handoff = Handoff()
    writer = InboxWriter(env.db, handoff=handoff)
    writer.start()
    app = Starlette(
        routes=callback_routes(CallbackConfig(), callback_providers(env.adapters), writer)
    )
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as client:
            yield replace(env, client=client), handoff
    finally:
        await writer.close()


def handed_processor(
    env: Env, handoff: Handoff, seen: list[int], poll_s: float = FAST.poll_s
) -> InboxProcessor:
    config = replace(FAST, poll_s=poll_s)
    return InboxProcessor(
        env.db, CountingState(env.db, seen), env.adapters, config, handoff=handoff
    )


async def test_handed_rows_are_stored_leased_and_applied_without_a_claim(
    handed: tuple[Env, Handoff],
) -> None:
    env, handoff = handed
    task_id, _, _ = await env.task(provider_task_id="gen_h")
    token = handoff.attach(FAST.lease_s)
    assert (await env.post_sandbox(generation("gen_h", "running", 2))).status_code == 204
    (row,) = await env.inbox()
    assert row["lease_token"] == token and row["process_status"] == "pending"
    assert len(handoff) == 1
    assert await drain(env.processor()) == 0  # leased: no other processor can claim it
    seen: list[int] = []
    assert await handed_processor(env, handoff, seen).process_once() == 1
    assert seen == [row["id"]] and len(handoff) == 0
    assert await env.status(task_id) == "running"
    (row,) = await env.inbox()
    assert row["process_status"] == "processed" and row["lease_token"] is None


async def test_a_handoff_that_is_behind_sends_new_rows_to_the_table(
    handed: tuple[Env, Handoff],
) -> None:
    env, handoff = handed
    handoff.max_rows = 1
    first, _, _ = await env.task(provider_task_id="gen_b1")
    second, _, _ = await env.task(provider_task_id="gen_b2")
    handoff.attach(FAST.lease_s)
    await env.post_sandbox(generation("gen_b1", "running", 2))
    await env.post_sandbox(generation("gen_b2", "running", 2))
    leased, unleased = await env.inbox()
    assert leased["lease_token"] is not None and unleased["lease_token"] is None
    assert await drain(env.processor()) == 1  # the unleased one, by an ordinary claim
    assert await env.status(second) == "running" and await env.status(first) == "created"


async def test_rows_stored_in_the_table_while_behind_are_claimed_at_the_next_round(
    handed: tuple[Env, Handoff],
) -> None:
    env, handoff = handed
    handoff.max_rows = 1
    first, _, _ = await env.task(provider_task_id="gen_n1")
    second, _, _ = await env.task(provider_task_id="gen_n2")
    third, _, _ = await env.task(provider_task_id="gen_n3")
    seen: list[int] = []
    # Its own next look at the table (poll_s) is not in this test.
    processor = handed_processor(env, handoff, seen, poll_s=3600.0)
    handoff.attach(FAST.lease_s)
    await env.post_sandbox(generation("gen_n1", "running", 2))
    assert await processor.process_once() == 1  # handed; the table was empty
    await env.post_sandbox(generation("gen_n2", "running", 2))  # handed
    await env.post_sandbox(generation("gen_n3", "running", 2))  # behind: to the table
    assert await processor.process_once() == 2  # the handed row, then a claim of the other
    assert [await env.status(t) for t in (first, second, third)] == ["running"] * 3
    assert not handoff.claim_wanted()


async def test_with_a_handoff_the_table_is_claimed_only_when_it_may_hold_rows(
    handed: tuple[Env, Handoff],
) -> None:
    env, handoff = handed
    other, _, _ = await env.task(provider_task_id="gen_t1")
    mine, _, _ = await env.task(provider_task_id="gen_t2")
    seen: list[int] = []
    # Its own next look at the table (poll_s) is not in this test.
    processor = handed_processor(env, handoff, seen, poll_s=3600.0)
    handoff.attach(FAST.lease_s)
    assert await processor.process_once() == 0  # an empty claim: the next one is due in poll_s
    handoff.max_rows = 0  # a row stored unleased, as another process's group commit stores it
    await env.post_sandbox(generation("gen_t1", "running", 2))
    assert handoff.claim_wanted()  # this process's writer says so: another's would not
    handoff.max_rows = 256
    await env.post_sandbox(generation("gen_t2", "running", 2))  # handed
    assert await processor.process_once() == 1  # the handed row; no claim after it
    assert await processor.process_once() == 0  # nothing says the table holds rows
    assert await env.status(other) == "created" and await env.status(mine) == "running"
    try:
        # The sleep's re-check finds the row (poll_s is an hour; the bound names a hang).
        await asyncio.wait_for(processor.idle.sleep(asyncio.Event()), 20)
        assert processor.idle.waits == 0
        assert await processor.process_once() == 1  # so the next round claims it
    finally:
        await processor.idle.close()
    assert await env.status(other) == "running"


async def test_a_processor_with_a_handoff_asleep_applies_another_process_s_callback(
    env: Env,
) -> None:
    seen: list[int] = []
    # Fed by nothing: its rows would come in memory; env's writer is another process's, whose
    # row is stored unleased and notifies. run() attaches the handoff.
    await applied_while_asleep(env, handed_processor(env, Handoff(), seen, poll_s=3600.0), "gen_x")
    assert len(seen) == 1


async def test_rows_of_a_detached_processor_stay_in_the_table(
    handed: tuple[Env, Handoff],
) -> None:
    env, handoff = handed
    task_id, _, _ = await env.task(provider_task_id="gen_d")
    await env.post_sandbox(generation("gen_d", "queued", 1))  # no processor attached
    (row,) = await env.inbox()
    assert row["lease_token"] is None and len(handoff) == 0
    assert await drain(env.processor()) == 1
    assert await env.status(task_id) == "provider_queued"


async def test_a_stopping_processor_gives_back_the_leases_of_rows_it_never_took(
    handed: tuple[Env, Handoff],
) -> None:
    env, handoff = handed
    task_id, _, _ = await env.task(provider_task_id="gen_g")
    seen: list[int] = []
    processor = handed_processor(env, handoff, seen)
    handoff.attach(FAST.lease_s)  # what run() does when it starts
    await env.post_sandbox(generation("gen_g", "running", 2))
    assert len(handoff) == 1
    await processor._give_back()  # what run() does when it stops
    (row,) = await env.inbox()
    assert row["lease_token"] is None and row["lease_until"] is None and seen == []
    assert await drain(env.processor()) == 1  # claimable at once, not after the lease
    assert await env.status(task_id) == "running"


async def test_a_handed_row_taken_over_after_its_lease_ran_out_is_applied_once(
    handed: tuple[Env, Handoff],
) -> None:
    env, handoff = handed
    task_id, _, _ = await env.task(provider_task_id="gen_o")
    handoff.attach(FAST.lease_s)
    await env.post_sandbox(generation("gen_o", "running", 2))
    async with env.db.connection() as conn:  # the processor stalled past its lease
        await conn.execute(
            "UPDATE provider_callback_inbox SET lease_until = now() - interval '1 s'"
        )
    seen: list[int] = []
    assert await drain(env.processor(state=CountingState(env.db, seen))) == 1
    late = handed_processor(env, handoff, seen)
    assert await late.process_once() == 1  # it takes the row from memory, then its take fails
    (row,) = await env.inbox()
    assert seen == [row["id"]]  # applied once, by the processor that took it over
    assert await env.status(task_id) == "running"


async def test_a_processor_with_handed_rows_still_claims_the_table(
    handed: tuple[Env, Handoff],
) -> None:
    env, handoff = handed
    table_task, _, _ = await env.task(provider_task_id="gen_t1")
    handed_task, _, _ = await env.task(provider_task_id="gen_t2")
    await env.post_sandbox(generation("gen_t1", "running", 2))  # stored before any processor
    handoff.attach(FAST.lease_s)
    await env.post_sandbox(generation("gen_t2", "running", 2))
    seen: list[int] = []
    assert await handed_processor(env, handoff, seen).process_once() == 2
    assert await env.status(table_task) == "running"
    assert await env.status(handed_task) == "running"


async def test_an_apply_notifies_no_relay_while_its_process_s_relay_listens(env: Env) -> None:
    """While an outbox relay of the processor's process listens to its signal, the apply
    transaction says so to the outbox trigger, which sends no NOTIFY: that relay is kicked in
    memory, and a notification would wake every other relay for rows that are not theirs
    (migration 0018). Without a listener the rows notify, as any writer's."""
    for n, listens in enumerate((True, False)):
        await env.task(provider_task_id=f"gen_quiet_{n}")
        kicks: list[int] = []
        applied = Signal()
        if listens:
            applied.subscribe(functools.partial(kicks.append, 1))
        processor = InboxProcessor(env.db, env.state, env.adapters, FAST, applied=applied)
        async with notifications(env.db, relay.NOTIFY_CHANNEL, relay.IDLE_LOCK) as sent:
            response = await env.post_sandbox(generation(f"gen_quiet_{n}", "running", 2))
            assert response.status_code == 204
            assert await drain(processor) == 1
            assert await sent.count() == (0 if listens else 1)
        assert kicks == ([1] if listens else [])
