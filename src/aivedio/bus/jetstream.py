"""The bus port on NATS JetStream (nats-py 2.x, nats-server 2.9 or newer).

Mapping (details and reasons in ``docs/reference/bus.md``):

* one stream ``cfg.stream`` over ``<prefix>.>``; a topic ``task.status`` is the subject
  ``<prefix>.task.status``; the key travels in the ``Aivedio-Key`` header, the dedup id in
  ``Nats-Msg-Id`` (the stream's ``duplicate_window`` is ``cfg.duplicate_window_s``);
* one durable pull consumer per (group, topic), named ``<group>_<topic with . as _>``, explicit
  ack, ``ack_wait``, ``max_ack_pending``, filtered on ``<prefix>.<topic>``;
* a second stream ``<stream>_DLQ`` over ``<prefix>_dlq.>`` holds dead letters on
  ``<prefix>_dlq.<group>.<topic>``; a replay is republished on the topic with an
  ``Aivedio-Only-Group`` header, and the other groups' consumers ack it without delivering it
  (nats-server 2.9 has no multi-filter consumers, so a per-group subject cannot be used).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext

from aivedio.bus.jetstream_consumer import (
    H_DEAD_AT,
    H_DEDUP,
    H_DELIVERIES,
    H_GROUP,
    H_KEY,
    H_MSG_ID,
    H_ONLY_GROUP,
    H_ORIGIN_SEQ,
    H_REASON,
    H_TOPIC,
    JetStreamConsumer,
    JetStreamDelivery,
    user_headers,
)
from aivedio.bus.jetstream_pipeline import (
    NATS_ERRORS,
    AckBatch,
    AckPipeline,
    Edge,
    PullFetcher,
)
from aivedio.bus.metrics import DEAD_LETTERS, reason_class
from aivedio.bus.nats_internals import RawWriter, fast_headers, probe
from aivedio.bus.port import (
    Bus,
    BusClosed,
    BusConfig,
    BusError,
    BusUnavailable,
    Consumer,
    DeadLetter,
    Delivery,
    OutgoingMessage,
    PublishAck,
    validate_group,
    validate_message,
    validate_topic,
)

__all__ = ["JetStreamBus"]

log = logging.getLogger(__name__)

# JetStream API error codes we act on.
ERR_STREAM_NAME_IN_USE = 10058  # "stream name already in use with a different configuration"
# While another process is creating the same stream, the server may answer "subjects overlap
# with an existing stream" instead of "name in use": the overlapping stream is our own.
ERR_SUBJECTS_OVERLAP = 10065


class JetStreamBus:
    """``Bus`` on NATS JetStream. Create with ``await JetStreamBus.connect(cfg)``."""

    def __init__(self, cfg: BusConfig, nc: NatsClient) -> None:
        self._cfg = cfg
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream(timeout=cfg.request_timeout_s)
        self._pipeline = AckPipeline(nc, cfg.publish_timeout_s)
        self._raw = RawWriter(nc)  # acks: one pre-encoded frame each
        self._closed = False
        self._edge = Edge(lambda: self._closed)
        self._consumers: list[JetStreamConsumer] = []
        self.dlq_stream = f"{cfg.stream}_DLQ"
        self._prefix = cfg.subject_prefix
        self._subjects: dict[str, str] = {}  # validated topic -> subject
        self._dlq_prefix = f"{cfg.subject_prefix}_dlq"

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    async def connect(cls, cfg: BusConfig) -> JetStreamBus:
        """Connect, then create (or adopt) the streams. Safe to run in many processes at once.

        The client reconnects forever after the first connection (``max_reconnect_attempts=-1``);
        callers never hang because every operation has its own deadline and reports
        ``BusUnavailable`` meanwhile. The first connection is bounded by
        ``connect_timeout_s`` per attempt and 3 attempts.
        """
        probe()  # nats-py internals there, or a logged fall back to its public API
        nc = NatsClient()

        async def on_error(exc: Exception) -> None:
            log.warning("nats error: %s: %s", type(exc).__name__, exc)

        async def on_disconnected() -> None:
            if nc.is_closed:  # our own close(): nothing to warn about
                log.debug("nats connection to %s closed", cfg.url)
            else:
                log.warning("nats disconnected from %s", cfg.url)

        async def on_reconnected() -> None:
            log.info("nats reconnected to %s", nc.connected_url)

        # nats-py annotates the timeouts as int; it takes seconds as float at runtime.
        options: dict[str, Any] = {
            "servers": [url.strip() for url in cfg.url.split(",") if url.strip()],
            "connect_timeout": cfg.connect_timeout_s,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": cfg.reconnect_wait_s,
            "ping_interval": 10,
            "max_outstanding_pings": 3,
            "error_cb": on_error,
            "disconnected_cb": on_disconnected,
            "reconnected_cb": on_reconnected,
        }
        try:
            # With max_reconnect_attempts=-1 nats-py retries the *first* connect forever too,
            # so bound it here.
            await asyncio.wait_for(
                nc.connect(**options),
                timeout=3 * cfg.connect_timeout_s + 2 * cfg.reconnect_wait_s,
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await _close_quietly(nc)
            raise BusUnavailable(f"cannot connect to NATS at {cfg.url}: {exc!r}") from exc
        fast_headers(nc)
        bus = cls(cfg, nc)
        try:
            await bus._pipeline.start()
            await bus.ensure_streams()
        except BaseException:
            await bus.close()
            raise
        return bus

    async def ensure_streams(self) -> None:
        """Create the stream and the dead-letter stream, or update them to this config."""
        cfg = self._cfg
        storage = api.StorageType.FILE if cfg.storage == "file" else api.StorageType.MEMORY
        main = api.StreamConfig(
            name=cfg.stream,
            subjects=[f"{self._prefix}.>"],
            retention=api.RetentionPolicy.LIMITS,
            storage=storage,
            num_replicas=cfg.replicas,
            max_age=cfg.retention_s,
            duplicate_window=cfg.duplicate_window_s,
            discard=api.DiscardPolicy.OLD,
        )
        dlq = api.StreamConfig(
            name=self.dlq_stream,
            subjects=[f"{self._dlq_prefix}.>"],
            retention=api.RetentionPolicy.LIMITS,
            storage=storage,
            num_replicas=cfg.replicas,
            max_age=cfg.dead_letter_retention_s,
            duplicate_window=cfg.duplicate_window_s,
            discard=api.DiscardPolicy.OLD,
        )
        for config in (main, dlq):
            with self._edge(f"create stream {config.name}"):
                try:
                    # Identical config: the server answers OK, so concurrent starts are fine.
                    await self._js.add_stream(config)
                except nats.js.errors.BadRequestError as exc:
                    if exc.err_code not in (ERR_STREAM_NAME_IN_USE, ERR_SUBJECTS_OVERLAP):
                        raise
                    try:
                        await self._js.update_stream(config)
                    except nats.js.errors.NotFoundError:
                        raise exc from None  # another stream owns these subjects

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pipeline.fail_all(BusClosed("the bus was closed before the publish was acked"))
        for consumer in self._consumers:
            consumer._closed = True
        await _close_quietly(self._nc)

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed("the bus is closed")

    # -- publishing ------------------------------------------------------------------------

    def _encode(
        self, topic: str, key: str, dedup_id: str, headers: Mapping[str, str] | None
    ) -> tuple[str, dict[str, str]]:
        subject = self._subjects.get(topic)
        if subject is None:
            validate_topic(topic)
            subject = self._subjects[topic] = f"{self._prefix}.{topic}"
        validate_message(key, dedup_id, headers)
        hdrs = dict(headers) if headers else {}
        hdrs[H_KEY] = key
        hdrs[H_MSG_ID] = dedup_id
        return subject, hdrs

    async def _send(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> asyncio.Future[PublishAck]:
        self._check_open()
        if self._nc.is_closed:
            raise BusUnavailable("NATS connection is closed")
        try:  # the hot path: no context manager per message
            return await self._pipeline.send(subject, payload, headers)
        except NATS_ERRORS as exc:
            raise self._edge.translate(exc, "publish") from exc

    async def publish(
        self,
        topic: str,
        key: str,
        dedup_id: str,
        payload: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> PublishAck:
        self._check_open()
        subject, hdrs = self._encode(topic, key, dedup_id, headers)
        return await (await self._send(subject, payload, hdrs))

    async def publish_many(
        self, messages: Sequence[OutgoingMessage]
    ) -> list[PublishAck | BusError | ValueError]:
        """Sends in input order with up to ``max_in_flight`` unacked; when the window is full it
        waits until half of it has drained (one wake-up per half window, not per message)."""
        self._check_open()
        batch = AckBatch(len(messages))
        results = batch.results
        high = max(1, self._cfg.max_in_flight)
        low = high // 2
        for i, m in enumerate(messages):
            try:
                subject, hdrs = self._encode(m.topic, m.key, m.dedup_id, m.headers)
            except ValueError as exc:
                results[i] = exc
                continue
            if batch.in_flight >= high:
                await batch.drained(low)  # every message settles within publish_timeout_s
            try:  # the hot path: no context manager per message
                self._check_open()
                if self._nc.is_closed:
                    raise BusUnavailable("NATS connection is closed")
                await self._pipeline.send_to(batch, i, subject, m.payload, hdrs)
            except NATS_ERRORS as exc:
                results[i] = self._edge.translate(exc, "publish")
            except BusError as exc:
                results[i] = exc
        await batch.drained(0)  # one wake-up when the last ack is in
        return [r if r is not None else BusError("not published") for r in results]

    # -- consuming -------------------------------------------------------------------------

    def consumer_name(self, topic: str, group: str) -> str:
        # Groups have no "_" and topics no "_", so the first "_" splits the name unambiguously.
        return f"{group}_{topic.replace('.', '_')}"

    async def subscribe(
        self, topic: str, group: str, *, start: Literal["all", "new"] = "all"
    ) -> JetStreamConsumer:
        self._check_open()
        validate_topic(topic)
        validate_group(group)
        name = self.consumer_name(topic, group)
        config = api.ConsumerConfig(
            name=name,
            durable_name=name,
            deliver_policy=api.DeliverPolicy.ALL if start == "all" else api.DeliverPolicy.NEW,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self._cfg.ack_wait_s,
            # Unlimited at the server: this adapter dead-letters on fetch (see _dead_letter_due).
            max_deliver=-1,
            filter_subject=f"{self._prefix}.{topic}",
            max_ack_pending=self._cfg.max_ack_pending,
            replay_policy=api.ReplayPolicy.INSTANT,
        )
        with self._edge(f"create consumer {name}"):
            try:
                # Create-or-update; an identical config is a no-op, so concurrent joins are fine.
                await self._js.add_consumer(self._cfg.stream, config)
            except nats.js.errors.BadRequestError:
                # Exists with another deliver policy (not updatable): ``start`` only applies at
                # creation, so adopt the existing one's and update the rest.
                info = await self._js.consumer_info(self._cfg.stream, name)
                config.deliver_policy = info.config.deliver_policy
                config.opt_start_seq = info.config.opt_start_seq
                config.opt_start_time = info.config.opt_start_time
                await self._js.add_consumer(self._cfg.stream, config)
            puller = PullFetcher(self._nc, self._cfg.stream, name)
            await puller.start()
        consumer = JetStreamConsumer(self, topic, group, name, puller)
        self._consumers.append(consumer)
        return consumer

    # -- dead letters ----------------------------------------------------------------------

    async def _dead_letter(self, msg: Msg, group: str, topic: str, reason: str) -> None:
        """Store a copy in the DLQ stream (deduplicated per consumer and stream sequence, so a
        crash before the ``term`` below only causes a duplicate the window absorbs), then
        terminate the original so the consumer never delivers it again."""
        md = msg.metadata
        headers = user_headers(msg.headers)
        original = msg.headers or {}
        headers.update(
            {
                H_KEY: original.get(H_KEY, ""),
                H_DEDUP: original.get(H_DEDUP) or original.get(H_MSG_ID, ""),
                H_GROUP: group,
                H_TOPIC: topic,
                H_DELIVERIES: str(min(md.num_delivered, self._cfg.max_deliver)),
                H_REASON: reason.replace("\r", " ").replace("\n", " ")[:500],
                H_DEAD_AT: f"{time.time():.3f}",
                H_ORIGIN_SEQ: str(md.sequence.stream),
                H_MSG_ID: f"dlq:{group}:{topic}:{md.sequence.stream}",
            }
        )
        subject = f"{self._dlq_prefix}.{group}.{topic}"
        await (await self._send(subject, msg.data, headers))
        with self._edge("terminate dead-lettered message"):
            await msg.term()
        DEAD_LETTERS.labels(topic, group, reason_class(reason)).inc()

    async def dead_letters(self, group: str, limit: int = 100) -> list[DeadLetter]:
        self._check_open()
        validate_group(group)
        out: list[DeadLetter] = []
        seq = 1
        with self._edge("list dead letters"):
            while len(out) < limit:
                try:
                    raw = await self._js.get_msg(
                        self.dlq_stream, seq=seq, subject=f"{self._dlq_prefix}.{group}.>", next=True
                    )
                except nats.js.errors.NotFoundError:
                    break
                out.append(self._to_dead_letter(raw))
                seq = int(raw.seq or seq) + 1
        return out

    def _to_dead_letter(self, raw: api.RawStreamMsg) -> DeadLetter:
        h: dict[str, str] = dict(raw.headers or {})
        return DeadLetter(
            id=str(raw.seq),
            group=h.get(H_GROUP, ""),
            topic=h.get(H_TOPIC, ""),
            key=h.get(H_KEY, ""),
            dedup_id=h.get(H_DEDUP, ""),
            data=raw.data or b"",
            headers=user_headers(h),
            deliveries=int(h.get(H_DELIVERIES, "0")),
            reason=h.get(H_REASON, ""),
            dead_at=float(h.get(H_DEAD_AT, "0")),
        )

    async def replay_dead_letter(self, group: str, dead_letter_id: str) -> PublishAck:
        self._check_open()
        validate_group(group)
        try:
            seq = int(dead_letter_id)
        except ValueError:
            raise BusError(f"no dead letter {dead_letter_id!r}") from None
        with self._edge("read dead letter"):
            try:
                raw = await self._js.get_msg(self.dlq_stream, seq=seq)
            except nats.js.errors.NotFoundError:
                raise BusError(f"no dead letter {dead_letter_id!r} in group {group!r}") from None
        letter = self._to_dead_letter(raw)
        if letter.group != group:
            raise BusError(f"no dead letter {dead_letter_id!r} in group {group!r}")
        headers = dict(letter.headers)
        headers[H_KEY] = letter.key
        headers[H_DEDUP] = letter.dedup_id
        # Deduplicated, so replaying the same dead letter twice (e.g. two operators) sends once.
        headers[H_MSG_ID] = f"replay:{group}:{seq}"
        headers[H_ONLY_GROUP] = group
        ack = await (await self._send(f"{self._prefix}.{letter.topic}", letter.data, headers))
        # NotFound: replayed concurrently by someone else.
        with (
            self._edge("delete replayed dead letter"),
            contextlib.suppress(nats.js.errors.NotFoundError),
        ):
            await self._js.delete_msg(self.dlq_stream, seq)
        return ack


async def _close_quietly(nc: NatsClient) -> None:
    try:
        await nc.close()
    except Exception as exc:  # closing a half-open client must never mask the real error
        log.debug("closing NATS client: %r", exc)


if TYPE_CHECKING:  # static proof that the adapter implements the port

    def _conforms(
        b: JetStreamBus, c: JetStreamConsumer, d: JetStreamDelivery
    ) -> tuple[Bus, Consumer, Delivery]:
        return b, c, d
