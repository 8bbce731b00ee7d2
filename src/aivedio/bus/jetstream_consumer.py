"""The consuming side of the JetStream adapter (``jetstream.py``): a pull consumer bound to a
group's durable consumer, its deliveries, and the headers both sides agree on.

The consumer needs five things of its bus (``BusLink``): whether it is closed, the client, the
config, the raw ack writer and the error edge, plus dead-lettering, which stays with the bus.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from aivedio.bus.jetstream_pipeline import NATS_ERRORS, Edge, PullFetcher, num_delivered
from aivedio.bus.metrics import REDELIVERIES
from aivedio.bus.nats_internals import Pulled, RawWriter
from aivedio.bus.port import BusClosed, BusConfig, BusError, BusUnavailable, Delivery

# The adapter's logger: these lines read as they did when this lived in ``jetstream.py``.
log = logging.getLogger("aivedio.bus.jetstream")

H_MSG_ID = "Nats-Msg-Id"
H_KEY = "Aivedio-Key"
H_DEDUP = "Aivedio-Dedup-Id"  # the original dedup id on a replayed or dead-lettered copy
H_GROUP = "Aivedio-Group"
H_TOPIC = "Aivedio-Topic"
H_DELIVERIES = "Aivedio-Deliveries"
H_REASON = "Aivedio-Reason"
H_DEAD_AT = "Aivedio-Dead-At"
H_ORIGIN_SEQ = "Aivedio-Origin-Seq"
H_ONLY_GROUP = "Aivedio-Only-Group"  # a replayed dead letter is for this group only
B_ONLY_GROUP = H_ONLY_GROUP.encode()


def user_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    if not headers:
        return {}
    return {k: v for k, v in headers.items() if not k.lower().startswith(("nats-", "aivedio-"))}


class BusLink(Protocol):
    """What a consumer and its deliveries use of ``JetStreamBus``."""

    _closed: bool
    _nc: NatsClient
    _cfg: BusConfig
    _raw: RawWriter
    _edge: Edge

    async def _dead_letter(self, msg: Msg, group: str, topic: str, reason: str) -> None: ...


class JetStreamDelivery:
    __slots__ = ("_consumer", "_deliveries", "_msg", "_topic")

    def __init__(
        self, consumer: JetStreamConsumer, msg: Pulled, topic: str, deliveries: int
    ) -> None:
        self._consumer = consumer
        self._msg = msg
        self._topic = topic
        self._deliveries = deliveries

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def deliveries(self) -> int:
        return self._deliveries

    @property
    def key(self) -> str:
        return (self._msg.headers or {}).get(H_KEY, "")

    @property
    def dedup_id(self) -> str:
        h = self._msg.headers or {}
        return h.get(H_DEDUP) or h.get(H_MSG_ID, "")

    @property
    def data(self) -> bytes:
        return self._msg.data

    @property
    def headers(self) -> Mapping[str, str]:
        return user_headers(self._msg.headers)

    def _check(self) -> None:
        if self._consumer._bus._closed:
            raise BusClosed("the bus is closed")

    async def ack(self) -> None:
        """What ``Msg.ack`` sends (an empty message to the reply subject), as one raw frame."""
        self._check()
        msg = self._msg
        try:  # the hot path: no context manager per message
            if msg.acked:
                raise nats.errors.MsgAlreadyAckdError(msg)
            if not msg.reply:
                raise nats.errors.Error("no reply subject available")
            await self._consumer._bus._raw.ack(msg.reply)
            msg.acked = True
        except NATS_ERRORS as exc:
            raise self._consumer._bus._edge.translate(exc, "ack") from exc

    async def nak(self, delay_s: float = 0.0) -> None:
        self._check()
        msg = self._msg.msg()
        with self._consumer._bus._edge("nak"):
            await msg.nak(delay=delay_s if delay_s > 0 else None)
        self._msg.acked = msg.is_acked

    async def in_progress(self) -> None:
        self._check()
        with self._consumer._bus._edge("in_progress"):
            await self._msg.msg().in_progress()

    async def term(self, reason: str = "terminated") -> None:
        self._check()
        msg = self._msg.msg()
        await self._consumer._bus._dead_letter(msg, self._consumer.group, self.topic, reason)
        self._msg.acked = msg.is_acked


class JetStreamConsumer:
    """A pull subscription bound to the group's durable consumer."""

    def __init__(
        self,
        bus: BusLink,
        topic: str,
        group: str,
        name: str,
        puller: PullFetcher,
    ) -> None:
        self._bus = bus
        self._puller = puller
        self._topic = topic
        self._group = group
        self.name = name
        self._closed = False

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def group(self) -> str:
        return self._group

    async def fetch(self, batch: int = 100, timeout: float = 1.0) -> list[Delivery]:  # noqa: ASYNC109
        if self._closed or self._bus._closed:
            raise BusClosed("the consumer is closed")
        nc = self._bus._nc
        if not nc.is_connected:
            raise BusUnavailable("NATS is not connected")
        with self._bus._edge("fetch"):
            msgs = await self._puller.fetch(batch, max(timeout, 0.01))
        if not msgs and not nc.is_connected:
            raise BusUnavailable("NATS disconnected during fetch")
        out: list[Delivery] = []
        max_deliver = self._bus._cfg.max_deliver
        for msg in msgs:
            if msg.has_header(B_ONLY_GROUP):  # headers parsed only then
                only = (msg.headers or {}).get(H_ONLY_GROUP)
                if only is not None and only != self._group:
                    with self._bus._edge("ack another group's replay"):
                        await msg.msg().ack()
                    continue
            n = num_delivered(msg.reply)
            if n > max_deliver:
                await self._dead_letter_due(msg.msg())
                continue
            if n > 1:
                REDELIVERIES.labels(self._topic, self._group).inc()
            out.append(JetStreamDelivery(self, msg, self._topic, n))
        return out

    async def _dead_letter_due(self, msg: Msg) -> None:
        """Dead-letter a message delivered more than ``max_deliver`` times.

        Why here and not from the ``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES`` advisory: an
        advisory is a core-NATS message, sent once, lost if no process listens at that moment
        (or unless yet another stream captures it), and it leaves the copy to a separate
        listener. Checking ``num_delivered`` on the delivery itself happens in the consumer
        that holds the message, survives restarts (the server keeps redelivering until the
        ``term``, since the server-side ``max_deliver`` is unlimited), and is idempotent (the DLQ
        copy carries a ``Nats-Msg-Id``). The cost is one extra delivery that the application
        never sees.
        """
        try:
            await self._bus._dead_letter(msg, self._group, self._topic, "max_deliver")
        except BusError as exc:
            # Not terminated: it comes back after ack_wait and we try again.
            log.warning("dead-lettering %s failed, will retry: %s", self.name, exc)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._bus._closed:
            try:
                await self._puller.stop()
            except nats.errors.Error as exc:  # best effort: the server drops it with the conn
                log.debug("unsubscribe %s: %s", self.name, exc)
