"""The REAL sandbox provider under uvicorn on a free port, and the real ``sandbox`` adapter.

Shared by the submitter, cancel worker and reconciler tests. The adapter gets no public URL, so
no webhook is sent: what moves a task is the code under test (and its own queries) only.
"""

from __future__ import annotations

import asyncio
import base64
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import httpx
import uvicorn

from aivedio.db.pool import Database
from aivedio.providers.http import HttpConfig
from aivedio.providers.sandbox import SandboxAdapter
from aivedio.sandbox import SandboxConfig, create_app
from tests.waiting import eventually as wait_until

API_KEY = "sk_sandbox_submit"
SECRET = "whsec_" + base64.b64encode(b"submit-secret-submit-secret-0000").decode()
LONG = {"queue_s": 0.05, "duration_s": 60.0, "steps": 2}
QUICK = {"queue_s": 0.05, "duration_s": 0.2, "steps": 2}


class NoKeySandbox(SandboxAdapter):
    """The sandbox as seen through an adapter that does not trust idempotency keys."""

    honours_idempotency_key = False


class NoLookupSandbox(NoKeySandbox):
    supports_lookup = False


@dataclass
class Sandbox:
    url: str
    client: httpx.AsyncClient

    def adapter(
        self,
        cls: type[SandboxAdapter] = SandboxAdapter,
        *,
        api_key: str = API_KEY,
        http: HttpConfig | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> SandboxAdapter:
        return cls(
            base_url=self.url,
            api_key=api_key,
            webhook_secrets=(("v1", SECRET),),
            public_url=None,
            http=http,
            client=client,
        )

    async def chaos(self, **knobs: Any) -> None:
        response = await self.client.put("/_sandbox/chaos", json=knobs)
        assert response.status_code == 200, response.text

    async def stats(self) -> dict[str, Any]:
        response = await self.client.get("/_sandbox/stats")
        assert response.status_code == 200
        result: dict[str, Any] = response.json()
        return result

    async def generation(self, generation_id: str) -> dict[str, Any]:
        response = await self.client.get(f"/v1/generations/{generation_id}")
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result


@asynccontextmanager
async def running_sandbox(**overrides: Any) -> AsyncIterator[Sandbox]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()
    config = SandboxConfig(
        api_key=API_KEY,
        webhook_secrets=(SECRET,),
        public_url=f"http://{host}:{port}",
        seed=11,
    )
    app = create_app(replace(config, **overrides))
    server = uvicorn.Server(
        uvicorn.Config(app, lifespan="on", ws="none", log_level="warning", access_log=False)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_until(lambda: server.started, what="sandbox start")
    url = f"http://{host}:{port}"
    client = httpx.AsyncClient(
        base_url=url,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
        trust_env=False,
    )
    try:
        yield Sandbox(url, client)
    finally:
        await client.aclose()
        server.should_exit = True
        await asyncio.wait_for(task, 20)
        sock.close()


async def task_row(db: Database, task_id: uuid.UUID) -> dict[str, Any]:
    async with db.connection() as conn:
        row = await conn.fetchrow(
            """SELECT t.status, t.version, t.error_code, t.current_attempt_id,
                      a.provider_task_id, a.next_poll_at, a.attempt_no, a.reason,
                      a.client_request_id, i.state AS intent_state, i.tries, i.maybe_sent,
                      i.next_attempt_at, i.last_error_code
               FROM generation_tasks t
               JOIN task_attempts a ON a.id = t.current_attempt_id
               LEFT JOIN submit_intents i ON i.attempt_id = a.id
               WHERE t.id = $1""",
            task_id,
        )
    assert row is not None
    return dict(row)


async def make_due(db: Database) -> None:
    """Skip the backoff of every pending intent (tests never wait for a real backoff)."""
    async with db.connection() as conn:
        await conn.execute(
            "UPDATE submit_intents SET next_attempt_at = now() WHERE state = 'pending'"
        )
        await conn.execute(
            "UPDATE cancel_intents SET next_attempt_at = now() WHERE state = 'pending'"
        )


class FaultyCreates(httpx.AsyncBaseTransport):
    """Answers the first creates with the given status codes WITHOUT forwarding them (the
    request never reaches the sandbox), then forwards everything to the real sandbox. With
    ``on_created``, awaits it after a forwarded create's answer and before handing it back."""

    def __init__(
        self,
        statuses: list[int],
        on_created: Callable[[httpx.Response], Awaitable[None]] | None = None,
    ) -> None:
        self.statuses = list(statuses)
        self.on_created = on_created
        self.inner = httpx.AsyncHTTPTransport(retries=0)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        is_create = request.method == "POST" and request.url.path == "/v1/generations"
        if is_create and self.statuses:
            status = self.statuses.pop(0)
            headers = {"Retry-After": "0"} if status == 429 else {}
            return httpx.Response(status, headers=headers, json={"error": {"code": "injected"}})
        response = await self.inner.handle_async_request(request)
        if is_create and self.on_created is not None:
            await response.aread()
            await self.on_created(response)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()
