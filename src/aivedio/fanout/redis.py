"""The fan-out port on Redis Pub/Sub (redis-py), the production adapter.

Publishing a batch is ONE Redis call: a Lua script loops over PUBLISH and answers once
(:data:`PUBLISH_ALL`). A subscription is a redis-py :class:`~redis.asyncio.client.PubSub`:
when its connection drops, redis-py reconnects and re-subscribes by itself (the server's
``subscribe`` confirmation comes back as :class:`~aivedio.fanout.port.Subscribed`), and raises
only when it cannot, which becomes :class:`~aivedio.fanout.port.FanoutUnavailable`. Every
driver error is translated here; nothing above this module imports redis for fan-out.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.client import PubSub

from aivedio.fanout.port import FanoutError, FanoutUnavailable, Message, Subscribed

if TYPE_CHECKING:
    from aivedio.fanout.port import FanoutPublisher, FanoutSubscriber, Subscription

__all__ = ["PUBLISH_ALL", "RedisFanout", "RedisSubscription"]

# One round trip and ONE reply per batch: a pipeline of n PUBLISH commands costs the client n
# replies to parse (redis-py parses in Python: 21 % of the dispatcher's CPU while draining).
# ARGV = channel, message, channel, message, ...; returns the number of messages published.
PUBLISH_ALL = """
for i = 1, #ARGV, 2 do
    redis.call('PUBLISH', ARGV[i], ARGV[i + 1])
end
return #ARGV / 2
"""

# The connection is away (refused, reset, killed, timed out): retry later.
_DOWN: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
    TimeoutError,
)

_ANY: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, *_DOWN)


def _translate(exc: BaseException) -> FanoutError:
    if isinstance(exc, _DOWN):
        return FanoutUnavailable(f"redis: {exc!r}")
    return FanoutError(f"redis: {exc!r}")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisFanout:
    """Both sides of the port on one redis-py client (its connection pool is shared with
    whatever else uses the client; subscriptions take a connection of their own)."""

    service = "redis"

    def __init__(self, client: aioredis.Redis, *, owns_client: bool = False) -> None:
        self.client = client
        self._owns_client = owns_client
        self._publish_all = client.register_script(PUBLISH_ALL)

    @classmethod
    def from_url(
        cls, url: str, *, timeout_s: float = 2.0, health_check_interval_s: int = 10
    ) -> RedisFanout:
        """On a client of its own that fails fast (callers retry by themselves)."""
        client: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=health_check_interval_s,
        )
        return cls(client, owns_client=True)

    async def publish_many(self, messages: Sequence[tuple[str, bytes]]) -> int:
        if not messages:
            return 0
        args: list[str | bytes] = []
        for channel, data in messages:
            args += (channel, data)
        try:
            published = await self._publish_all(args=args)
        except _ANY as exc:
            raise _translate(exc) from exc
        return int(published)

    async def ping(self) -> None:
        try:
            await self.client.ping()
        except _ANY as exc:
            raise _translate(exc) from exc

    def subscription(self) -> RedisSubscription:
        return RedisSubscription(self.client.pubsub())

    async def close(self) -> None:
        if self._owns_client:
            with contextlib.suppress(*_ANY):
                await self.client.aclose()


class RedisSubscription:
    """One :class:`~redis.asyncio.client.PubSub` (one connection)."""

    def __init__(self, pubsub: PubSub) -> None:
        self.pubsub = pubsub

    async def subscribe(self, *channels: str) -> None:
        try:
            await self.pubsub.subscribe(*channels)
        except _ANY as exc:
            raise _translate(exc) from exc

    async def unsubscribe(self, *channels: str) -> None:
        try:
            await self.pubsub.unsubscribe(*channels)
        except _ANY as exc:
            raise _translate(exc) from exc

    async def next(self, timeout: float = 1.0) -> Message | Subscribed | None:  # noqa: ASYNC109
        deadline = time.monotonic() + timeout
        wait = timeout
        while True:
            try:
                raw: dict[str, Any] | None = await self.pubsub.get_message(timeout=wait)
            except _ANY as exc:
                raise _translate(exc) from exc
            if raw is None:
                return None
            kind = raw["type"]
            if kind == "message":
                data = raw["data"]
                if not isinstance(data, bytes):  # a client with decode_responses=True
                    data = str(data).encode()
                return Message(_text(raw["channel"]), data)
            if kind == "subscribe":
                # The first subscribe, or redis-py's own reconnect re-subscribed.
                return Subscribed(_text(raw["channel"]))
            wait = max(0.0, deadline - time.monotonic())  # unsubscribe / pong: not for callers

    async def close(self) -> None:
        with contextlib.suppress(*_ANY):
            await self.pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2


if TYPE_CHECKING:  # static proof that the adapter implements the port

    def _conforms(
        f: RedisFanout, s: RedisSubscription
    ) -> tuple[FanoutPublisher, FanoutSubscriber, Subscription]:
        return f, f, s
