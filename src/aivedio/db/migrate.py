"""Versioned migrations: ``db/migrations/NNNN_name.sql``, applied in order, each in its own
transaction, under an advisory lock so that concurrent ``aivedio migrate`` runs are safe."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

import asyncpg

_LOCK_KEY = 0x41495645  # "AIVE"


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def migrations() -> list[Migration]:
    folder = resources.files("aivedio.db") / "migrations"
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            number, _, rest = entry.name.partition("_")
            found.append(
                Migration(int(number), rest.removesuffix(".sql"), entry.read_text("utf-8"))
            )
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise ValueError(f"two migrations share a version: {versions}")
    return found


def declared_schema() -> str:
    return (resources.files("aivedio.db") / "schema.sql").read_text("utf-8")


async def migrate(conn: asyncpg.Connection, upto: int | None = None) -> list[int]:
    """Apply every pending migration (up to version ``upto``, when given: tests that convert an
    older database); return the versions applied. Idempotent."""
    await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
    try:
        await conn.execute(
            """CREATE TABLE IF NOT EXISTS schema_migrations (
                   version     INTEGER     PRIMARY KEY,
                   name        TEXT        NOT NULL,
                   checksum    TEXT        NOT NULL,
                   applied_at  TIMESTAMPTZ NOT NULL DEFAULT now())"""
        )
        rows = await conn.fetch("SELECT version, checksum FROM schema_migrations")
        done = {r["version"]: r["checksum"] for r in rows}
        applied = []
        newest = max(done, default=0)
        for m in migrations():
            if upto is not None and m.version > upto:
                break
            if m.version in done:
                if done[m.version] != m.checksum:
                    raise RuntimeError(
                        f"migration {m.version} ({m.name}) changed after it was applied"
                    )
                continue
            if m.version < newest:
                raise RuntimeError(
                    f"migration {m.version} ({m.name}) is older than the applied {newest}: "
                    "migrations must land in version order"
                )
            async with conn.transaction():
                await conn.execute(m.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    m.version,
                    m.name,
                    m.checksum,
                )
            applied.append(m.version)
        return applied
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
