"""Redis Pub/Sub is at-most-once: lost messages are repaired from PostgreSQL (gap repair, tail
check), so every client still gets every event of its project exactly once, in seq order."""

from __future__ import annotations

import asyncio

from tests.integration.test_gateway_harness import EnvFactory, collect, make_env, seqs

__all__ = ["make_env"]


async def test_lost_messages_and_a_lost_last_event_still_arrive(make_env: EnvFactory) -> None:
    env = await make_env()
    total = 30
    env.publisher.drop = lambda seq: seq % 3 == 0 or seq == total  # the LAST one too
    clients = [env.client() for _ in range(3)]
    for client in clients:
        await client.snapshot()
    streams = [client.connect_once() for client in clients]
    readers = [
        asyncio.ensure_future(collect(s, lambda fs: len(seqs(fs)) >= total)) for s in streams
    ]
    await asyncio.sleep(0.5)
    for _ in range(total):
        await env.new_task()
    results = await asyncio.gather(*readers)
    for got in results:
        assert seqs(got) == list(range(1, total + 1))
    assert total in env.publisher.dropped
    for client in clients:
        await client.aclose()


async def test_killed_subscriber_connection_loses_nothing(make_env: EnvFactory) -> None:
    env = await make_env()
    client = env.client()
    await client.snapshot()
    stream = client.connect_once()
    reader = asyncio.ensure_future(collect(stream, lambda fs: len(seqs(fs)) >= 20, timeout=30))
    await asyncio.sleep(0.5)
    for _ in range(10):
        await env.new_task()
    await env.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    for _ in range(10):
        await env.new_task()
    await env.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    got = await reader
    assert seqs(got) == list(range(1, 21))
    await client.aclose()


async def test_no_redis_messages_at_all_still_delivers_by_tail_check(
    make_env: EnvFactory,
) -> None:
    env = await make_env(publish=False)
    client = env.client()
    await client.snapshot()
    stream = client.connect_once()
    reader = asyncio.ensure_future(collect(stream, lambda fs: len(seqs(fs)) >= 3))
    await asyncio.sleep(0.5)
    for _ in range(3):
        await env.new_task()
    got = await reader
    assert seqs(got) == [1, 2, 3]
    await client.aclose()
