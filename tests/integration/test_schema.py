"""A database migrated to the newest version equals the declared schema (db/schema.sql)."""

from __future__ import annotations

import re
import uuid
from typing import Any

import asyncpg

from aivedio.db.migrate import declared_schema, migrate, migrations
from aivedio.domain.observation import ProviderStatus
from aivedio.domain.statuses import Status
from tests.conftest import with_database

# Partitions (task_events_pYYYYMMDD) depend on the day the schema was made, not on its
# version: the catalogs compare the tables and the partitioned parents only.
NOT_PARTITION = "NOT EXISTS (SELECT 1 FROM pg_class p WHERE p.relname = {} AND p.relispartition)"

CATALOG = {
    "columns": f"""
        SELECT table_name, column_name, data_type, is_nullable, column_default, is_identity
        FROM information_schema.columns WHERE table_schema = 'public'
          AND table_name <> 'schema_migrations' AND {NOT_PARTITION.format("table_name")}
        ORDER BY 1, 2""",
    "constraints": f"""
        SELECT c.conrelid::regclass::text AS tbl, c.conname, c.contype,
               pg_get_constraintdef(c.oid) AS def, c.condeferrable, c.condeferred
        FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
        WHERE n.nspname = 'public' AND c.conrelid::regclass::text <> 'schema_migrations'
          AND {NOT_PARTITION.format("c.conrelid::regclass::text")}
        ORDER BY 1, 2""",
    "indexes": f"""
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'public' AND tablename <> 'schema_migrations'
          AND {NOT_PARTITION.format("tablename")}
        ORDER BY 1, 2""",
    "partitioned": """
        SELECT c.relname, pg_get_partkeydef(c.oid) FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind = 'p' ORDER BY 1""",
}


async def catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    conn = await asyncpg.connect(url)
    try:
        return {k: [tuple(r.values()) for r in await conn.fetch(sql)] for k, sql in CATALOG.items()}
    finally:
        await conn.close()


async def test_migrations_equal_declared_schema(admin_database_url: str) -> None:
    names = [f"aivedio_m_{uuid.uuid4().hex[:8]}", f"aivedio_d_{uuid.uuid4().hex[:8]}"]
    admin = await asyncpg.connect(admin_database_url)
    try:
        for name in names:
            await admin.execute(f'CREATE DATABASE "{name}"')
        migrated_url, declared_url = (with_database(admin_database_url, n) for n in names)
        conn = await asyncpg.connect(migrated_url)
        try:
            assert await migrate(conn) == [m.version for m in migrations()]
            assert await migrate(conn) == []  # idempotent
        finally:
            await conn.close()
        conn = await asyncpg.connect(declared_url)
        try:
            await conn.execute(declared_schema())
        finally:
            await conn.close()
        assert await catalog(migrated_url) == await catalog(declared_url)
    finally:
        for name in names:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def _check_values(constraint: str) -> set[str]:
    sql = declared_schema()
    body = sql[sql.index(constraint) :]
    body = body[: body.index("))")]
    return set(re.findall(r"'(\w+)'", body))


def test_status_check_constraint_lists_exactly_the_status_table() -> None:
    assert _check_values("ck_task_status") == {s.value for s in Status}


def test_attempt_check_constraint_lists_exactly_the_provider_statuses() -> None:
    assert _check_values("ck_attempt_provider_status") == {s.value for s in ProviderStatus}
