"""``bench e2e``'s per-statement figures (``aivedio.bench.pg_statements``) on real PostgreSQL:
the embedded server keeps them; a server without the library gives none and no error."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg

from aivedio.bench import pg_statements
from aivedio.config import ServicesConfig
from aivedio.db.migrate import migrate
from aivedio.db.queries import q
from aivedio.propagation.relay import mark_published_and_commit
from aivedio.services import embedded


async def test_the_embedded_server_names_and_counts_each_statement_of_a_step(
    tmp_path: Path, redis_url: str, nats_url: str
) -> None:
    cfg = ServicesConfig(tmp_path / "services", None, redis_url, nats_url)
    try:
        urls = await asyncio.to_thread(embedded.up, cfg)
        conn = await asyncpg.connect(urls.database_url)
        try:
            await migrate(conn)
            before = await pg_statements.snapshot(conn)
            assert before is not None
            for _ in range(3):
                await conn.fetchrow(q("outbox_stats"))
            for _ in range(2):  # literals in its text: pg_stat_statements shows them as $n
                await conn.fetchval(q("inbox_has_work"))
            await conn.execute("BEGIN")  # the relay's mark and COMMIT: one simple query
            await conn.execute(mark_published_and_commit([1, 2]))
            after = await pg_statements.snapshot(conn)
        finally:
            await conn.close()
    finally:
        await asyncio.to_thread(embedded.down, cfg)
    assert after is not None
    calls = {s.name: s.calls for s in pg_statements.between(before, after)}
    assert calls["outbox_stats"] == 3
    assert calls["inbox_has_work"] == 2
    assert calls["outbox_mark_published"] == 1  # its array literal is shown as $1
    assert "migrate" not in calls  # before the first snapshot


async def test_a_server_without_the_library_gives_no_figures(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        preload = str(await conn.fetchval("SHOW shared_preload_libraries"))
        loaded = "pg_stat_statements" in preload
        found = await pg_statements.snapshot(conn)
        assert (found is not None) == loaded
        assert await conn.fetchval("SELECT 1") == 1  # the session is still usable
    finally:
        await conn.close()


def test_statement_names_survive_the_normalization() -> None:
    shown = (
        "-- Could inbox_claim return a row now\nSELECT EXISTS (\n    SELECT $4 FROM "
        "provider_callback_inbox\n    WHERE process_status IN ($1, $2, $3)\n      AND "
        "(next_retry_at IS NULL OR next_retry_at <= now())\n      AND (lease_until IS NULL "
        "OR lease_until < now())\n)"
    )
    assert pg_statements.name_of(shown) == "inbox_has_work"
    squashed = shown.replace("IN ($1, $2, $3)", "IN ($1 /*, ... */)")  # PostgreSQL 18
    assert pg_statements.name_of(squashed) == "inbox_has_work"
    assert pg_statements.name_of(shown.replace("lease_until <", "lease_until >")) != (
        "inbox_has_work"
    )
    assert pg_statements.name_of("BEGIN ISOLATION LEVEL READ COMMITTED") == (
        "BEGIN ISOLATION LEVEL READ COMMITTED"
    )
