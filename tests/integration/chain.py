"""The whole chain in this process: every role of ``aivedio run --role all`` served on a free port,
on this test's database and the session's Redis and NATS, with the sandbox provider calling
back. The roles share this process's Prometheus registry, so a test reads ``/metrics`` (or the
registry) and sees what the chain did."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from aivedio.admin import create_project_in
from aivedio.config import Settings
from aivedio.demo import sandbox_config
from aivedio.roles import AVAILABLE, serve
from aivedio.runtime import Runtime
from aivedio.sandbox import create_app as sandbox_app
from aivedio.services.embedded import ServiceUrls
from tests.waiting import eventually

DEADLINE_S = 60.0  # only to fail instead of hanging; nothing is asserted about durations
# A task of the sandbox that finishes in about a second, through a few progress steps.
QUICK = {"sandbox": {"queue_s": 0.05, "duration_s": 0.6, "steps": 3}}
LONG = {"sandbox": {"queue_s": 0.05, "duration_s": 60.0, "steps": 2}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``/metrics`` text -> {(sample name, labels): value}."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value_of(
    scraped: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return sum(v for (n, have), v in scraped.items() if n == name and set(labels.items()) <= have)


@dataclass
class Chain:
    rt: Runtime
    settings: Settings
    base: str
    client: httpx.AsyncClient
    sandbox: httpx.AsyncClient
    project_id: str
    api_key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    async def scrape(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """``/metrics`` as a scraper reads it."""
        response = await self.client.get("/metrics")
        assert response.status_code == 200
        return parse_metrics(response.text)

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``, read from ``/metrics``
        (0 when there is none)."""
        return value_of(await self.scrape(), name, **labels)

    async def moved(self, name: str, before: float, what: str = "", **labels: str) -> float:
        """Wait until ``name`` (filtered by ``labels``) exceeds ``before``; return its value."""
        seen = before

        async def grown() -> bool:
            nonlocal seen
            seen = await self.metric(name, **labels)
            return seen > before

        await eventually(grown, what or f"{name}{labels or ''} to move past {before}")
        return seen

    async def chaos(self, **knobs: Any) -> None:
        response = await self.sandbox.put("/_sandbox/chaos", json=knobs)
        assert response.status_code == 200, response.text

    async def create_task(
        self, params: dict[str, Any] | None = None, headers: dict[str, str] | None = None
    ) -> str:
        body = {"provider": "sandbox", "model": "m1", "prompt": "a cat", "params": params or QUICK}
        response = await self.client.post(
            f"/v1/projects/{self.project_id}/tasks",
            json=body,
            headers={**self.auth, "Idempotency-Key": uuid.uuid4().hex, **(headers or {})},
        )
        assert response.status_code == 202, response.text
        task_id: str = response.json()["task"]["id"]
        return task_id

    async def task(self, task_id: str) -> dict[str, Any]:
        response = await self.client.get(
            f"/v1/projects/{self.project_id}/tasks/{task_id}", headers=self.auth
        )
        assert response.status_code == 200, response.text
        task: dict[str, Any] = response.json()["task"]
        return task

    async def wait_status(self, task_id: str, *statuses: str) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        async def reached() -> bool:
            nonlocal seen
            seen = await self.task(task_id)
            return seen["status"] in statuses

        await eventually(reached, f"task {task_id} to reach {statuses}")
        return seen

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        async with self.rt.db.connection() as conn:
            return list(await conn.fetch(sql, *args))

    def sign(self, webhook_id: str, timestamp: int, body: bytes, *, forged: bool = False) -> str:
        """A Standard Webhooks signature with the sandbox's newest secret."""
        secret = self.settings.sandbox_webhook_secrets.split(",")[0].strip()
        key = base64.b64decode(secret.removeprefix("whsec_"))
        if forged:
            key = b"not-the-secret-" + key
        signed = f"{webhook_id}.{timestamp}.".encode() + body
        return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()

    async def callback(
        self,
        data: dict[str, Any],
        *,
        webhook_id: str | None = None,
        forged: bool = False,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST a signed ``generation.updated`` webhook to the callback gateway."""
        body = json.dumps({"type": "generation.updated", "data": data}).encode()
        webhook_id = webhook_id or f"msg_{uuid.uuid4().hex}"
        timestamp = int(time.time())
        return await self.client.post(
            "/v1/callbacks/sandbox",
            content=body,
            headers={
                "content-type": "application/json",
                "webhook-id": webhook_id,
                "webhook-timestamp": str(timestamp),
                "webhook-signature": self.sign(webhook_id, timestamp, body, forged=forged),
                **(headers or {}),
            },
        )


@dataclass
class Serving:
    """Every role of ``aivedio run --role all`` served in this process, and the sandbox."""

    rt: Runtime
    settings: Settings
    base: str
    client: httpx.AsyncClient
    sandbox: httpx.AsyncClient


@asynccontextmanager
async def serving_all_roles(
    urls: ServiceUrls, data_dir: Any, **overrides: Any
) -> AsyncIterator[Serving]:
    """``serve(rt, every role, port)`` as ``aivedio run --role all`` runs it, in this process, on
    ``urls`` (the database migrated), with the sandbox provider on a port of its own calling
    back; yields once the roles are ready and stops them all after (the serve exits 0)."""
    port, sandbox_port = free_port(), free_port()
    settings = Settings(
        database_url=urls.database_url,
        redis_url=urls.redis_url,
        nats_url=urls.nats_url,
        data_dir=data_dir,
        sandbox_url=f"http://127.0.0.1:{sandbox_port}",
        secret_key="s" * 32,
        gateway_tailcheck_s=1.0,
        **overrides,
    ).listening_on(port)
    provider = uvicorn.Server(
        uvicorn.Config(
            sandbox_app(sandbox_config(settings)),
            host="127.0.0.1",
            port=sandbox_port,
            access_log=False,
            log_config=None,
        )
    )
    provider_job = asyncio.create_task(provider.serve())
    rt = await Runtime.open(settings, urls)
    stopping = asyncio.Event()
    serving = asyncio.create_task(serve(rt, list(AVAILABLE), port, stopping))
    base = f"http://127.0.0.1:{port}"
    client = httpx.AsyncClient(base_url=base, timeout=10, trust_env=False)
    sandbox = httpx.AsyncClient(
        base_url=settings.sandbox_url,
        headers={"Authorization": f"Bearer {settings.sandbox_api_key}"},
        timeout=10,
        trust_env=False,
    )
    try:

        async def up() -> bool:
            assert not serving.done(), serving
            try:
                ok = (await client.get("/readyz")).status_code == 200
                return ok and (await sandbox.get("/healthz")).status_code == 200
            except httpx.HTTPError:
                return False

        await eventually(up, "the roles and the sandbox to be ready")
        yield Serving(rt, settings, base, client, sandbox)
    finally:
        stopping.set()
        try:
            assert await asyncio.wait_for(serving, DEADLINE_S) == 0
        finally:
            await client.aclose()
            await sandbox.aclose()
            provider.should_exit = True
            await asyncio.gather(provider_job, return_exceptions=True)
            await rt.close()


@asynccontextmanager
async def running_chain(
    database_url: str, redis_url: str, nats_url: str, data_dir: Any, **overrides: Any
) -> AsyncIterator[Chain]:
    """:func:`serving_all_roles` with a project of its own for the test."""
    conn = await asyncpg.connect(database_url)
    try:
        project = await create_project_in(conn, f"t-{uuid.uuid4().hex[:8]}", "metrics")
    finally:
        await conn.close()
    urls = ServiceUrls(database_url, redis_url, nats_url)
    async with serving_all_roles(urls, data_dir, **overrides) as s:
        yield Chain(
            s.rt,
            s.settings,
            s.base,
            s.client,
            s.sandbox,
            str(project["project_id"]),
            str(project["api_key"]),
        )
