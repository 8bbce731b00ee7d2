"""PostgreSQL taken away mid-run: 503 with Retry-After, never a partial write."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit, urlunsplit

import httpx

from aivedio.api.app import create_app
from aivedio.config import ApiConfig, DatabaseConfig
from aivedio.db.pool import Database
from aivedio.state.service import StateService
from tests.integration.helpers import make_project, store
from tests.proxy import TcpProxy
from tests.waiting import eventually

BODY = {"provider": "sandbox", "model": "m1", "prompt": "p", "params": {}}


def via(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0] + "@" if len(netloc) == 2 else ""
    return urlunsplit((parts.scheme, f"{user}127.0.0.1:{port}", parts.path, "", ""))


async def test_database_down_answers_503_and_writes_nothing_partial(
    database_url: str, db: Database
) -> None:
    target = urlsplit(database_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    await proxy.start()
    cut_db = await Database.connect(
        DatabaseConfig(
            url=via(database_url, proxy.port), min_size=1, max_size=8, acquire_timeout_s=1.0
        )
    )
    project = await make_project(db)
    app = create_app(cut_db, store(cut_db, StateService(cut_db)), ApiConfig())
    headers = {"Authorization": f"Bearer {project.api_key}"}
    url = f"/v1/projects/{project.project_id}/tasks"
    keys = [uuid.uuid4().hex for _ in range(30)]
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as client:

            async def post(key: str) -> httpx.Response:
                return await client.post(url, json=BODY, headers=headers | {"Idempotency-Key": key})

            ok = await post(keys[0])
            assert ok.status_code == 202
            burst = [asyncio.create_task(post(k)) for k in keys[1:]]
            await asyncio.sleep(0.005)
            await proxy.cut()
            results = await asyncio.gather(*burst)
            assert {r.status_code for r in results} <= {202, 503}
            down = await post(uuid.uuid4().hex)
            assert down.status_code == 503
            assert down.headers["retry-after"].isdigit()
            assert down.json()["error"]["code"] == "unavailable"
            snapshot = await client.get(f"{url}/{ok.json()['task']['id']}", headers=headers)
            assert snapshot.status_code == 503

            await proxy.start()
            for key, r in zip(keys[1:], results, strict=True):
                if r.status_code == 503:  # the client retries with the same key

                    async def accepted(key: str = key) -> bool:
                        return (await post(key)).status_code == 202

                    await eventually(accepted, f"{key} accepted on a retry", 4, interval=0.2)
    finally:
        await proxy.cut()
        await cut_db.close()

    async with db.connection() as conn:
        tasks = await conn.fetchval("SELECT count(*) FROM generation_tasks")
        keys_stored = await conn.fetchval("SELECT count(*) FROM idempotency_keys")
        first_events = await conn.fetchval(
            "SELECT count(*) FROM task_events WHERE task_version = 1"
        )
        attempts = await conn.fetchval("SELECT count(*) FROM task_attempts")
        head = await conn.fetchval("SELECT head FROM event_streams")
        events = await conn.fetchval("SELECT count(*) FROM task_events")
        outbox = await conn.fetchval("SELECT count(*) FROM outbox_events")
    assert tasks == keys_stored == first_events == attempts == len(keys)
    assert head == events == outbox == len(keys)
