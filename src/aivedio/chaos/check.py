"""What a chaos run checks at the end: convergence to the provider's truth, the streams' heads and
keys, duplicate side effects."""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
import httpx

from aivedio.chaos import invariants
from aivedio.chaos.config import Created, Run

# -- convergence and invariants -------------------------------------------------------------------


async def _truth(sandbox: httpx.AsyncClient, conn: asyncpg.Connection, task: Created) -> str | None:
    if task.client_request_id is None:
        task.client_request_id = await conn.fetchval(
            "SELECT client_request_id FROM task_attempts WHERE task_id = $1"
            " ORDER BY attempt_no DESC LIMIT 1",
            uuid.UUID(task.task_id),
        )
    if task.client_request_id is None:
        return None
    try:
        found = await sandbox.get(
            "/v1/generations", params={"idempotency_key": task.client_request_id}
        )
    except httpx.HTTPError:
        return None
    data = found.json().get("data") if found.status_code == 200 else None
    return str(data[0]["status"]) if data else None


async def _outcomes(
    run: Run, sandbox: httpx.AsyncClient, conn: asyncpg.Connection
) -> list[invariants.TaskOutcome]:
    rows = {
        str(r["id"]): r
        for r in await conn.fetch(
            "SELECT id, status, version, EXISTS (SELECT 1 FROM reconciliation_items i"
            " WHERE i.task_id = t.id AND i.state = 'open' AND i.kind = 'contradictory_terminal')"
            " AS flagged FROM generation_tasks t WHERE id = ANY($1::uuid[])",
            [uuid.UUID(t.task_id) for t in run.created],
        )
    }
    outcomes = []
    for task in run.created:
        row = rows[task.task_id]
        outcomes.append(
            invariants.TaskOutcome(
                task.task_id,
                task.project_id,
                await _truth(sandbox, conn, task),
                str(row["status"]),
                int(row["version"]),
                bool(row["flagged"]),
            )
        )
    return outcomes


async def _converge(
    run: Run, sandbox: httpx.AsyncClient
) -> tuple[list[invariants.TaskOutcome], float | None]:
    deadline = time.monotonic() + run.config.converge_timeout_s
    conn = await _connect_retrying(run.real_database_url)
    try:
        while True:
            outcomes = await _outcomes(run, sandbox, conn)
            if not invariants.wrong_final_states(outcomes):
                return outcomes, time.monotonic() - run.last_fault_end
            if time.monotonic() > deadline:
                return outcomes, None
            await asyncio.sleep(1.0)
    finally:
        await conn.close()


async def _connect_retrying(url: str) -> asyncpg.Connection:
    for _ in range(120):
        try:
            return await asyncpg.connect(url, timeout=5)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            await asyncio.sleep(0.5)
    return await asyncpg.connect(url, timeout=5)


async def _streams(
    conn: asyncpg.Connection, project_id: str
) -> tuple[int, dict[int, tuple[str, str, str] | None]]:
    head = await conn.fetchval(
        "SELECT head FROM event_streams WHERE project_id = $1", uuid.UUID(project_id)
    )
    keys: dict[int, tuple[str, str, str] | None] = {}
    for r in await conn.fetch(
        "SELECT seq, task_id, public_payload->>'status' AS status,"
        " public_payload->>'stage' AS stage FROM task_events WHERE project_id = $1",
        uuid.UUID(project_id),
    ):
        final = r["status"] in invariants.PROVIDER_TO_TASK.values()
        keys[r["seq"]] = None if final else (str(r["task_id"]), r["status"], r["stage"])
    return int(head or 0), keys


async def _duplicates(conn: asyncpg.Connection) -> dict[str, int]:
    media = await conn.fetchval(
        "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM media_operations"
        " GROUP BY task_id, attempt_id, operation_type HAVING count(*) > 1) d"
    )
    closing = await conn.fetchval(  # settled and refunded, or either twice
        "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM credit_ledger"
        " WHERE ledger_type IN ('settle', 'refund') GROUP BY task_id, attempt_id"
        " HAVING count(*) > 1) d"
    )
    ledger = await conn.fetchval(
        "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM credit_ledger"
        " GROUP BY task_id, attempt_id, ledger_type HAVING count(*) > 1) d"
    )
    return {
        "duplicate_media_operations": int(media),
        "duplicate_ledger_rows": int(ledger) + int(closing),
    }
