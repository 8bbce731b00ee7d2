"""An in-memory bus for unit tests. It passes the same contract suite as the JetStream adapter.

One :class:`MemoryBroker` plays the server; every :class:`MemoryBus` on it is a client (a
"process"). State lives in plain dicts; waiting is polling with short sleeps, which is fine for
tests and keeps the fake obviously correct.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from aivedio.bus.metrics import DEAD_LETTERS, REDELIVERIES, reason_class
from aivedio.bus.port import (
    BusClosed,
    BusConfig,
    BusError,
    DeadLetter,
    Delivery,
    OutgoingMessage,
    PublishAck,
    validate_group,
    validate_message,
    validate_topic,
)

if TYPE_CHECKING:
    from aivedio.bus.port import Bus, Consumer

__all__ = ["MemoryBroker", "MemoryBus"]

_POLL_S = 0.005


@dataclass(slots=True)
class _Message:
    seq: int
    topic: str
    key: str
    dedup_id: str
    data: bytes
    headers: dict[str, str]
    only_group: str | None = None  # a replayed dead letter


@dataclass(slots=True)
class _Pending:
    deliveries: int
    due_at: float  # redeliverable from then on (ack wait, or nak delay)


@dataclass(slots=True)
class _Group:
    cursor: int  # index of the next never-delivered message
    pending: dict[int, _Pending] = field(default_factory=dict)


@dataclass(slots=True)
class _Stream:
    messages: list[_Message] = field(default_factory=list)
    dedup: dict[str, tuple[int, float]] = field(default_factory=dict)
    groups: dict[tuple[str, str], _Group] = field(default_factory=dict)
    dead: dict[int, DeadLetter] = field(default_factory=dict)
    dead_seq: int = 0


class MemoryBroker:
    """The shared "server": streams by name."""

    def __init__(self) -> None:
        self.streams: dict[str, _Stream] = {}

    def stream(self, name: str) -> _Stream:
        return self.streams.setdefault(name, _Stream())


class MemoryBus:
    def __init__(self, cfg: BusConfig, broker: MemoryBroker | None = None) -> None:
        self._cfg = cfg
        self._stream = (broker or MemoryBroker()).stream(cfg.stream)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed("the bus is closed")

    async def close(self) -> None:
        self._closed = True

    # -- publishing ------------------------------------------------------------------------

    def _store(
        self, m: OutgoingMessage, *, msg_id: str | None = None, only_group: str | None = None
    ) -> PublishAck:
        validate_topic(m.topic)
        validate_message(m.key, m.dedup_id, m.headers)
        now = time.monotonic()
        dedup_key = msg_id or m.dedup_id
        seen = self._stream.dedup.get(dedup_key)
        if seen is not None and now - seen[1] < self._cfg.duplicate_window_s:
            return PublishAck(self._cfg.stream, seen[0], duplicate=True)
        seq = len(self._stream.messages) + 1
        self._stream.messages.append(
            _Message(seq, m.topic, m.key, m.dedup_id, m.payload, dict(m.headers or {}), only_group)
        )
        self._stream.dedup[dedup_key] = (seq, now)
        return PublishAck(self._cfg.stream, seq)

    async def publish(
        self,
        topic: str,
        key: str,
        dedup_id: str,
        payload: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> PublishAck:
        self._check_open()
        return self._store(OutgoingMessage(topic, key, dedup_id, payload, headers))

    async def publish_many(
        self, messages: Sequence[OutgoingMessage]
    ) -> list[PublishAck | BusError | ValueError]:
        self._check_open()
        results: list[PublishAck | BusError | ValueError] = []
        for m in messages:
            try:
                results.append(self._store(m))
            except ValueError as exc:
                results.append(exc)
        return results

    # -- consuming -------------------------------------------------------------------------

    async def subscribe(
        self, topic: str, group: str, *, start: Literal["all", "new"] = "all"
    ) -> MemoryConsumer:
        self._check_open()
        validate_topic(topic)
        validate_group(group)
        key = (group, topic)
        if key not in self._stream.groups:
            cursor = 0 if start == "all" else len(self._stream.messages)
            self._stream.groups[key] = _Group(cursor)
        return MemoryConsumer(self, topic, group, self._stream.groups[key])

    def _dead_letter(self, group: str, msg: _Message, deliveries: int, reason: str) -> None:
        self._stream.dead_seq += 1
        letter_id = self._stream.dead_seq
        self._stream.dead[letter_id] = DeadLetter(
            id=str(letter_id),
            group=group,
            topic=msg.topic,
            key=msg.key,
            dedup_id=msg.dedup_id,
            data=msg.data,
            headers=dict(msg.headers),
            deliveries=deliveries,
            reason=reason,
            dead_at=time.time(),
        )
        DEAD_LETTERS.labels(msg.topic, group, reason_class(reason)).inc()

    async def dead_letters(self, group: str, limit: int = 100) -> list[DeadLetter]:
        self._check_open()
        validate_group(group)
        mine = [d for _, d in sorted(self._stream.dead.items()) if d.group == group]
        return mine[:limit]

    async def replay_dead_letter(self, group: str, dead_letter_id: str) -> PublishAck:
        self._check_open()
        validate_group(group)
        try:
            letter_id = int(dead_letter_id)
        except ValueError:
            raise BusError(f"no dead letter {dead_letter_id!r}") from None
        letter = self._stream.dead.get(letter_id)
        if letter is None or letter.group != group:
            raise BusError(f"no dead letter {dead_letter_id!r} in group {group!r}")
        ack = self._store(
            OutgoingMessage(letter.topic, letter.key, letter.dedup_id, letter.data, letter.headers),
            msg_id=f"replay:{group}:{letter_id}",
            only_group=group,
        )
        self._stream.dead.pop(letter_id, None)
        return ack


class MemoryDelivery:
    __slots__ = ("_consumer", "_deliveries", "_msg")

    def __init__(self, consumer: MemoryConsumer, msg: _Message, deliveries: int) -> None:
        self._consumer = consumer
        self._msg = msg
        self._deliveries = deliveries

    @property
    def topic(self) -> str:
        return self._msg.topic

    @property
    def key(self) -> str:
        return self._msg.key

    @property
    def dedup_id(self) -> str:
        return self._msg.dedup_id

    @property
    def data(self) -> bytes:
        return self._msg.data

    @property
    def headers(self) -> Mapping[str, str]:
        return dict(self._msg.headers)

    @property
    def deliveries(self) -> int:
        return self._deliveries

    def _pending(self) -> _Pending | None:
        self._consumer._bus._check_open()
        return self._consumer._state.pending.get(self._msg.seq)

    async def ack(self) -> None:
        if self._pending() is not None:
            del self._consumer._state.pending[self._msg.seq]

    async def nak(self, delay_s: float = 0.0) -> None:
        pending = self._pending()
        if pending is not None:
            pending.due_at = time.monotonic() + max(delay_s, 0.0)

    async def in_progress(self) -> None:
        pending = self._pending()
        if pending is not None:
            pending.due_at = time.monotonic() + self._consumer._bus._cfg.ack_wait_s

    async def term(self, reason: str = "terminated") -> None:
        pending = self._pending()
        if pending is not None:
            del self._consumer._state.pending[self._msg.seq]
            self._consumer._bus._dead_letter(
                self._consumer.group, self._msg, pending.deliveries, reason
            )


class MemoryConsumer:
    def __init__(self, bus: MemoryBus, topic: str, group: str, state: _Group) -> None:
        self._bus = bus
        self._topic = topic
        self._group = group
        self._state = state
        self._closed = False

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def group(self) -> str:
        return self._group

    async def close(self) -> None:
        self._closed = True

    def _take(self, batch: int) -> list[Delivery]:
        cfg = self._bus._cfg
        stream = self._bus._stream
        state = self._state
        now = time.monotonic()
        out: list[Delivery] = []
        for seq in sorted(state.pending):
            if len(out) >= batch:
                return out
            pending = state.pending[seq]
            if pending.due_at > now:
                continue
            pending.deliveries += 1
            pending.due_at = now + cfg.ack_wait_s
            msg = stream.messages[seq - 1]
            if pending.deliveries > cfg.max_deliver:
                del state.pending[seq]
                self._bus._dead_letter(self._group, msg, cfg.max_deliver, "max_deliver")
                continue
            REDELIVERIES.labels(self._topic, self._group).inc()
            out.append(MemoryDelivery(self, msg, pending.deliveries))
        while (
            len(out) < batch
            and state.cursor < len(stream.messages)
            and len(state.pending) < cfg.max_ack_pending
        ):
            msg = stream.messages[state.cursor]
            state.cursor += 1
            if msg.topic != self._topic or msg.only_group not in (None, self._group):
                continue
            state.pending[msg.seq] = _Pending(1, now + cfg.ack_wait_s)
            out.append(MemoryDelivery(self, msg, 1))
        return out

    async def fetch(self, batch: int = 100, timeout: float = 1.0) -> list[Delivery]:  # noqa: ASYNC109
        deadline = time.monotonic() + timeout
        while True:
            if self._closed or self._bus._closed:
                raise BusClosed("the consumer is closed")
            out = self._take(batch)
            if out or time.monotonic() >= deadline:
                return out
            await asyncio.sleep(_POLL_S)


if TYPE_CHECKING:  # static proof that the fake implements the port

    def _conforms(
        b: MemoryBus, c: MemoryConsumer, d: MemoryDelivery
    ) -> tuple[Bus, Consumer, Delivery]:
        return b, c, d
