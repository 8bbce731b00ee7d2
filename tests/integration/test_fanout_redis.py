"""The fan-out contract against real Redis (``AIVEDIO_REDIS_URL``)."""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from aivedio.fanout import FanoutPublisher, FanoutSubscriber
from aivedio.fanout.redis import RedisFanout
from tests.contract.fanout_contract import Drop, FanoutContract


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class TestRedisFanout(FanoutContract):
    @pytest.fixture
    def client_name(self) -> str:
        return f"fanout-contract-{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    async def publisher(self, redis_url: str) -> AsyncIterator[FanoutPublisher]:
        fanout = RedisFanout.from_url(redis_url)
        yield fanout
        await fanout.close()

    @pytest.fixture
    async def subscriber(self, redis_url: str, client_name: str) -> AsyncIterator[FanoutSubscriber]:
        # Named, so that ``drop`` finds this test's subscriber connections (and only those).
        client = aioredis.Redis.from_url(redis_url, client_name=client_name, socket_timeout=2.0)
        yield RedisFanout(client)
        await client.aclose()

    @pytest.fixture
    async def drop(self, redis_url: str, client_name: str) -> AsyncIterator[Drop]:
        admin = aioredis.Redis.from_url(redis_url)

        async def drop() -> None:
            clients = await admin.client_list(_type="pubsub")
            ids = [c["id"] for c in clients if c.get("name") == client_name]
            assert ids, "no subscriber connection to drop"
            for client_id in ids:
                await admin.client_kill_filter(_id=client_id)

        yield drop
        await admin.aclose()

    @pytest.fixture
    async def dead_publisher(self) -> AsyncIterator[FanoutPublisher]:
        fanout = RedisFanout.from_url(f"redis://127.0.0.1:{closed_port()}/0", timeout_s=0.5)
        yield fanout
        await fanout.close()
