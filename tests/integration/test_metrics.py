"""Every metric of seed §12.11.6 moves when the chain does the thing it counts.

One test per metric (docs/reference/metrics.md names them). The chain metrics run every role of
``aivedio run --role all`` in this process (``chain.py``) and read ``/metrics`` as a scraper
would; the gateway's connection metrics use the gateway harness, whose stand-in dispatcher can
lose a chosen live message (gap repair, tail repair) and whose queues can be made tiny
(eviction). Each test reads the value first and waits until it grew: no fixed sleeps, no
durations asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from aivedio.bus import BusConfig
from aivedio.bus.jetstream import JetStreamBus
from aivedio.client import Client, Frame
from tests.integration.chain import LONG, Chain, running_chain, value_of
from tests.integration.test_gateway_harness import EnvFactory, make_env, open_stalled
from tests.waiting import eventually

__all__ = ["make_env"]


@pytest.fixture
async def chain(
    database_url: str, redis_url: str, nats_url: str, tmp_path: Path
) -> AsyncIterator[Chain]:
    async with running_chain(database_url, redis_url, nats_url, tmp_path) as running:
        yield running


def registry(name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in this process whose labels include ``labels``."""
    total = 0.0
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


async def registry_moved(name: str, before: float, **labels: str) -> float:
    async def grown() -> bool:
        return registry(name, **labels) > before

    await eventually(grown, f"{name}{labels or ''} to move past {before}")
    return registry(name, **labels)


@contextlib.asynccontextmanager
async def listening(client: Client) -> AsyncIterator[list[Frame]]:
    """An open event stream of ``client``'s project; yields the frames as they arrive."""
    frames: list[Frame] = []
    opened = asyncio.Event()

    async def read() -> None:
        async for frame in client.connect_once():
            opened.set()
            frames.append(frame)

    reader = asyncio.create_task(read())
    try:
        # SSE sends nothing until an event; WebSocket a start frame. The gauge says "open".
        await eventually(
            lambda: _async(opened.is_set() or registry("aivedio_gateway_connections") > 0),
            "the stream to open",
        )
        yield frames
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def _async(value: bool) -> bool:
    return value


def unknown_generation(sequence: int = 1) -> dict[str, Any]:
    return {
        "id": f"gen_{uuid.uuid4().hex[:12]}",
        "status": "running",
        "progress": 10,
        "sequence": sequence,
        "updated_at": "2026-01-01T00:00:00Z",
        "error": None,
        "output": None,
        "metadata": {},
    }


async def run_quick_task(chain: Chain) -> str:
    task_id = await chain.create_task()
    await chain.wait_status(task_id, "ready")
    return task_id


# -- callbacks and inbox ------------------------------------------------------------------------


async def test_callbacks_by_outcome(chain: Chain) -> None:
    accepted = await chain.metric("aivedio_callbacks_accepted_total", provider="sandbox")
    duplicate = await chain.metric("aivedio_callbacks_duplicate_total", provider="sandbox")
    rejected = await chain.metric("aivedio_callbacks_rejected_total", provider="sandbox")
    data = unknown_generation()
    first = await chain.callback(data, webhook_id="msg_dup_1")
    again = await chain.callback(data, webhook_id="msg_dup_1")
    forged = await chain.callback(unknown_generation(), forged=True)
    assert (first.status_code, again.status_code) == (204, 204)
    assert forged.status_code == 401, forged.text
    assert await chain.metric("aivedio_callbacks_accepted_total", provider="sandbox") == (
        accepted + 1
    )
    assert await chain.metric("aivedio_callbacks_duplicate_total", provider="sandbox") == (
        duplicate + 1
    )
    assert await chain.metric("aivedio_callbacks_rejected_total", provider="sandbox") == (
        rejected + 1
    )


async def test_webhook_store_latency(chain: Chain) -> None:
    """Each stored callback is timed from its receipt to its group commit (new or duplicate)."""
    before = await chain.metric("aivedio_callback_store_seconds_count")
    data = unknown_generation()
    assert (await chain.callback(data, webhook_id="msg_store_1")).status_code == 204
    assert (await chain.callback(data, webhook_id="msg_store_1")).status_code == 204
    assert await chain.metric("aivedio_callback_store_seconds_count") == before + 2


async def test_inbox_lag(chain: Chain) -> None:
    before = await chain.metric("aivedio_inbox_lag_seconds_count")
    await run_quick_task(chain)  # the sandbox's webhooks went through the inbox
    await chain.moved("aivedio_inbox_lag_seconds_count", before)


async def test_apply_latency_is_observed_for_every_observation(chain: Chain) -> None:
    """Every observation the state service counts is timed, whichever path applied it (the
    inbox processor's batch, the poller's and submitter's in-transaction applies)."""
    first = await chain.scrape()
    await run_quick_task(chain)
    later = await chain.scrape()  # one scrape: both values of the same moment
    timed = value_of(later, "aivedio_apply_observation_seconds_count") - value_of(
        first, "aivedio_apply_observation_seconds_count"
    )
    counted = value_of(later, "aivedio_observations_total") - value_of(
        first, "aivedio_observations_total"
    )
    assert counted >= 3  # submitted, running..., succeeded, ready at least
    assert timed == counted


# -- outbox, relay, dispatcher, bus --------------------------------------------------------------


async def test_outbox_backlog_and_oldest_age(chain: Chain) -> None:
    """A row the relay may not publish yet (its retry is an hour away) stays pending: the
    backlog counts it and the oldest pending age grows with it."""
    rows = await chain.fetch(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type,"
        " payload, next_retry_at, created_at)"
        " VALUES ('task', $1, 1, 'test.parked', '{}', now() + interval '1 hour',"
        " now() - interval '10 minutes') RETURNING id",
        uuid.uuid4(),
    )
    try:

        async def seen() -> bool:
            backlog = await chain.metric("aivedio_outbox_backlog")
            age = await chain.metric("aivedio_outbox_oldest_pending_age_seconds")
            return backlog >= 1 and age >= 600

        await eventually(seen, "the relay's gauges to show the parked row")
    finally:
        await chain.fetch("DELETE FROM outbox_events WHERE id = $1", rows[0]["id"])


async def test_relay_lag(chain: Chain) -> None:
    before = await chain.metric("aivedio_outbox_relay_lag_seconds_count")
    await run_quick_task(chain)
    await chain.moved("aivedio_outbox_relay_lag_seconds_count", before)


async def test_dispatcher_lag(chain: Chain) -> None:
    before = await chain.metric("aivedio_dispatch_lag_seconds_count")
    await run_quick_task(chain)
    await chain.moved("aivedio_dispatch_lag_seconds_count", before)


async def publish_poison(chain: Chain) -> None:
    """A message the dispatcher cannot read: it naks it until its last delivery, then
    dead-letters it."""
    bus = await JetStreamBus.connect(
        BusConfig.from_settings(chain.settings, chain.rt.urls.nats_url)
    )
    try:
        key = f"poison-{uuid.uuid4().hex[:8]}"
        await bus.publish("task.status", key, key, b"not json at all")
    finally:
        await bus.close()


async def test_bus_redeliveries(chain: Chain) -> None:
    labels = {"topic": "task.status", "group": "dispatcher"}
    before = await chain.metric("aivedio_bus_redeliveries_total", **labels)
    await publish_poison(chain)
    await chain.moved("aivedio_bus_redeliveries_total", before, **labels)


async def test_bus_dead_letters(chain: Chain) -> None:
    labels = {"topic": "task.status", "group": "dispatcher", "reason": "malformed"}
    before = await chain.metric("aivedio_bus_dead_letters_total", **labels)
    await publish_poison(chain)
    await chain.moved("aivedio_bus_dead_letters_total", before, **labels)


# -- polling ---------------------------------------------------------------------------------


async def test_poll_queries_by_provider(chain: Chain) -> None:
    """With the webhooks off, the poller is what moves a task: its queries are counted by
    provider (rate() of it is the poll QPS)."""
    await chain.chaos(webhooks_enabled=False)
    before = await chain.metric("aivedio_poll_queries_total", provider="sandbox")
    await chain.create_task(LONG)
    await chain.moved("aivedio_poll_queries_total", before, provider="sandbox")


async def test_limiter_waits(
    database_url: str, redis_url: str, nats_url: str, tmp_path: Path
) -> None:
    """One query per second for the provider, four attempts due at once: the limiter grants
    one and makes the others wait."""
    async with running_chain(
        database_url, redis_url, nats_url, tmp_path, poll_limits="provider:sandbox=1/1"
    ) as chain:
        await chain.chaos(webhooks_enabled=False)
        tasks = [uuid.UUID(await chain.create_task(LONG)) for _ in range(4)]

        async def submitted() -> bool:
            rows = await chain.fetch(
                "SELECT count(*) AS n FROM task_attempts"
                " WHERE task_id = ANY($1::uuid[]) AND provider_task_id IS NOT NULL",
                tasks,
            )
            return bool(rows[0]["n"] == len(tasks))

        await eventually(submitted, "the tasks to be submitted")
        before = await chain.metric("aivedio_poll_limiter_wait_seconds_count", provider="sandbox")

        async def waited() -> bool:
            await chain.fetch(
                "UPDATE task_attempts SET next_poll_at = now()"
                " WHERE next_poll_at IS NOT NULL AND poll_lease_until IS NULL"
            )
            value = await chain.metric("aivedio_poll_limiter_wait_seconds_count")
            return value > before

        await eventually(waited, "the limiter to make a query wait")


# -- gateway --------------------------------------------------------------------------------


async def test_event_age_at_the_socket(chain: Chain) -> None:
    client = Client(chain.base, chain.api_key, chain.project_id)
    try:
        await client.snapshot()
        before = await chain.metric("aivedio_gateway_event_age_seconds_count", source="live")
        async with listening(client) as frames:
            task_id = await run_quick_task(chain)
            await eventually(
                lambda: _async(any(f.data.get("status") == "ready" for f in frames)),
                "the ready frame",
            )
        assert any(f.data.get("task_id") == task_id for f in frames)
        await chain.moved("aivedio_gateway_event_age_seconds_count", before, source="live")
    finally:
        await client.aclose()


async def test_connections_by_transport(make_env: EnvFactory) -> None:
    env = await make_env()
    for transport in ("sse", "ws"):
        client = env.client(transport=transport)
        try:
            await client.snapshot()
            before = registry("aivedio_gateway_connections", transport=transport)
            opened = registry("aivedio_gateway_connections_opened_total", transport=transport)
            async with listening(client):
                await registry_moved("aivedio_gateway_connections", before, transport=transport)
                assert registry(
                    "aivedio_gateway_connections_opened_total", transport=transport
                ) == (opened + 1)

            async def closed(transport: str = transport, before: float = before) -> bool:
                return registry("aivedio_gateway_connections", transport=transport) == before

            await eventually(closed, f"the {transport} gauge to come back down")
        finally:
            await client.aclose()


async def test_frames_written(make_env: EnvFactory) -> None:
    env = await make_env()
    client = env.client()
    try:
        await client.snapshot()
        async with listening(client) as frames:
            before = registry("aivedio_gateway_frames_written_total")
            await env.new_task()
            await eventually(lambda: _async(bool(frames)), "a frame")
            await registry_moved("aivedio_gateway_frames_written_total", before)
    finally:
        await client.aclose()


async def test_slow_evictions(make_env: EnvFactory) -> None:
    env = await make_env(
        socket_send_buffer=4096,
        write_high_water=4096,
        write_low_water=1024,
        queue_max_events=8,
        queue_max_bytes=4096,
        stall_timeout_s=3.0,
    )
    before = registry("aivedio_gateway_slow_evictions_total")
    stalled = await open_stalled(
        env.base_url,
        f"GET /v1/projects/{env.project.project_id}/events HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {env.project.api_key}\r\n\r\n",
    )
    try:

        async def evicted() -> bool:
            if registry("aivedio_gateway_slow_evictions_total") > before:
                return True
            for _ in range(20):
                await env.new_task()
            return False

        await eventually(evicted, "the stalled client to be evicted")
    finally:
        stalled.close()


async def test_send_queue_length(make_env: EnvFactory) -> None:
    """A client that stops reading: once its socket buffer is full, events wait in its send
    queue, and the gauges (read at scrape) show them."""
    env = await make_env(
        socket_send_buffer=4096,
        write_high_water=4096,
        write_low_water=1024,
        queue_max_events=100_000,
        queue_max_bytes=64 * 1024 * 1024,
        stall_timeout_s=60.0,
    )
    stalled = await open_stalled(
        env.base_url,
        f"GET /v1/projects/{env.project.project_id}/events HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {env.project.api_key}\r\n\r\n",
    )
    try:

        async def queued() -> bool:
            if registry("aivedio_gateway_queued_events") > 0:
                return True
            for _ in range(20):
                await env.new_task()
            return False

        await eventually(queued, "events to wait in the stalled client's queue")
        assert registry("aivedio_gateway_longest_queue_events") > 0
    finally:
        stalled.close()
    await eventually(
        lambda: _async(registry("aivedio_gateway_queued_events") == 0),
        "the queue to go with its connection",
    )


async def test_resets(make_env: EnvFactory) -> None:
    env = await make_env()
    client = env.client()
    try:
        await client.snapshot()
        epoch, head = await env.head()
        client.view.cursor = f"{epoch + 5}-{head}"  # a cursor of another epoch
        before = registry("aivedio_gateway_resets_total")
        async with listening(client) as frames:
            await eventually(lambda: _async(any(f.event == "reset" for f in frames)), "a reset")
        assert registry("aivedio_gateway_resets_total") > before
    finally:
        await client.aclose()


async def test_gap_repairs(make_env: EnvFactory) -> None:
    """The stand-in dispatcher loses one live message in the middle: the gateway sees the next
    seq arrive, reads the missing one from PostgreSQL and counts a gap repair."""
    env = await make_env()
    _, head = await env.head()
    lost = head + 1
    env.publisher.drop = lambda seq: seq == lost
    client = env.client()
    try:
        await client.snapshot()
        async with listening(client) as frames:
            before = registry("aivedio_gateway_gap_repairs_total")
            await env.new_task()
            await env.new_task()
            await eventually(
                lambda: _async(lost + 1 in {f.seq for f in frames}), "the event after the gap"
            )
            assert lost in {f.seq for f in frames}
            assert env.publisher.dropped == [lost]
            assert registry("aivedio_gateway_gap_repairs_total") > before
    finally:
        await client.aclose()


async def test_tail_repairs(make_env: EnvFactory) -> None:
    """The LAST event's live message is lost (nothing comes after it to show a gap): the tail
    check finds the stream head ahead and repairs it."""
    env = await make_env()
    _, head = await env.head()
    env.publisher.drop = lambda seq: seq > head  # every live message from now on
    client = env.client()
    try:
        await client.snapshot()
        async with listening(client) as frames:
            before = registry("aivedio_gateway_tailcheck_repairs_total")
            await env.new_task()
            _, now = await env.head()
            await eventually(lambda: _async(now in {f.seq for f in frames}), "the lost events")
            assert env.publisher.dropped
            assert registry("aivedio_gateway_tailcheck_repairs_total") > before
    finally:
        await client.aclose()


def test_the_metrics_reference_names_every_metric_here() -> None:
    """docs/reference/metrics.md lists every aivedio metric this process registered."""
    import aivedio.bus.jetstream
    import aivedio.roles  # noqa: F401 - every role's module and the bus: every metric

    doc = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md").read_text()
    names = {
        family.name
        for family in REGISTRY.collect()
        if family.name.startswith("aivedio_") and not family.name.startswith("aivedio_bench")
    }
    missing = sorted(n for n in names if f"`{n}`" not in doc and f"`{n}_total`" not in doc)
    assert not missing, f"undocumented metrics: {missing}"
