"""The batch statements find a batch's rows by primary key, not by a seq scan of a small table.

The planner estimates 10 rows for an ``unnest`` of parameters; joined with a table of a few
hundred rows it hashed a seq scan of the whole table, every batch (issue 11: at 500/s in
``bench e2e``, 1,673 seq scans of ``generation_tasks`` reading 1,044,989 tuples in 10 s). Each
statement is planned here as asyncpg runs it after its first executions: a generic plan. The
probes of ``attempts_for_callbacks`` and ``locked_attempts`` (``LATERAL ... LIMIT 1``) hold for
any size; ``write_events``' ``= ANY (ARRAY(...))`` is the planner's choice by cost, and its
generic plan still scans a table of 700 tasks (in ``bench e2e`` it probed: 6 seq scans of
``generation_tasks`` in 10 s at 500/s, not 1,673), so it is not asserted here.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from aivedio.db.pool import Database
from aivedio.db.queries import q
from tests.integration.helpers import make_project, make_task, store

TASKS = 700  # about the bench's one-project table (658 tasks), where the seq scans were


async def _generic_plan(db: Database, sql: str) -> str:
    params = {int(n) for n in re.findall(r"\$(\d+)", sql)}
    nulls = ", ".join("NULL" for _ in range(max(params)))
    async with db.connection() as conn, conn.transaction():
        await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        await conn.execute(f"PREPARE batch_plan AS {sql}")
        rows = await conn.fetch(f"EXPLAIN EXECUTE batch_plan({nulls})")
        await conn.execute("DEALLOCATE batch_plan")
    return "\n".join(r[0] for r in rows)


@pytest.fixture
async def tasks_in_table(db: Database) -> None:
    project = await make_project(db)
    tasks = store(db)
    for start in range(0, TASKS, 50):
        await asyncio.gather(*(make_task(tasks, project) for _ in range(start, start + 50)))
    async with db.connection() as conn:
        await conn.execute("ANALYZE generation_tasks, task_attempts")


@pytest.mark.usefixtures("tasks_in_table")
@pytest.mark.parametrize(
    ("name", "table"),
    [
        ("attempts_for_callbacks", "generation_tasks"),
        ("locked_attempts", "generation_tasks"),
    ],
)
async def test_a_batch_statement_probes_a_table_by_key(db: Database, name: str, table: str) -> None:
    plan = await _generic_plan(db, q(name))
    assert table in plan  # the statement reads the table at all
    assert f"Seq Scan on {table}" not in plan, plan
