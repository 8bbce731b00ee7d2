"""Shared fixtures: real PostgreSQL, Redis and NATS.

URLs come from ``AIVEDIO_DATABASE_URL`` / ``AIVEDIO_REDIS_URL`` / ``AIVEDIO_NATS_URL``; where one is
missing the embedded servers are started (``aivedio services up``) in ``.aivedio/test-services``.
PostgreSQL: the migrations run once per session into a template database; every test that asks
for ``database_url`` gets a fresh database cloned from it (procrastinate's habit).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from aivedio.config import DatabaseConfig, ServicesConfig
from aivedio.db.migrate import migrate
from aivedio.db.pool import Database

ROOT = Path(__file__).resolve().parent.parent


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


# Every aivedio process a test starts (demo, run, cluster, browser tests) uses a JetStream stream
# and subject prefix of this session: sessions of other checkouts on the same NATS server must not
# share durable consumer groups with ours (a `media` group shared with another session's demo took
# our events to a process with another database).
SESSION_BUS = f"T{os.getpid()}_{uuid.uuid4().hex[:6]}"
os.environ.setdefault("AIVEDIO_BUS_STREAM", f"AIVEDIO_{SESSION_BUS}")
os.environ.setdefault("AIVEDIO_BUS_SUBJECT_PREFIX", f"aivedio-{SESSION_BUS.lower()}")


@pytest.fixture(scope="session", autouse=True)
def session_bus_streams(service_urls: dict[str, str]) -> Iterator[None]:
    """Delete this session's streams from the NATS server at the end."""
    yield
    import nats

    async def delete() -> None:
        nc = await nats.connect(servers=[service_urls["nats_url"]], connect_timeout=2)
        try:
            js = nc.jetstream()
            for name in (
                os.environ["AIVEDIO_BUS_STREAM"],
                os.environ["AIVEDIO_BUS_STREAM"] + "_DLQ",
            ):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await js.delete_stream(name)
        finally:
            await nc.close()

    with contextlib.suppress(OSError, nats.errors.Error):  # the server is gone: nothing to clean
        asyncio.run(delete())


@pytest.fixture(scope="session")
def service_urls() -> dict[str, str]:
    urls = {
        "database_url": os.environ.get("AIVEDIO_DATABASE_URL"),
        "redis_url": os.environ.get("AIVEDIO_REDIS_URL"),
        "nats_url": os.environ.get("AIVEDIO_NATS_URL"),
    }
    if all(urls.values()):
        return {k: v for k, v in urls.items() if v}
    from aivedio.services import embedded

    started = embedded.up(
        ServicesConfig(
            data_dir=ROOT / ".aivedio" / "test-services",
            database_url=urls["database_url"],
            redis_url=urls["redis_url"],
            nats_url=urls["nats_url"],
        )
    ).as_dict()
    return {k: str(v) for k, v in started.items()}


@pytest.fixture(scope="session")
def admin_database_url(service_urls: dict[str, str]) -> str:
    return service_urls["database_url"]


@pytest.fixture(scope="session")
def template_database(admin_database_url: str) -> Iterator[str]:
    name = f"aivedio_tpl_{os.getpid()}"

    async def create() -> None:
        conn = await asyncpg.connect(admin_database_url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        conn = await asyncpg.connect(with_database(admin_database_url, name))
        try:
            await migrate(conn)
        finally:
            await conn.close()

    async def drop() -> None:
        conn = await asyncpg.connect(admin_database_url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(create())
    yield name
    asyncio.run(drop())


@pytest.fixture
def database_url(admin_database_url: str, template_database: str) -> Iterator[str]:
    """A fresh, migrated database for this test (sync, so property tests can use it too)."""
    name = f"aivedio_t_{uuid.uuid4().hex[:12]}"

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(admin_database_url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"'))
    yield with_database(admin_database_url, name)
    asyncio.run(run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def database_config(database_url: str) -> DatabaseConfig:
    return DatabaseConfig(url=database_url, min_size=1, max_size=20)


@pytest.fixture
async def db(database_config: DatabaseConfig) -> AsyncIterator[Database]:
    database = await Database.connect(database_config)
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture(scope="session")
def redis_url(service_urls: dict[str, str]) -> str:
    return service_urls["redis_url"]


@pytest.fixture(scope="session")
def nats_url(service_urls: dict[str, str]) -> str:
    return service_urls["nats_url"]
