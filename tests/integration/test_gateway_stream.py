"""The SSE stream end to end: live, resume, filters, heartbeats, the seed 004 cases."""

from __future__ import annotations

import asyncio

from aivedio.domain.observation import ProviderStatus
from tests.integration.test_gateway_harness import EnvFactory, collect, make_env, seqs

__all__ = ["make_env"]


async def test_live_events_arrive_in_order_with_contract_frames(make_env: EnvFactory) -> None:
    env = await make_env()
    client = env.client()
    await client.snapshot()
    frames = client.connect_once()
    first = [await env.new_task() for _ in range(3)]
    got = await collect(frames, lambda fs: len(seqs(fs)) >= 3)
    epoch, _ = await env.head()
    assert seqs(got) == [1, 2, 3]
    assert got[0].id == f"{epoch}-1"
    assert got[0].event == "task.status"
    assert set(got[0].data) == {
        "event_id",
        "task_id",
        "task_version",
        "status",
        "stage",
        "progress",
        "asset_id",
        "error",
    }
    assert got[0].data["event_id"] == 1
    assert [f.data["task_id"] for f in got] == [str(t) for t, _ in first]
    await frames.aclose()
    await client.aclose()


async def test_headers_retry_hint_and_heartbeat(make_env: EnvFactory) -> None:
    env = await make_env()
    host, port = env.base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"GET /v1/projects/{env.project.project_id}/events HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {env.project.api_key}\r\n\r\n".encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200")
    assert b"Content-Type: text/event-stream" in head
    assert b"Cache-Control: no-cache, no-transform" in head
    assert b"X-Accel-Buffering: no" in head
    seen = b""
    while b": ping " not in seen:
        seen += await asyncio.wait_for(reader.read(1024), 10)
    assert b"retry: 100" in seen
    writer.close()


async def test_resume_replays_what_was_missed(make_env: EnvFactory) -> None:
    env = await make_env(publish=False)  # nothing live: only the replay from PostgreSQL
    epoch, _ = await env.head()
    for _ in range(7):
        await env.new_task()
    client = env.client()
    client.view.cursor = f"{epoch}-2"
    got = await collect(client.connect_once(), lambda fs: len(seqs(fs)) >= 5)
    assert seqs(got) == [3, 4, 5, 6, 7]
    await client.aclose()


async def test_task_filter_writes_only_that_task(make_env: EnvFactory) -> None:
    env = await make_env()
    epoch, _ = await env.head()
    a, attempt_a = await env.new_task()
    await env.new_task()
    await env.provider(attempt_a, ProviderStatus.RUNNING, progress=10)
    client = env.client()
    client.view.cursor = f"{epoch}-0"
    got = await collect(client.connect_once(task_id=str(a)), lambda fs: len(seqs(fs)) >= 2)
    assert {f.data["task_id"] for f in got if f.event == "task.status"} == {str(a)}
    assert seqs(got) == [1, 3]
    await client.aclose()


async def test_a_finished_task_does_not_close_the_stream(make_env: EnvFactory) -> None:
    """Seed 004: one item's completion closed the whole stream."""
    env = await make_env()
    client = env.client()
    await client.snapshot()
    frames = client.connect_once()
    _, attempt = await env.new_task()
    await env.provider(attempt, ProviderStatus.FAILED, error_code="content_rejected")
    got = await collect(frames, lambda fs: any(f.data.get("status") == "failed" for f in fs))
    await env.new_task()  # the same connection still delivers the next task's events
    got += await collect(frames, lambda fs: len(seqs(fs)) >= 1)
    assert seqs(got) == [1, 2, 3]
    assert client.connects == 1
    await frames.aclose()
    await client.aclose()


async def test_a_one_second_task_is_not_missed_when_subscribed_first(
    make_env: EnvFactory,
) -> None:
    """Seed 004: subscribe before submit; a task that finishes at once is still seen."""
    env = await make_env()
    client = env.client()
    frames = client.connect_once()  # no cursor: the stream starts at the current head
    first = asyncio.ensure_future(
        collect(frames, lambda fs: any(f.data.get("status") == "failed" for f in fs))
    )
    await env.joined(1)  # in the hub: what is committed next reaches it live
    _, attempt = await env.new_task()
    await env.provider(attempt, ProviderStatus.FAILED)
    got = await first
    assert [f.data["status"] for f in got if f.event == "task.status"] == ["queued", "failed"]
    await client.aclose()
