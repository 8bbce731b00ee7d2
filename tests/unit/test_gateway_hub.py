"""The hub's subscription loop on the in-memory fan-out (which passes the Redis contract suite):
delivery to the project's stream, a tail check after every (re)subscribe, outages."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from aivedio.fanout.memory import MemoryFanout
from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.frames import Event
from aivedio.gateway.hub import Hub
from tests.waiting import eventually

CHANNEL = "test:events"


class _Stream:
    def __init__(self) -> None:
        self.events: list[tuple[int, Event]] = []

    def on_live(self, epoch: int, event: Event) -> None:
        self.events.append((epoch, event))

    def close(self) -> None:
        pass


def message(project: uuid.UUID, seq: int) -> bytes:
    return json.dumps(
        {
            "type": "task.status",
            "project_id": str(project),
            "epoch": 3,
            "seq": seq,
            "task_id": "t-1",
            "task_version": seq,
            "public": {"task_id": "t-1", "task_version": seq, "status": "running"},
        }
    ).encode()


class Running:
    def __init__(self) -> None:
        self.fanout = MemoryFanout()
        self.subscribes = 0
        self.hub = Hub(
            self.fanout,
            cast(Any, None),
            GatewayConfig(redis_url="redis://unused", channel=CHANNEL, max_corked=4),
            on_subscribed=self._on_subscribed,
        )
        self.project = uuid.uuid4()
        self.stream = _Stream()
        self.hub.streams[self.project] = cast(Any, self.stream)

    def _on_subscribed(self) -> None:
        self.subscribes += 1

    def seqs(self) -> list[int]:
        return [event.seq for _, event in self.stream.events]


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    r = Running()
    stopping = asyncio.Event()
    task = asyncio.create_task(r.hub.run(stopping))
    await asyncio.wait_for(r.hub.subscribed.wait(), 10)
    yield r
    stopping.set()
    await asyncio.wait_for(task, 10)


async def test_messages_reach_the_stream_in_order(running: Running) -> None:
    other = uuid.uuid4()  # no stream on this node: dropped
    batch = [(CHANNEL, message(running.project, seq)) for seq in range(1, 11)]
    await running.fanout.publish_many([(CHANNEL, message(other, 99)), *batch])
    await running.fanout.publish_many([("test:other-channel", message(running.project, 50))])
    await running.fanout.publish_many([(CHANNEL, message(running.project, 11))])
    await eventually(lambda: len(running.stream.events) >= 11, "11 events")
    assert running.seqs() == list(range(1, 12))
    assert running.subscribes == 1


async def test_a_dropped_connection_runs_the_tail_check_again(running: Running) -> None:
    running.fanout.drop_connections()
    await eventually(lambda: running.subscribes == 2, "the re-subscribe")
    await running.fanout.publish_many([(CHANNEL, message(running.project, 1))])
    await eventually(lambda: running.seqs() == [1], "the event after the re-subscribe")


async def test_an_outage_clears_subscribed_until_the_fanout_is_back(running: Running) -> None:
    running.fanout.set_available(False)
    await eventually(lambda: not running.hub.subscribed.is_set(), "the outage")
    running.fanout.set_available(True)
    await eventually(running.hub.subscribed.is_set, "subscribed again")
    await eventually(lambda: running.subscribes == 2, "a tail check after the outage")
    await running.fanout.publish_many([(CHANNEL, message(running.project, 7))])
    await eventually(lambda: running.seqs() == [7], "the event after the outage")
