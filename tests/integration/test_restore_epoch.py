"""Restore an older dump: without a new epoch the old cursors would skip (or repeat) events of
the new history; after ``aivedio admin bump-epoch --all`` every old cursor resets instead."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path

import asyncpg

from aivedio.config import DatabaseConfig
from aivedio.db.pool import Database
from tests.conftest import with_database
from tests.integration.test_gateway_harness import Env, EnvFactory, collect, make_env, seqs

__all__ = ["make_env"]


async def run(*argv: str, env: dict[str, str] | None = None) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, (argv, err.decode())
    return out.decode()


async def cursor_after(env: Env, cursor: str) -> tuple[str | None, list[int], str]:
    """Connect with ``cursor``: (the reset's reason or None, replayed seqs, the next cursor)."""
    client = env.client()
    client.view.cursor = cursor
    frames = client.connect_once()
    got = await collect(
        frames, lambda fs: any(f.event in ("reset", "start") for f in fs) or bool(seqs(fs))
    )
    await client.aclose()
    reset = next((f for f in got if f.event == "reset"), None)
    return (reset.data["reason"] if reset else None), seqs(got), (reset.id if reset else "")


async def test_clients_reset_after_a_restore_and_a_new_epoch(
    make_env: EnvFactory, admin_database_url: str, database_url: str, tmp_path: Path
) -> None:
    live = await make_env(publish=False)
    for _ in range(5):
        await live.new_task()
    dump = tmp_path / "aivedio.dump"
    await run("pg_dump", "--format=custom", f"--file={dump}", database_url)
    for _ in range(5):  # written after the backup: lost with the database
        await live.new_task()
    epoch, head = await live.head()
    assert head == 10  # a browser saw everything: its cursor is epoch-10 (another one epoch-8)

    name = f"aivedio_restored_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(admin_database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    restored_url = with_database(admin_database_url, name)
    db = await Database.connect(DatabaseConfig(url=restored_url, min_size=1, max_size=10))
    try:
        await run("pg_restore", "--no-owner", f"--dbname={restored_url}", str(dump))
        restored = await make_env(publish=False, database=db, project=live.project)
        assert await restored.head() == (epoch, 5)

        out = await run(
            sys.executable,
            "-m",
            "aivedio",
            "admin",
            "bump-epoch",
            "--all",
            env={"AIVEDIO_DATABASE_URL": restored_url},
        )
        assert out.strip().splitlines()[-1] == '{"bumped": 1}'
        new_epoch, new_head = await restored.head()
        assert new_epoch > epoch and new_head == 5

        for _ in range(4):  # the new history: seqs 6..9 of the new epoch
            await restored.new_task()
        for old_cursor in (f"{epoch}-10", f"{epoch}-8", f"{epoch}-3"):
            reason, replayed, at = await cursor_after(restored, old_cursor)
            assert reason == "other_epoch", old_cursor  # never a replay of another history
            assert replayed == [] and at == f"{new_epoch}-9"
        # From the reset's cursor (after re-reading the snapshot) the stream is exact.
        client = restored.client()
        client.view.cursor = f"{new_epoch}-5"
        got = await collect(client.connect_once(), lambda fs: len(seqs(fs)) >= 4)
        assert seqs(got) == [6, 7, 8, 9]
        await client.aclose()
    finally:
        await db.close()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
