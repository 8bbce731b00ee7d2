"""``Bus`` on Redis Streams (Valkey / Redis >= 7): consumer groups, XACK, XAUTOCLAIM.

Layout, all under ``{subject_prefix}:``:

* ``s:{topic}`` - the topic's stream; every group is a Redis consumer group on it.
* ``r:{group}:{topic}`` - replayed dead letters and due delayed naks for one group only (read
  with the topic stream).
* ``dlq:{group}`` - the group's dead letters (a stream; the entry id is the dead letter id).
* ``dedup:{dedup_id}`` - the sequence a dedup id was stored under, expiring after the window.
* ``dc:{group}`` - a hash of delivery counts by entry id (Redis' own counter is bumped by
  XCLAIM calls that are not deliveries, so the adapter keeps its own).
* ``z:{group}:{topic}``, ``zd:{group}:{topic}`` - messages nak-ed with a delay longer than the
  ack wait, parked until due (``bus/redis_streams_lua.py``).
* ``seq`` - one counter for the whole namespace, the ``PublishAck.sequence``.

Publish is one Lua script (dedup check, XADD trimmed by age, dedup key), so a duplicate never
reaches the stream. Redelivery: a fetch first XAUTOCLAIMs entries idle longer than
``ack_wait_s``; ``nak(delay)`` with ``delay <= ack_wait_s`` sets the entry's idle time so it
becomes claimable after ``delay``; a longer delay XACKs the entry and parks it in the same Lua
script, and a fetch re-adds it to the group's replay stream when due, its delivery count kept
(see ``redis_streams_lua``); ``in_progress`` resets the idle time. An entry claimed once more
than ``max_deliver`` times, or nak-ed on its last delivery, moves to the dead-letter stream.
All keys of one namespace must live on one node (no Redis Cluster hash slots are arranged).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from aivedio.bus.metrics import DEAD_LETTERS, REDELIVERIES, reason_class
from aivedio.bus.port import (
    BusClosed,
    BusConfig,
    BusError,
    BusUnavailable,
    DeadLetter,
    Delivery,
    OutgoingMessage,
    PublishAck,
    validate_group,
    validate_message,
    validate_topic,
)
from aivedio.bus.redis_streams_lua import MOVE_DUE, NAK_LATER, PUBLISH, nak_later_args

__all__ = ["RedisStreamsBus"]

T = TypeVar("T")


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStreamsBus:
    """``Bus`` on Redis Streams. Create with ``await RedisStreamsBus.connect(cfg)`` where
    ``cfg.url`` is a ``redis://`` (or ``rediss://``) URL."""

    def __init__(self, cfg: BusConfig, client: aioredis.Redis) -> None:
        self._cfg = cfg
        self._r = client
        self._closed = False
        self._ns = cfg.subject_prefix
        self._publish = client.register_script(PUBLISH)
        self._nak_later = client.register_script(NAK_LATER)
        self._move_due = client.register_script(MOVE_DUE)

    @classmethod
    async def connect(cls, cfg: BusConfig) -> RedisStreamsBus:
        client = aioredis.Redis.from_url(
            cfg.url,
            socket_connect_timeout=cfg.connect_timeout_s,
            retry_on_timeout=False,
            health_check_interval=30,
        )
        bus = cls(cfg, client)
        try:
            await bus._call(client.ping())
        except BusError:
            await client.aclose()
            raise
        return bus

    # -- names -------------------------------------------------------------------------------

    def _stream(self, topic: str) -> str:
        return f"{self._ns}:s:{topic}"

    def _replay_stream(self, group: str, topic: str) -> str:
        return f"{self._ns}:r:{group}:{topic}"

    def _dlq(self, group: str) -> str:
        return f"{self._ns}:dlq:{group}"

    def _counts(self, group: str) -> str:
        return f"{self._ns}:dc:{group}"

    def _parked(self, group: str, topic: str) -> tuple[str, str]:
        """The due-time zset and the data hash of the group's delayed naks on ``topic``."""
        return f"{self._ns}:z:{group}:{topic}", f"{self._ns}:zd:{group}:{topic}"

    # -- plumbing ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed("bus is closed")

    async def _call(self, aw: Awaitable[T], extra_s: float = 0.0) -> T:
        """Await one Redis call with the request timeout, errors translated to the port's."""
        try:
            async with asyncio.timeout(self._cfg.request_timeout_s + extra_s):
                return await aw
        except TimeoutError as exc:
            raise BusUnavailable("redis did not answer in time") from exc
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
            if self._closed:
                raise BusClosed("bus is closed") from exc
            raise BusUnavailable(f"redis unavailable: {type(exc).__name__}") from exc
        except redis_errors.RedisError as exc:
            raise BusError(f"redis error: {exc}") from exc

    # -- publish -----------------------------------------------------------------------------

    def _publish_args(
        self, topic: str, key: str, dedup_id: str, payload: bytes, headers: Mapping[str, str] | None
    ) -> tuple[list[str], list[Any]]:
        validate_topic(topic)
        validate_message(key, dedup_id, headers)
        keys = [self._stream(topic), f"{self._ns}:dedup:{dedup_id}", f"{self._ns}:seq"]
        args: list[Any] = [
            int(self._cfg.duplicate_window_s * 1000),
            int(self._cfg.retention_s * 1000),
            topic,
            key,
            dedup_id,
            json.dumps(dict(headers or {})),
            payload,
        ]
        return keys, args

    def _ack(self, reply: Sequence[Any]) -> PublishAck:
        return PublishAck(self._cfg.stream, int(_s(reply[0])), duplicate=int(reply[1]) == 1)

    async def publish(
        self,
        topic: str,
        key: str,
        dedup_id: str,
        payload: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> PublishAck:
        self._check_open()
        keys, args = self._publish_args(topic, key, dedup_id, payload, headers)
        reply = await self._call(self._publish(keys=keys, args=args))
        return self._ack(reply)

    async def publish_many(
        self, messages: Sequence[OutgoingMessage]
    ) -> list[PublishAck | BusError | ValueError]:
        self._check_open()
        results: list[PublishAck | BusError | ValueError] = []
        step = max(1, self._cfg.max_in_flight)
        for start in range(0, len(messages), step):
            chunk = messages[start : start + step]
            slots: list[PublishAck | BusError | ValueError | None] = []
            pipe = self._r.pipeline(transaction=False)
            for m in chunk:
                try:
                    keys, args = self._publish_args(
                        m.topic, m.key, m.dedup_id, m.payload, m.headers
                    )
                except ValueError as exc:
                    slots.append(exc)
                    continue
                slots.append(None)
                await self._publish(keys=keys, args=args, client=pipe)
            try:
                replies = iter(await self._call(pipe.execute(raise_on_error=False)))
            except BusError as exc:
                results.extend(s if s is not None else exc for s in slots)
                continue
            for slot in slots:
                if slot is not None:
                    results.append(slot)
                    continue
                reply = next(replies)
                if isinstance(reply, Exception):
                    results.append(BusError(f"redis error: {reply}"))
                else:
                    results.append(self._ack(reply))
        return results

    # -- consume -----------------------------------------------------------------------------

    async def _create_group(self, stream: str, group: str, start_id: str) -> None:
        try:
            await self._call(self._r.xgroup_create(stream, group, id=start_id, mkstream=True))
        except BusError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def subscribe(
        self, topic: str, group: str, *, start: Literal["all", "new"] = "all"
    ) -> RedisStreamsConsumer:
        self._check_open()
        validate_topic(topic)
        validate_group(group)
        await self._create_group(self._stream(topic), group, "0" if start == "all" else "$")
        await self._create_group(self._replay_stream(group, topic), group, "0")
        return RedisStreamsConsumer(self, topic, group)

    # -- dead letters ------------------------------------------------------------------------

    async def _dead_letter(
        self,
        stream: str,
        group: str,
        entry_id: str,
        fields: Mapping[bytes, bytes],
        deliveries: int,
        reason: str,
    ) -> None:
        topic = _s(fields[b"t"])
        letter: Any = {
            "t": topic,
            "k": fields[b"k"],
            "d": fields[b"d"],
            "h": fields[b"h"],
            "p": fields[b"p"],
            "n": deliveries,
            "reason": reason,
            "at": repr(time.time()),
        }
        oldest = int((time.time() - self._cfg.dead_letter_retention_s) * 1000)
        pipe = self._r.pipeline(transaction=True)
        pipe.xadd(self._dlq(group), letter, minid=max(0, oldest), approximate=True)
        pipe.xack(stream, group, entry_id)
        pipe.hdel(self._counts(group), entry_id)
        await self._call(pipe.execute())
        DEAD_LETTERS.labels(topic, group, reason_class(reason)).inc()

    async def dead_letters(self, group: str, limit: int = 100) -> list[DeadLetter]:
        self._check_open()
        validate_group(group)
        entries: Any = await self._call(self._r.xrange(self._dlq(group), count=limit))
        return [self._letter(group, entry_id, fields) for entry_id, fields in entries]

    @staticmethod
    def _letter(group: str, entry_id: Any, f: Mapping[bytes, bytes]) -> DeadLetter:
        return DeadLetter(
            id=_s(entry_id),
            group=group,
            topic=_s(f[b"t"]),
            key=_s(f[b"k"]),
            dedup_id=_s(f[b"d"]),
            data=f[b"p"],
            headers=json.loads(f[b"h"]),
            deliveries=int(f[b"n"]),
            reason=_s(f[b"reason"]),
            dead_at=float(f[b"at"]),
        )

    async def replay_dead_letter(self, group: str, dead_letter_id: str) -> PublishAck:
        self._check_open()
        validate_group(group)
        entries: Any = await self._call(
            self._r.xrange(self._dlq(group), min=dead_letter_id, max=dead_letter_id, count=1)
        )
        if not entries:
            raise BusError(f"no dead letter {dead_letter_id!r} in group {group!r}")
        entry_id, f = entries[0]
        topic = _s(f[b"t"])
        seq = await self._call(self._r.incr(f"{self._ns}:seq"))
        fields: Any = {"q": seq, "t": topic, "k": f[b"k"], "d": f[b"d"], "h": f[b"h"], "p": f[b"p"]}
        pipe = self._r.pipeline(transaction=True)
        pipe.xadd(self._replay_stream(group, topic), fields)
        pipe.xdel(self._dlq(group), entry_id)
        await self._call(pipe.execute())
        return PublishAck(self._cfg.stream, int(seq))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._r.aclose()


class RedisStreamsConsumer:
    """One member (a Redis consumer of a unique name) of a durable group on one topic."""

    def __init__(self, bus: RedisStreamsBus, topic: str, group: str) -> None:
        self._bus = bus
        self._topic = topic
        self._group = group
        self._name = uuid.uuid4().hex
        self._streams = [bus._stream(topic), bus._replay_stream(group, topic)]
        self._closed = False

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def group(self) -> str:
        return self._group

    def _check_open(self) -> None:
        self._bus._check_open()
        if self._closed:
            raise BusClosed("consumer is closed")

    async def _move_and_claim(
        self, batch: int
    ) -> tuple[int, list[tuple[str, bytes, dict[bytes, bytes]]]]:
        """Re-add this group's due delayed naks to its replay stream, then claim entries idle
        longer than the ack wait (one round trip for both when the topic's stream has enough).
        Returns the ms until the next delayed nak is due (-1: none parked) and the claimed."""
        bus = self._bus
        idle_ms = int(bus._cfg.ack_wait_s * 1000)
        keys = [*bus._parked(self._group, self._topic), bus._counts(self._group), self._streams[1]]
        pipe = bus._r.pipeline(transaction=False)
        await bus._move_due(keys=keys, args=[batch, int(bus._cfg.retention_s * 1000)], client=pipe)
        pipe.xautoclaim(self._streams[0], self._group, self._name, idle_ms, count=batch)
        next_due, reply = await bus._call(pipe.execute())
        got = [(self._streams[0], e, f) for e, f in reply[1] if f is not None]
        if len(got) < batch:
            reply = await bus._call(
                bus._r.xautoclaim(
                    self._streams[1], self._group, self._name, idle_ms, count=batch - len(got)
                )
            )
            got.extend((self._streams[1], e, f) for e, f in reply[1] if f is not None)
        return int(next_due), got

    async def fetch(self, batch: int = 100, timeout: float = 1.0) -> list[Delivery]:  # noqa: ASYNC109
        self._check_open()
        bus = self._bus
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            next_due_ms, claimed = await self._move_and_claim(batch)
            entries = [(s, e, f, True) for s, e, f in claimed]
            if len(entries) < batch:
                left_ms = int((deadline - loop.time()) * 1000)
                if next_due_ms >= 0:  # wake up for the next delayed nak
                    left_ms = min(left_ms, max(1, next_due_ms))
                block_ms = None if entries or left_ms <= 0 else left_ms
                reply: Any = await bus._call(
                    bus._r.xreadgroup(
                        self._group,
                        self._name,
                        dict.fromkeys(self._streams, ">"),
                        count=batch - len(entries),
                        block=block_ms,
                    ),
                    extra_s=(block_ms or 0) / 1000,
                )
                for stream, items in reply or []:
                    entries.extend((_s(stream), e, f, False) for e, f in items)
            if self._closed:
                raise BusClosed("consumer is closed")
            out = await self._deliveries(entries)
            if out or loop.time() >= deadline:
                return out

    async def _deliveries(
        self, entries: list[tuple[str, bytes, dict[bytes, bytes], bool]]
    ) -> list[Delivery]:
        if not entries:
            return []
        bus = self._bus
        pipe = bus._r.pipeline(transaction=False)
        for _, entry_id, _, _ in entries:
            pipe.hincrby(bus._counts(self._group), _s(entry_id), 1)
        counts = await bus._call(pipe.execute())
        out: list[Delivery] = []
        for (stream, entry_id, fields, redelivered), n in zip(entries, counts, strict=True):
            if n > bus._cfg.max_deliver:
                await bus._dead_letter(
                    stream, self._group, _s(entry_id), fields, n - 1, "max_deliver"
                )
                continue
            if redelivered or n > 1:
                REDELIVERIES.labels(self._topic, self._group).inc()
            out.append(RedisStreamsDelivery(self, stream, _s(entry_id), fields, int(n)))
        return out

    async def close(self) -> None:
        self._closed = True


class RedisStreamsDelivery:
    """One delivery of one stream entry to one consumer."""

    def __init__(
        self,
        consumer: RedisStreamsConsumer,
        stream: str,
        entry_id: str,
        fields: Mapping[bytes, bytes],
        deliveries: int,
    ) -> None:
        self._consumer = consumer
        self._stream = stream
        self._id = entry_id
        self._fields = fields
        self._deliveries = deliveries
        self._headers: dict[str, str] = json.loads(fields[b"h"])

    @property
    def topic(self) -> str:
        return _s(self._fields[b"t"])

    @property
    def key(self) -> str:
        return _s(self._fields[b"k"])

    @property
    def dedup_id(self) -> str:
        return _s(self._fields[b"d"])

    @property
    def data(self) -> bytes:
        return self._fields[b"p"]

    @property
    def headers(self) -> Mapping[str, str]:
        return self._headers

    @property
    def deliveries(self) -> int:
        return self._deliveries

    async def ack(self) -> None:
        bus, group = self._consumer._bus, self._consumer._group
        bus._check_open()
        pipe = bus._r.pipeline(transaction=True)
        pipe.xack(self._stream, group, self._id)
        pipe.hdel(bus._counts(group), self._id)
        await bus._call(pipe.execute())

    async def _set_idle(self, idle_ms: int) -> None:
        c = self._consumer
        bus = c._bus
        await bus._call(
            bus._r.xclaim(
                self._stream, c._group, c._name, 0, [self._id], idle=max(0, idle_ms), justid=True
            )
        )

    async def nak(self, delay_s: float = 0.0) -> None:
        bus = self._consumer._bus
        bus._check_open()
        if self._deliveries >= bus._cfg.max_deliver:
            await bus._dead_letter(
                self._stream,
                self._consumer._group,
                self._id,
                self._fields,
                self._deliveries,
                "max_deliver",
            )
            return
        ack_wait_ms = int(bus._cfg.ack_wait_s * 1000)
        if delay_s * 1000 <= ack_wait_ms:
            # Claimable (by any consumer of the group) once idle for ack_wait: after delay_s.
            await self._set_idle(ack_wait_ms - int(delay_s * 1000) + (1 if delay_s <= 0 else 0))
            return
        # Longer than an entry can stay pending: XACK and park it until due, in one script.
        c = self._consumer
        token = f"{'r' if self._stream == c._streams[1] else 's'}-{self._id}"
        keys = [self._stream, *bus._parked(c._group, c._topic), bus._counts(c._group)]
        args = nak_later_args(c._group, self._id, token, delay_s, self._deliveries, self._fields)
        await bus._call(bus._nak_later(keys=keys, args=args))

    async def in_progress(self) -> None:
        self._consumer._bus._check_open()
        await self._set_idle(0)

    async def term(self, reason: str = "terminated") -> None:
        bus = self._consumer._bus
        bus._check_open()
        await bus._dead_letter(
            self._stream, self._consumer._group, self._id, self._fields, self._deliveries, reason
        )
