"""Every role rides out a restart of its servers: PostgreSQL, Valkey or NATS SIGKILLed under load
and started again, with every role of ``aivedio run --role all`` in this process. The process
never stops, no loop is restarted by its supervisor (each outage is caught where it happens and
waited out), ``/readyz`` names the roles that are down meanwhile (and callbacks are answered 503
while PostgreSQL is away, the API 503 with Retry-After), and afterwards every role does its work
again: tasks created after the restart go all the way to ``ready`` on the SSE stream, with their
asset and their billing (submitter, callbacks, inbox, relay, dispatcher, gateway, media,
billing; the poller and the reconciler run their rounds again).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook

from aivedio.process.health import LoopState
from tests.chaos.outages import (
    Kind,
    PrivateServers,
    Stack,
    all_roles,
    private_servers,
    restart_counts,
)
from tests.integration.helpers import Project, make_project
from tests.waiting import eventually

QUICK = {"sandbox": {"queue_s": 0.05, "duration_s": 0.3, "steps": 2}}


@pytest.fixture(scope="module")
def servers() -> Iterator[PrivateServers]:
    with private_servers() as started:
        yield started


class Load:
    """Creates a task every ``every_s`` through the API for as long as it runs, retrying a 503
    with the same Idempotency-Key as a client should; remembers every task it got a 202 for."""

    def __init__(self, stack: Stack, project: Project, every_s: float = 0.5) -> None:
        self.stack = stack
        self.project = project
        self.every_s = every_s
        self.accepted: list[str] = []
        self.unavailable = 0
        self.other: list[int] = []
        self._stop = asyncio.Event()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.project.api_key}"}

    async def create(self, key: str | None = None) -> str:
        """One task, retried until accepted; its id."""
        key = key or uuid.uuid4().hex
        url = f"/v1/projects/{self.project.project_id}/tasks"
        body = {"provider": "sandbox", "model": "m", "prompt": "p", "params": QUICK}
        while True:
            try:
                r = await self.stack.client.post(
                    url, json=body, headers=self.headers | {"Idempotency-Key": key}
                )
            except httpx.HTTPError:
                r = None
            if r is not None and r.status_code == 202:
                task_id: str = r.json()["task"]["id"]
                return task_id
            if r is not None and r.status_code == 503:
                self.unavailable += 1
                assert r.headers["retry-after"].isdigit()
            elif r is not None:
                self.other.append(r.status_code)
            await asyncio.sleep(0.1)

    async def run(self) -> None:
        while not self._stop.is_set():
            self.accepted.append(await self.create())
            await asyncio.sleep(self.every_s)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Load]:
        job = asyncio.create_task(self.run())
        try:
            yield self
        finally:
            self._stop.set()
            await asyncio.wait_for(job, 60)

    async def task(self, task_id: str) -> dict[str, Any]:
        r = await self.stack.client.get(
            f"/v1/projects/{self.project.project_id}/tasks/{task_id}", headers=self.headers
        )
        assert r.status_code == 200, r.text
        task: dict[str, Any] = r.json()["task"]
        return task

    async def not_ready(self, task_ids: list[str]) -> list[dict[str, Any]]:
        """The tasks of ``task_ids`` not ``ready`` yet, as the database holds them."""
        async with self.stack.rt.db.connection() as conn:
            rows = await conn.fetch(
                "SELECT t.id, t.status, t.stage, t.version, t.updated_at, now() AS now,"
                " a.provider_task_id, a.provider_status, a.next_poll_at, a.poll_failures,"
                " a.poll_lease_until, i.state AS intent, i.tries, i.next_attempt_at,"
                " i.lease_until, i.last_error_code"
                " FROM generation_tasks t"
                " LEFT JOIN task_attempts a ON a.id = t.current_attempt_id"
                " LEFT JOIN submit_intents i ON i.attempt_id = t.current_attempt_id"
                " WHERE t.id = ANY($1::uuid[]) AND t.status <> 'ready'",
                task_ids,
            )
        return [dict(r) for r in rows]

    async def all_ready(self, task_ids: list[str]) -> bool:
        for task_id in task_ids:
            if (await self.task(task_id))["status"] != "ready":
                return False
        return True


async def ledger_entries(stack: Stack, task_id: str) -> list[str]:
    async with stack.rt.db.connection() as conn:
        rows = await conn.fetch(
            "SELECT ledger_type FROM credit_ledger WHERE task_id = $1 ORDER BY id",
            uuid.UUID(task_id),
        )
    return [str(r["ledger_type"]) for r in rows]


class Events:
    """The project's SSE stream, read in the background (resumed by Last-Event-ID like a
    browser when the connection drops)."""

    def __init__(self, stack: Stack, project: Project) -> None:
        self.stack = stack
        self.project = project
        self.seen: list[dict[str, Any]] = []
        self.last_id: str | None = None

    def statuses(self, task_id: str) -> list[str]:
        return [e["status"] for e in self.seen if e["task_id"] == task_id]

    async def run(self) -> None:
        url = f"{self.stack.base}/v1/projects/{self.project.project_id}/events"
        while True:
            headers = {"Authorization": f"Bearer {self.project.api_key}"}
            if self.last_id:
                headers["Last-Event-ID"] = self.last_id
            try:
                async with (
                    httpx.AsyncClient(timeout=httpx.Timeout(5, read=30), trust_env=False) as c,
                    c.stream("GET", url, headers=headers) as r,
                ):
                    async for line in r.aiter_lines():
                        if line.startswith("id: "):
                            self.last_id = line[4:]
                        elif line.startswith("data: "):
                            self.seen.append(json.loads(line[6:]))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[Events]:
        job = asyncio.create_task(self.run())
        try:
            yield self
        finally:
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)


def signed_callback(settings_secret: str, body: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """A webhook as the sandbox provider signs it (Standard Webhooks)."""
    msg_id = f"msg_{uuid.uuid4().hex}"
    now = datetime.now(UTC)
    raw = json.dumps(body).encode()
    signature = Webhook(settings_secret).sign(msg_id, now, raw.decode())
    headers = {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
    }
    return raw, headers


async def post_callback(stack: Stack) -> int:
    """A signed callback for a job nobody knows (stored as an orphan): its status code."""
    job = {"id": f"gen_{uuid.uuid4().hex[:12]}", "status": "running", "progress": 10}
    body, headers = signed_callback(
        stack.rt.settings.sandbox_webhook_secrets.split(",")[0],
        {"type": "generation.updated", "data": job | {"sequence": 1, "metadata": {}}},
    )
    r = await stack.client.post("/v1/callbacks/sandbox", content=body, headers=headers)
    return r.status_code


# What each server's outage takes down, as /readyz names it: the roles with a loop that uses it
# every second or so (the reconciler's rounds are 30 s apart; it reports at its next round).
DOWN_WITH = {
    "postgres": {"inbox", "relay", "poller", "submitter", "media", "gateway"},
    "valkey": {"dispatcher", "gateway"},
    "nats": {"relay", "dispatcher", "media", "billing"},
}
DEPENDENCY = {"postgres": "database", "valkey": "redis", "nats": "bus"}


@pytest.mark.parametrize("kind", ["postgres", "valkey", "nats"])
async def test_every_role_rides_out_a_restart_of_its_server(
    servers: PrivateServers, tmp_path: Path, kind: Kind
) -> None:
    async with all_roles(servers, tmp_path) as stack:
        project = await make_project(stack.rt.db)
        load = Load(stack, project)
        before = restart_counts()
        async with Events(stack, project).reading() as events, load.running():
            first = await load.create()
            await eventually(lambda: load.all_ready([first]), "a task before the fault")
            assert await post_callback(stack) == 204

            await asyncio.to_thread(servers.kill, kind)

            async def names_the_roles() -> bool:
                r = await stack.readyz()
                return r.status_code == 503 and DOWN_WITH[kind] <= set(r.json()["roles_down"])

            await eventually(names_the_roles, f"/readyz naming the roles {kind} takes down")
            down = stack.rt.health.down()
            assert {u.dependency for u in down} == {DEPENDENCY[kind]}, [u.as_dict() for u in down]
            assert all(u.state is LoopState.OUTAGE for u in down)
            if kind == "postgres":
                assert (await stack.readyz()).json()["database"] == "unavailable"
                assert await post_callback(stack) == 503  # never a hang, never a 2xx unstored

            await asyncio.to_thread(servers.restart, kind)

            async def ready_again() -> bool:
                return (await stack.readyz()).status_code == 200

            await eventually(ready_again, "/readyz back to 200")
            assert await post_callback(stack) == 204
            after = [await load.create() for _ in range(3)]
            await eventually(lambda: load.all_ready(after), "tasks created after the restart")
            for task_id in after:
                await eventually(
                    lambda t=task_id: _ready_on_the_stream(events, t),  # type: ignore[misc]
                    f"the ready event of {task_id} on the stream",
                )

        # The load's tasks, accepted before, during and after the outage, all converge.
        try:
            await eventually(lambda: load.all_ready(load.accepted), "every accepted task")
        except AssertionError as timed_out:
            raise AssertionError(await load.not_ready(load.accepted)) from timed_out
        assert load.other == []
        if kind == "postgres":
            assert load.unavailable > 0  # the API answered 503 + Retry-After meanwhile
        for task_id in after:
            assert (await load.task(task_id))["asset"] is not None
            await eventually(
                lambda t=task_id: _settled(stack, t),  # type: ignore[misc]
                f"billing settled {task_id}",
            )
        await eventually(lambda: _all_running(stack), "every loop running again")
        assert restart_counts() == before, "a loop failed instead of waiting the outage out"


async def _ready_on_the_stream(events: Events, task_id: str) -> bool:
    return "ready" in events.statuses(task_id)


async def _all_running(stack: Stack) -> bool:
    return stack.down() == {}


async def _settled(stack: Stack, task_id: str) -> bool:
    return "settle" in await ledger_entries(stack, task_id)
