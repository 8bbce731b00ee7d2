"""The poller against real PostgreSQL, Redis and the real sandbox provider under uvicorn.

Tasks are created through the real task store, submitted through the real sandbox adapter (as
the submitter does: provider task id, ``submit_accepted``, ``next_poll_at``), with webhooks off,
so polling alone must carry every task to its final state. No timing assertions: waits are
bounded polls for a condition.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn

from aivedio.db.pool import Database
from aivedio.domain.observation import PlatformKind, PlatformObservation, Source
from aivedio.polling.buckets import Limit
from aivedio.polling.claimed import PollRecord
from aivedio.polling.config import PollerConfig, RateLimitConfig
from aivedio.polling.policy import Backoff, BreakerConfig, PollPolicy
from aivedio.polling.poller import Poller
from aivedio.polling.ratelimit import RateLimiter
from aivedio.providers.http import HttpConfig
from aivedio.providers.port import SubmitRequest
from aivedio.providers.sandbox import SandboxAdapter
from aivedio.sandbox import SandboxConfig, create_app
from aivedio.state.service import StateService
from tests.integration.helpers import Project, make_project, make_task, store
from tests.proxy import TcpProxy
from tests.waiting import eventually as wait_until

API_KEY = "sk_poller_test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FINAL = {"provider_succeeded", "failed", "canceled"}

FAST = PollPolicy(
    submitted=Backoff(0.2, 0.5),
    queued=Backoff(0.3, 0.6),
    running=Backoff(0.2, 0.5),
    overdue=Backoff(1.0, 2.0),
    errors=Backoff(0.1, 0.4),
    rate_limited=Backoff(0.1, 0.5),
    not_found=Backoff(0.1, 0.3),
    malformed=Backoff(0.2, 0.5),
    auth=Backoff(1.0, 2.0),
    not_found_grace_s=5.0,
    unknown_after=3,
    min_interval_s=0.05,
)


@dataclass
class Sandbox:
    url: str
    http: httpx.AsyncClient
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def chaos(self, **knobs: Any) -> None:
        r = await self.http.put(f"{self.url}/_sandbox/chaos", json=knobs, headers=AUTH)
        assert r.status_code == 200, r.text

    async def stats(self) -> dict[str, Any]:
        r = await self.http.get(f"{self.url}/_sandbox/stats", headers=AUTH)
        assert r.status_code == 200
        data: dict[str, Any] = r.json()
        return data

    async def reset(self, **knobs: Any) -> None:
        r = await self.http.post(f"{self.url}/_sandbox/reset", headers=AUTH)
        assert r.status_code == 200
        await self.chaos(**knobs)


async def start_sandbox(**config: Any) -> Sandbox:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()
    url = f"http://{host}:{port}"
    app = create_app(SandboxConfig(api_key=API_KEY, public_url=url, seed=7, **config))
    server = uvicorn.Server(
        uvicorn.Config(app, lifespan="on", ws="none", log_level="warning", access_log=False)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_until(lambda: server.started, what="sandbox start")
    sandbox = Sandbox(url, httpx.AsyncClient(timeout=10), server, task)
    await sandbox.chaos(webhooks_enabled=False)
    return sandbox


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    sb = await start_sandbox()
    try:
        yield sb
    finally:
        await sb.http.aclose()
        sb.server.should_exit = True
        await asyncio.wait_for(sb.task, 15)


@pytest.fixture
async def capped() -> AsyncIterator[Sandbox]:
    sb = await start_sandbox(rate_cap_qps=20)
    try:
        yield sb
    finally:
        await sb.http.aclose()
        sb.server.should_exit = True
        await asyncio.wait_for(sb.task, 15)


def adapter_for(sb: Sandbox, read_timeout_s: float = 5.0) -> SandboxAdapter:
    return SandboxAdapter(
        base_url=sb.url,
        api_key=API_KEY,
        webhook_secrets=(("k0", "whsec_" + "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0"),),
        public_url=None,
        http=HttpConfig(read_timeout_s=read_timeout_s, connect_timeout_s=2.0),
    )


@dataclass
class World:
    db: Database
    state: StateService
    project: Project
    redis_url: str
    attempts: list[uuid.UUID] = field(default_factory=list)
    tasks: list[uuid.UUID] = field(default_factory=list)


@pytest.fixture
async def world(db: Database, redis_url: str) -> World:
    state = StateService(db)
    return World(db, state, await make_project(db), redis_url)


async def submit(
    world: World,
    adapter: SandboxAdapter,
    scripts: list[dict[str, Any]],
    *,
    pace_s: float = 0.0,
    project: Project | None = None,
) -> None:
    """Create tasks and submit them through the adapter, as the submitter does."""
    tasks = store(world.db, world.state)
    for script in scripts:
        task_id, attempt_id = await make_task(
            tasks, project or world.project, params={"sandbox": script}
        )
        async with world.db.connection() as conn:
            crid = await conn.fetchval(
                "SELECT client_request_id FROM task_attempts WHERE id = $1", attempt_id
            )
        result = await adapter.submit(
            SubmitRequest(
                client_request_id=crid, model="m1", prompt="a cat", params={"sandbox": script}
            )
        )
        async with world.db.transaction() as conn:
            await conn.execute(
                "UPDATE task_attempts SET provider_task_id = $2, next_poll_at = now() "
                "WHERE id = $1",
                attempt_id,
                result.provider_task_id,
            )
            await world.state.apply_in(
                conn,
                PlatformObservation(
                    kind=PlatformKind.SUBMIT_ACCEPTED, attempt_id=attempt_id, source=Source.SUBMIT
                ),
            )
        world.tasks.append(task_id)
        world.attempts.append(attempt_id)
        if pace_s:
            await asyncio.sleep(pace_s)


async def statuses(world: World) -> dict[uuid.UUID, str]:
    async with world.db.connection() as conn:
        rows = await conn.fetch(
            "SELECT id, status FROM generation_tasks WHERE id = ANY($1::uuid[])", world.tasks
        )
    return {r["id"]: r["status"] for r in rows}


@dataclass
class Replicas:
    pollers: list[Poller]
    clients: list[aioredis.Redis]
    records: list[PollRecord]
    stopping: asyncio.Event
    jobs: list[asyncio.Task[None]]

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.wait_for(asyncio.gather(*self.jobs), 30)
        for c in self.clients:
            await c.aclose()


def start_pollers(
    world: World,
    adapter: SandboxAdapter,
    *,
    count: int = 1,
    redis_url: str | None = None,
    limits: RateLimitConfig | None = None,
    policy: PollPolicy = FAST,
    concurrency: int = 16,
) -> Replicas:
    limits = limits or RateLimitConfig(prefix=f"test:poll:{uuid.uuid4().hex[:10]}")
    config = PollerConfig(
        concurrency=concurrency,
        batch=16,
        lease_s=10.0,
        idle_s=0.05,
        stretch_refresh_s=0.5,
        policy=policy,
        limits=limits,
        provider_breaker=BreakerConfig(threshold=50, window_s=5, cool_down_s=0.5),
    )
    records: list[PollRecord] = []
    stopping = asyncio.Event()
    pollers, clients, jobs = [], [], []
    for i in range(count):
        r = aioredis.from_url(
            redis_url or world.redis_url, socket_timeout=0.3, socket_connect_timeout=0.3
        )
        clients.append(r)
        poller = Poller(
            world.db,
            world.state,
            {"sandbox": adapter},
            RateLimiter(r, limits),
            config,
            redis=r,
            rand=random.Random(i),
            name=f"replica-{i}",
            on_poll=records.append,
        )
        pollers.append(poller)
        jobs.append(asyncio.create_task(poller.run(stopping)))
    return Replicas(pollers, clients, records, stopping, jobs)


QUICK = {"queue_s": 0.3, "duration_s": 1.0, "steps": 2}


async def test_webhooks_off_every_task_reaches_its_final_state_by_polling(
    world: World, sandbox: Sandbox
) -> None:
    adapter = adapter_for(sandbox)
    outcomes = ["succeeded", "failed", "canceled", "succeeded", "succeeded", "failed"]
    await submit(world, adapter, [{**QUICK, "outcome": o} for o in outcomes])
    replicas = start_pollers(world, adapter)
    try:

        async def done() -> bool:
            return set((await statuses(world)).values()) <= FINAL

        await wait_until(done, what="every task final")
    finally:
        await replicas.stop()
        await adapter.aclose()
    got = await statuses(world)
    expected = {"succeeded": "provider_succeeded", "failed": "failed", "canceled": "canceled"}
    assert [got[t] for t in world.tasks] == [expected[o] for o in outcomes]
    async with world.db.connection() as conn:
        left = await conn.fetchval(
            "SELECT count(*) FROM task_attempts WHERE id = ANY($1::uuid[]) "
            "AND next_poll_at IS NOT NULL",
            world.attempts,
        )
        sources = await conn.fetch(
            "SELECT DISTINCT source FROM task_events WHERE task_id = ANY($1::uuid[])", world.tasks
        )
    assert left == 0  # polling stopped at the final state
    assert {r["source"] for r in sources} == {"api", "submit", "poll"}
    stats = await sandbox.stats()
    assert stats["generations"]["created"] == len(outcomes)
    assert stats["webhooks"].get("delivered", 0) == 0


async def test_query_errors_never_resubmit_and_never_fail_a_task(
    world: World, sandbox: Sandbox
) -> None:
    adapter = adapter_for(sandbox, read_timeout_s=0.3)
    await sandbox.chaos(
        query_429_rate=0.25, retry_after_s=0, query_5xx_rate=0.25, query_slow_ms=[0, 500]
    )
    await submit(world, adapter, [{**QUICK, "outcome": "succeeded"} for _ in range(6)])
    replicas = start_pollers(world, adapter)
    try:

        async def done() -> bool:
            return set((await statuses(world)).values()) == {"provider_succeeded"}

        await wait_until(done, timeout=60, what="every task succeeded despite query errors")
    finally:
        await replicas.stop()
        await adapter.aclose()
    stats = await sandbox.stats()
    assert stats["generations"]["created"] == 6  # zero resubmissions
    assert stats["generations"]["create_requests"] == 6
    assert stats["chaos"].get("query_429", 0) > 0 and stats["chaos"].get("query_5xx", 0) > 0
    outcomes = {r.outcome for r in replicas.records}
    assert {"ok", "rate_limited", "unavailable"} <= {str(o) for o in outcomes}
    async with world.db.connection() as conn:
        failed = await conn.fetchval(
            "SELECT count(*) FROM task_events WHERE task_id = ANY($1::uuid[]) "
            "AND public_payload->>'status' = 'failed'",
            world.tasks,
        )
    assert failed == 0


async def test_a_provider_that_keeps_failing_makes_status_unknown_not_failed(
    world: World, sandbox: Sandbox
) -> None:
    adapter = adapter_for(sandbox)
    await submit(world, adapter, [{"queue_s": 0.1, "duration_s": 3.0, "steps": 2}] * 3)
    await sandbox.chaos(query_5xx_rate=1.0)
    replicas = start_pollers(world, adapter)
    try:

        async def unknown() -> bool:
            return set((await statuses(world)).values()) == {"status_unknown"}

        await wait_until(unknown, what="status_unknown after N failures")
        await sandbox.chaos(query_5xx_rate=0.0)

        async def done() -> bool:
            return set((await statuses(world)).values()) == {"provider_succeeded"}

        await wait_until(done, what="recovered to the true final state")
    finally:
        await replicas.stop()
        await adapter.aclose()
    assert (await sandbox.stats())["generations"]["created"] == 3


async def test_404_just_after_submit_is_retried(world: World, sandbox: Sandbox) -> None:
    adapter = adapter_for(sandbox)
    await sandbox.chaos(query_not_found_for_s=1.0)
    await submit(world, adapter, [{**QUICK, "outcome": "succeeded"}] * 2)
    replicas = start_pollers(world, adapter)
    try:

        async def done() -> bool:
            return set((await statuses(world)).values()) == {"provider_succeeded"}

        await wait_until(done, what="succeeded after early 404s")
    finally:
        await replicas.stop()
        await adapter.aclose()
    assert any(str(r.outcome) == "not_found" for r in replicas.records)
    async with world.db.connection() as conn:
        items = await conn.fetchval("SELECT count(*) FROM reconciliation_items")
    assert items == 0  # within the grace period: no reconciliation


async def test_a_webhook_pushes_the_next_poll_out(world: World, sandbox: Sandbox) -> None:
    from aivedio.domain.observation import ProviderObservation, ProviderStatus

    adapter = adapter_for(sandbox)
    await submit(world, adapter, [{"queue_s": 30, "duration_s": 30}])
    attempt = world.attempts[0]
    await world.state.apply(
        ProviderObservation(
            provider="sandbox",
            attempt_id=attempt,
            status=ProviderStatus.QUEUED,
            source=Source.WEBHOOK,
            provider_sequence=1,
        )
    )
    async with world.db.connection() as conn:
        pushed = await conn.fetchval(
            "SELECT extract(epoch FROM next_poll_at - now()) FROM task_attempts WHERE id = $1",
            attempt,
        )
    assert pushed > 20
    await adapter.aclose()


async def test_three_replicas_never_query_one_attempt_at_once_nor_overrun_the_cap(
    world: World, capped: Sandbox
) -> None:
    adapter = adapter_for(capped)
    long = {"queue_s": 1.0, "duration_s": 60.0, "steps": 30}
    await submit(world, adapter, [long] * 40, pace_s=0.08)  # under the cap of 20/s
    await capped.reset(webhooks_enabled=False)  # count only the polling phase
    limits = RateLimitConfig(
        prefix=f"test:poll:{uuid.uuid4().hex[:10]}",
        providers={"sandbox": Limit(14, 2)},
        replicas=3,
    )
    replicas = start_pollers(world, adapter, count=3, limits=limits)
    try:
        await wait_until(lambda: len(replicas.records) >= 80, timeout=60, what="80 polls")
    finally:
        await replicas.stop()
        await adapter.aclose()
    check_no_overlap(replicas.records)
    assert len({r.replica for r in replicas.records}) == 3
    stats = await capped.stats()
    assert stats["max_per_second"]["requests"] <= 20
    assert stats["requests"].get("rejected_by_rate_cap", 0) == 0
    async with world.db.connection() as conn:
        lost = await conn.fetchval(
            "SELECT count(*) FROM task_attempts WHERE poll_lease_token "
            "IS NOT NULL AND poll_lease_until > now() + interval '1 hour'"
        )
    assert lost == 0


async def test_redis_cut_mid_run_the_local_fallback_stays_under_the_cap(
    world: World, capped: Sandbox, redis_url: str
) -> None:
    adapter = adapter_for(capped)
    long = {"queue_s": 1.0, "duration_s": 60.0, "steps": 30}
    await submit(world, adapter, [long] * 40, pace_s=0.08)
    await capped.reset(webhooks_enabled=False)
    where = urlsplit(redis_url)
    proxy = TcpProxy(where.hostname or "127.0.0.1", where.port or 6379)
    await proxy.start()
    limits = RateLimitConfig(
        prefix=f"test:poll:{uuid.uuid4().hex[:10]}",
        providers={"sandbox": Limit(14, 2)},
        replicas=3,
        redis_timeout_s=0.2,
        redis_retry_s=0.5,
    )
    replicas = start_pollers(
        world,
        adapter,
        count=3,
        limits=limits,
        redis_url=f"redis://127.0.0.1:{proxy.port}{where.path or '/0'}",
    )
    try:
        await wait_until(lambda: len(replicas.records) >= 30, timeout=60, what="30 polls")
        await proxy.cut()
        cut_at = time.time()
        await wait_until(
            lambda: (
                all(p.limiter.mode == "local" for p in replicas.pollers)
                and sum(r.sent_at > cut_at + 1 for r in replicas.records) >= 30
            ),
            timeout=60,
            what="30 polls on local buckets",
        )
        await proxy.start()
        await wait_until(
            lambda: all(p.limiter.mode == "redis" for p in replicas.pollers),
            timeout=30,
            what="back on Redis",
        )
        back_at = time.time()
        await wait_until(
            lambda: sum(r.sent_at > back_at for r in replicas.records) >= 10,
            timeout=30,
            what="polls after recovery",
        )
    finally:
        await replicas.stop()
        await adapter.aclose()
        await proxy.cut()
    check_no_overlap(replicas.records)
    stats = await capped.stats()
    assert stats["max_per_second"]["requests"] <= 20
    assert stats["requests"].get("rejected_by_rate_cap", 0) == 0


def check_no_overlap(records: list[PollRecord]) -> None:
    """No attempt was queried by two replicas at once: per attempt, each query's window
    [sent, answered] ends before the next one starts."""
    by_attempt: dict[uuid.UUID, list[PollRecord]] = {}
    for r in records:
        by_attempt.setdefault(r.attempt_id, []).append(r)
    for polls in by_attempt.values():
        polls.sort(key=lambda r: r.sent_at)
        for a, b in itertools.pairwise(polls):
            assert a.answered_at <= b.sent_at, (a, b)
