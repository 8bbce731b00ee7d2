"""Test helpers that create real rows through the real code paths."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from aivedio.admin import create_project_in
from aivedio.db.pool import Database, DatabaseConfig
from aivedio.state.service import StateService
from aivedio.state.tasks import NewTask, Principal, TaskStore
from tests.proxy import TcpProxy


@dataclass(frozen=True)
class Project:
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    principal: Principal
    api_key: str


async def make_project(db: Database, tenant: str = "acme", project: str = "web") -> Project:
    async with db.connection() as conn:
        made = await create_project_in(conn, tenant, project)
    tenant_id = uuid.UUID(made["tenant_id"])
    return Project(
        tenant_id=tenant_id,
        project_id=uuid.UUID(made["project_id"]),
        principal=Principal(tenant_id, uuid.UUID(made["user_id"])),
        api_key=made["api_key"],
    )


def store(db: Database, state: StateService | None = None) -> TaskStore:
    return TaskStore(db, state or StateService(db), timedelta(hours=1))


async def make_task(
    tasks: TaskStore,
    project: Project,
    key: str | None = None,
    trace_id: str | None = None,
    **overrides: Any,
) -> tuple[uuid.UUID, uuid.UUID]:
    """Create a task through the store (under ``trace_id``, when given); return (task id,
    current attempt id)."""
    body = {"provider": "sandbox", "model": "m1", "prompt": "a cat", "params": {}} | overrides
    created = await tasks.create(
        project.principal,
        project.project_id,
        key or uuid.uuid4().hex,
        NewTask(**body),
        trace_id,
    )
    task_id = uuid.UUID(created.snapshot["id"])
    async with tasks.db.connection() as conn:
        attempt_id = await conn.fetchval(
            "SELECT current_attempt_id FROM generation_tasks WHERE id = $1", task_id
        )
    return task_id, attempt_id


@asynccontextmanager
async def database_behind_a_proxy(database_url: str) -> AsyncIterator[tuple[TcpProxy, Database]]:
    """A pool on ``database_url`` through a TCP proxy: ``await proxy.cut()`` takes PostgreSQL
    away from it (every connection reset, new ones refused), ``await proxy.start()`` brings it
    back on the same port."""
    target = urlsplit(database_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    await proxy.start()
    user, _, _ = target.netloc.rpartition("@")
    netloc = f"{user}@127.0.0.1:{proxy.port}" if user else f"127.0.0.1:{proxy.port}"
    url = urlunsplit((target.scheme, netloc, target.path, "", ""))
    db = await Database.connect(
        DatabaseConfig(url=url, min_size=1, max_size=4, acquire_timeout_s=1.0)
    )
    try:
        yield proxy, db
    finally:
        await proxy.cut()
        await db.close()


async def holds_advisory_lock(db: Database, key: int) -> bool:
    """Whether a session of this database holds advisory lock ``key`` (an idle relay or inbox
    processor sleeps on LISTEN holding its idle lock: what makes the triggers notify)."""
    async with db.connection() as conn:
        return bool(
            await conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
                " AND granted AND objid = $1 AND database = (SELECT oid FROM pg_database"
                " WHERE datname = current_database()))",
                key,
            )
        )


class CutAfter:
    """``inner`` (an adapter, a store) with one method wrapped: once its first call that
    ``when(*args)`` accepts has answered, ``proxy`` is cut: the caller holds an answer it can no
    longer write to PostgreSQL. Everything else is ``inner``'s."""

    def __init__(
        self,
        inner: Any,
        method: str,
        proxy: TcpProxy,
        when: Callable[..., bool] = lambda *args: True,
    ) -> None:
        self._inner, self._method, self._proxy, self._when = inner, method, proxy, when
        self.cut = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name != self._method:
            return attr

        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            answer = await attr(*args, **kwargs)
            if not self.cut and self._when(*args):
                self.cut = True
                await self._proxy.cut()
            return answer

        return wrapped


class Notifications:
    """The notifications sent on ``channel`` while a consumer sleeps holding ``lock_key`` (a
    session of this test holds it, as an idle relay or inbox processor would: what makes the
    triggers notify at all)."""

    def __init__(self, listening: Any) -> None:
        self._listening = listening
        self.received: list[str] = []

    def _on_notify(self, *args: Any) -> None:
        self.received.append(str(args[2]))

    async def count(self) -> int:
        """How many arrived for what committed before this call: PostgreSQL sends a session's
        pending notifications before it answers its next statement, and asyncpg calls the
        listener before it hands over that answer."""
        await self._listening.fetchval("SELECT 1")
        return len(self.received)


@asynccontextmanager
async def notifications(db: Database, channel: str, lock_key: int) -> AsyncIterator[Notifications]:
    listening, holding = await db.session(), await db.session()
    try:
        seen = Notifications(listening)
        await listening.add_listener(channel, seen._on_notify)
        await holding.execute("SELECT pg_advisory_lock($1)", lock_key)
        yield seen
    finally:
        await listening.close()
        await holding.close()
