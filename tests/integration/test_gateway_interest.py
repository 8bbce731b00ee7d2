"""Gateway -> poller: while a node has streams of a project (or of one task), it marks them
watched in Redis (the keys of ``aivedio.polling.ratelimit.mark_interest``), refreshed by one
shared loop; the marks lapse once nobody watches."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable

import pytest
from redis.asyncio import Redis

from aivedio.polling.ratelimit import interest_key, watched
from tests.integration.test_gateway_chaos import Reader
from tests.integration.test_gateway_harness import EnvFactory, make_env
from tests.waiting import eventually

__all__ = ["make_env"]

TTL_S = 1.5


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.mark.parametrize("fanout", ["broadcast", "node"])
async def test_streams_mark_their_project_or_task_while_open(
    make_env: EnvFactory, redis: Redis, fanout: str
) -> None:
    prefix = f"tint{uuid.uuid4().hex[:8]}"
    env = await make_env(
        interest_prefix=prefix, interest_ttl_s=TTL_S, fanout=fanout, channel_prefix=prefix
    )
    project_id = env.project.project_id
    task_id, _ = await env.new_task()
    other_task, _ = await env.new_task()
    project_key = interest_key("project", project_id, prefix)
    task_key = interest_key("task", task_id, prefix)

    async def exists(key: str) -> bool:
        return bool(await redis.exists(key))

    async def watched_now() -> set[str]:
        pairs = [(task_id, project_id), (other_task, project_id)]
        return await watched(redis, pairs, prefix=prefix)

    # A stream of one task (?task_id=) marks that task only.
    filtered = Reader(env.client(), str(task_id))
    filtered.start()
    await eventually(lambda: exists(task_key), "the task is marked on subscribe")
    assert not await exists(project_key)
    assert await watched_now() == {str(task_id)}
    ttl_ms = await redis.pttl(task_key)
    assert 0 < ttl_ms <= TTL_S * 1000

    # A stream of the whole project marks the project: every task of it is watched.
    whole = Reader(env.client())
    whole.start()
    await eventually(lambda: exists(project_key), "the project is marked on subscribe")
    assert await watched_now() == {str(task_id), str(other_task)}

    # Refreshed by the shared loop while the streams stay open (well past one TTL).
    await asyncio.sleep(TTL_S * 2)
    assert await exists(project_key) and await exists(task_key)

    # Nobody watches any more: the marks lapse by themselves.
    await whole.stop()
    await filtered.stop()
    await eventually(
        lambda: _none(exists(project_key), exists(task_key)), "the marks lapse", TTL_S * 4
    )
    assert await watched_now() == set()


async def _none(*checks: Awaitable[bool]) -> bool:
    return not any(await asyncio.gather(*checks))


async def test_a_websocket_subscribe_command_marks_its_task(
    make_env: EnvFactory, redis: Redis
) -> None:
    prefix = f"tint{uuid.uuid4().hex[:8]}"
    env = await make_env(interest_prefix=prefix, interest_ttl_s=TTL_S)
    task_id, _ = await env.new_task()
    task_key = interest_key("task", task_id, prefix)
    client = env.client(transport="ws")
    ws = await client.open_ws()
    try:
        await eventually(
            lambda: _exists(redis, interest_key("project", env.project.project_id, prefix)),
            "the project is marked",
        )
        assert not await redis.exists(task_key)
        await ws.send(json.dumps({"type": "subscribe", "request_id": 1, "task_id": str(task_id)}))
        await eventually(lambda: _exists(redis, task_key), "the task is marked on subscribe")
    finally:
        await ws.close()
        await client.aclose()


async def _exists(redis: Redis, key: str) -> bool:
    return bool(await redis.exists(key))
