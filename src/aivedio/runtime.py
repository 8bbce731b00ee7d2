"""What every role of a process shares: resolved service URLs, the pool, the state service."""

from __future__ import annotations

from dataclasses import dataclass, field

import asyncpg

from aivedio.config import Settings
from aivedio.db.handoff import Handoff
from aivedio.db.migrate import migrations
from aivedio.db.pool import Database
from aivedio.db.wakeup import Signal
from aivedio.errors import ConfigError
from aivedio.process.health import Health
from aivedio.services import embedded
from aivedio.services.embedded import ServiceUrls
from aivedio.state.service import StateService
from aivedio.state.tasks import TaskStore


class NotMigrated(ConfigError):
    """The database schema is older than this code; run ``aivedio migrate``."""


def resolve_urls(settings: Settings) -> ServiceUrls:
    """Configured URLs as they are; the embedded servers for the ones that are not set."""
    if settings.database_url and settings.redis_url and settings.nats_url:
        return ServiceUrls(settings.database_url, settings.redis_url, settings.nats_url)
    return embedded.up(settings.services)


async def check_schema(db: Database) -> None:
    newest = migrations()[-1].version
    async with db.connection() as conn:
        try:
            current = await conn.fetchval("SELECT max(version) FROM schema_migrations")
        except asyncpg.UndefinedTableError:
            current = None
    if current is None or current < newest:
        raise NotMigrated(f"schema version {current}, code needs {newest}: run `aivedio migrate`")


@dataclass
class Wakeups:
    """The in-process wake-ups between the roles of one process (aivedio.db.wakeup)."""

    inbox: Signal = field(default_factory=Signal)
    """Fired by the callbacks' group commit after it stored new callbacks."""
    inbox_rows: Handoff = field(default_factory=Handoff)
    """The callbacks' group commit hands its new rows, leased, to the inbox processor of the
    process, when there is one (aivedio.db.handoff)."""
    outbox: Signal = field(default_factory=Signal)
    """Fired after a commit that wrote outbox rows (the inbox processor's batches)."""


@dataclass
class Runtime:
    settings: Settings
    urls: ServiceUrls
    db: Database
    state: StateService
    tasks: TaskStore
    wakeups: Wakeups = field(default_factory=Wakeups)
    health: Health = field(default_factory=Health)
    """The health of this process's role loops (``/readyz``)."""

    @classmethod
    async def open(cls, settings: Settings, urls: ServiceUrls) -> Runtime:
        db = await Database.connect(settings.database(urls.database_url))
        try:
            await check_schema(db)
        except BaseException:
            await db.close()
            raise
        state = StateService(db, settings.state)
        tasks = TaskStore(db, state, settings.api.idempotency_ttl)
        return cls(settings, urls, db, state, tasks)

    async def close(self) -> None:
        await self.db.close()
