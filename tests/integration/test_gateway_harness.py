"""Shared fixtures of the gateway tests: a real server (API + SSE on one port), real PostgreSQL
and Redis, a stand-in dispatcher that publishes committed events (optionally losing some)."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from redis.asyncio import Redis

from aivedio.api.app import create_app
from aivedio.client import Client, Frame
from aivedio.config import ApiConfig
from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.gateway import Gateway, GatewayConfig, stream_token_routes
from aivedio.process.http_server import serve_http
from aivedio.state.service import StateService
from aivedio.state.tasks import TaskStore
from tests.integration.helpers import Project, make_project, make_task, store
from tests.waiting import eventually

SECRET = b"test-stream-token-secret-0123456789"


async def serve_gateway(
    app: Any, gateway: Gateway
) -> tuple[int, asyncio.Event, asyncio.Task[None]]:
    """Serve ``app`` and ``gateway`` on a free port; return once it is subscribed and accepts."""
    port = free_port()
    stopping = asyncio.Event()
    server = asyncio.create_task(serve_http(app, "127.0.0.1", port, gateway, stopping))
    await asyncio.wait_for(gateway.wait_subscribed(), 10)

    async def listening() -> bool:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        return True

    await eventually(listening, "the gateway to listen", 5, interval=0.05, ignoring=(OSError,))
    return port, stopping, server


async def open_stalled(base_url: str, head: str) -> socket.socket:
    """A client that sends ``head`` with a tiny receive buffer and never reads again: the
    gateway's socket buffer fills, then its queue, and it must evict this client alone."""
    host, port = base_url.removeprefix("http://").split(":")
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    stalled.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(stalled, (host, int(port)))
    await loop.sock_sendall(stalled, head.encode())
    return stalled


def gateway_config(redis_url: str, tag: str, /, **overrides: Any) -> GatewayConfig:
    """A gateway config for tests: private channel and keys, fast timers."""
    config = GatewayConfig(
        redis_url=redis_url,
        channel=f"test:events:{tag}",
        key_prefix=f"test:gw:{tag}",
        token_secret=SECRET,
        heartbeat_s=1.0,
        recheck_s=0.5,
        tailcheck_s=1.0,
        retry_ms=100,
    )
    return replace(config, **overrides)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Publisher:
    """Stands in for the notification dispatcher: committed events -> Redis, in seq order."""

    db: Database
    redis: Redis
    channel: str
    project_id: uuid.UUID
    watermark: int = 0
    drop: Callable[[int], bool] = lambda seq: False
    dropped: list[int] = field(default_factory=list)

    async def publish_new(self) -> int:
        async with self.db.connection() as conn:
            rows = await conn.fetch(
                "SELECT epoch, seq, task_id, task_version, public_payload FROM task_events"
                " WHERE project_id = $1 AND seq > $2 ORDER BY seq",
                self.project_id,
                self.watermark,
            )
        for row in rows:
            self.watermark = row["seq"]
            if self.drop(row["seq"]):
                self.dropped.append(row["seq"])
                continue
            public = dict(row["public_payload"])
            public.pop("event_id", None)  # as the outbox payload carries it: seq added by us
            message = {
                "project_id": str(self.project_id),
                "epoch": row["epoch"],
                "seq": row["seq"],
                "task_id": str(row["task_id"]),
                "task_version": row["task_version"],
                "public": public,
            }
            await self.redis.publish(self.channel, json.dumps(message))
        return len(rows)

    async def run(self) -> None:
        while True:
            await self.publish_new()
            await asyncio.sleep(0.02)


@dataclass
class Env:
    db: Database
    state: StateService
    tasks: TaskStore
    project: Project
    gateway: Gateway
    base_url: str
    redis: Redis
    publisher: Publisher

    def client(self, api_key: str | None = None, project_id: Any = None, **kw: Any) -> Client:
        return Client(
            self.base_url,
            api_key or self.project.api_key,
            project_id or self.project.project_id,
            **kw,
        )

    async def new_task(self, project: Project | None = None) -> tuple[uuid.UUID, uuid.UUID]:
        return await make_task(self.tasks, project or self.project)

    async def joined(self, n: int) -> None:
        """Wait until ``n`` connections have joined their project's stream (the gateway counts
        a connection once it is in the hub, so what is committed next reaches it live)."""
        await eventually(
            lambda: self.gateway.connections >= n,
            lambda: f"{n} connections joined (now {self.gateway.connections})",
            10,
        )

    async def provider(self, attempt_id: uuid.UUID, status: ProviderStatus, **kw: Any) -> None:
        await self.state.apply(
            ProviderObservation(
                provider="sandbox",
                attempt_id=attempt_id,
                status=status,
                source=Source.WEBHOOK,
                **kw,
            )
        )

    async def head(self) -> tuple[int, int]:
        async with self.db.connection() as conn:
            row = await conn.fetchrow(
                "SELECT epoch, head FROM event_streams WHERE project_id = $1",
                self.project.project_id,
            )
        return row["epoch"], row["head"]


EnvFactory = Callable[..., Awaitable[Env]]


@pytest.fixture
async def make_env(db: Database, redis_url: str) -> AsyncIterator[EnvFactory]:
    started: list[tuple[asyncio.Event, asyncio.Task[None], asyncio.Task[None], Redis]] = []

    async def factory(
        publish: bool = True,
        database: Database | None = None,
        project: Project | None = None,
        **overrides: Any,
    ) -> Env:
        """``database`` and ``project``: another database (a restored one) and its project."""
        tag = uuid.uuid4().hex[:12]
        config = gateway_config(redis_url, tag, **overrides)
        on = database or db
        state = StateService(on)
        tasks = store(on, state)
        project = project or await make_project(on, tenant=f"t-{tag}", project="web")
        app = create_app(on, tasks, ApiConfig(), extra_routes=stream_token_routes(on, SECRET))
        gateway = Gateway(on, config)
        port, stopping, server = await serve_gateway(app, gateway)
        redis = Redis.from_url(redis_url)
        publisher = Publisher(on, redis, config.channel, project.project_id)
        pub_task = asyncio.create_task(publisher.run() if publish else asyncio.sleep(0))
        started.append((stopping, server, pub_task, redis))
        return Env(on, state, tasks, project, gateway, f"http://127.0.0.1:{port}", redis, publisher)

    yield factory
    for stopping, server, pub_task, redis in started:
        pub_task.cancel()
        stopping.set()
        await asyncio.wait_for(server, 20)
        await redis.aclose()


async def collect(
    frames: AsyncIterator[Frame], until: Callable[[list[Frame]], bool], timeout: float = 15.0
) -> list[Frame]:
    """Read frames until ``until(frames)`` holds (bounded wait)."""
    got: list[Frame] = []

    async def read() -> None:
        async for frame in frames:
            got.append(frame)
            if until(got):
                return

    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise AssertionError(f"timed out; got {[(f.event, f.id) for f in got]}") from None
    return got


def seqs(frames: list[Frame]) -> list[int]:
    return [f.seq for f in frames if f.event == "task.status" and f.seq is not None]
