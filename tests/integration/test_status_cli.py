"""``aivedio status --once`` as an operator runs it, against the whole chain running: one frame,
then its figures as JSON, from PostgreSQL and the process's ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aivedio.client import Client
from tests.integration.chain import LONG, Chain, running_chain
from tests.integration.test_metrics import listening, run_quick_task
from tests.waiting import eventually


@pytest.fixture
async def chain(
    database_url: str, redis_url: str, nats_url: str, tmp_path: Path
) -> AsyncIterator[Chain]:
    async with running_chain(database_url, redis_url, nats_url, tmp_path) as running:
        yield running


async def status_once(chain: Chain, *extra: str) -> tuple[int, str, dict[str, Any]]:
    env = {**os.environ, "AIVEDIO_DATABASE_URL": chain.settings.database_url or ""}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aivedio",
        "status",
        "--once",
        "--metrics-url",
        f"{chain.base}/metrics",
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    text = out.decode()
    assert process.returncode is not None
    lines = text.strip().splitlines()
    assert lines, err.decode()
    return process.returncode, text, json.loads(lines[-1])


async def test_status_once_shows_the_deployment(chain: Chain) -> None:
    await run_quick_task(chain)  # lags with observations
    task_id = uuid.UUID(await chain.create_task(LONG))  # stays in flight

    async def submitted() -> bool:
        rows = await chain.fetch(
            "SELECT id, provider_task_id FROM task_attempts WHERE task_id = $1", task_id
        )
        return bool(rows and rows[0]["provider_task_id"])

    await eventually(submitted, "the long task to be submitted")
    attempt = (await chain.fetch("SELECT id FROM task_attempts WHERE task_id = $1", task_id))[0]
    await chain.fetch(
        "INSERT INTO reconciliation_items (kind, task_id, attempt_id, project_id)"
        " VALUES ('contradictory_terminal', $1, $2, $3)",
        task_id,
        attempt["id"],
        uuid.UUID(chain.project_id),
    )
    await chain.fetch(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type,"
        " payload, next_retry_at) VALUES ('task', $1, 1, 'test.parked', '{}',"
        " now() + interval '1 hour')",
        uuid.uuid4(),
    )
    read = "SELECT status FROM generation_tasks WHERE id = $1"
    earlier = (await chain.fetch(read, task_id))[0]["status"]
    client = Client(chain.base, chain.api_key, chain.project_id)
    try:
        await client.snapshot()
        async with listening(client):
            code, text, data = await status_once(chain)
    finally:
        await client.aclose()
    later = (await chain.fetch(read, task_id))[0]["status"]  # it may move on meanwhile
    assert code == 0, text
    database = data["database"]
    in_flight = database["tasks_in_flight"]
    assert in_flight.get(earlier, 0) + (in_flight.get(later, 0) if later != earlier else 0) == 1
    assert set(in_flight) <= {"created", "submitted", "provider_queued", "running"}
    assert database["reconciliation_open"] == {"contradictory_terminal": 1}
    assert database["outbox_pending"] >= 1
    assert data["connections"].get("sse", 0) >= 1
    assert data["lags"]["inbox lag"]["count"] > 0
    assert data["metrics_unreachable"] == []
    for heading in ("backlogs", "in-flight tasks", "open reconciliation items", "connections"):
        assert heading in text


async def test_status_once_names_what_it_cannot_reach(chain: Chain) -> None:
    code, text, data = await status_once(chain, "--metrics-url", "http://127.0.0.1:9/metrics")
    assert code == 0
    assert data["metrics_unreachable"] == ["http://127.0.0.1:9/metrics"]
    assert "metrics unreachable" in text
