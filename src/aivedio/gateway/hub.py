"""The node's subscriptions: one fan-out subscription, per-project streams, fan-out.

One subscription (:class:`~aivedio.fanout.Subscription`, Redis Pub/Sub in production) for the
whole node: the broadcast channel (``fanout="broadcast"``), or only this node's own channel
``<prefix>:node:<id>`` (``fanout="node"``: the dispatcher publishes there the events of the
projects this node registered, see ``routing.py``). Every message is decoded and its frame
encoded ONCE, then the project's stream hands the same bytes to each of its sessions. The
fan-out is at-most-once; the stream's gap repair and the tail check make delivery exact.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from aivedio.fanout import FanoutError, FanoutSubscriber, Message, Subscribed, Subscription
from aivedio.gateway import metrics
from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.frames import make_event, timing_comment
from aivedio.gateway.resume import ProjectStream
from aivedio.gateway.session import Session
from aivedio.gateway.store import EventStore
from aivedio.gateway.transport import corked
from aivedio.logs import log
from aivedio.process import health

logger = logging.getLogger("aivedio.gateway")


class Hub:
    def __init__(
        self,
        fanout: FanoutSubscriber,
        store: EventStore,
        config: GatewayConfig,
        on_subscribed: Callable[[], None] = lambda: None,
        *,
        channel: str | None = None,
        on_project: Callable[[uuid.UUID, bool], None] = lambda _project, _watched: None,
    ) -> None:
        self.fanout = fanout
        self.store = store
        self.config = config
        self.channel = channel or config.channel  # the one channel this node subscribes to
        self.streams: dict[uuid.UUID, ProjectStream] = {}
        self.on_subscribed = on_subscribed  # the tail check runs right after every (re)subscribe
        # (project, True) when its first stream opens, (project, False) when the last one goes:
        # node routes are registered and dropped from here.
        self.on_project = on_project
        self.subscribed = asyncio.Event()

    # -- sessions --------------------------------------------------------------------------

    async def join(self, session: Session) -> tuple[ProjectStream, int]:
        """Subscribe a session to its project; returns the stream and its ``last`` at joining.

        From this moment on every event after that ``last`` reaches the session's backlog.
        """
        stream = self.streams.get(session.project_id)
        if stream is None:
            stream = ProjectStream(session.project_id, self.store, self.config)
            self.streams[session.project_id] = stream
            self.on_project(session.project_id, True)  # before the position is read
            starting = asyncio.ensure_future(stream.start())
        else:
            starting = None
        stream.joining += 1
        try:
            if starting is not None:
                await starting
            else:
                await asyncio.shield(stream.ready)
        except BaseException:
            stream.joining -= 1
            self._drop_if_idle(stream)
            raise
        stream.joining -= 1
        stream.sessions.add(session)
        return stream, stream.last

    def leave(self, session: Session) -> None:
        stream = self.streams.get(session.project_id)
        if stream is not None:
            stream.sessions.discard(session)
            self._drop_if_idle(stream)

    def _drop_if_idle(self, stream: ProjectStream) -> None:
        if not stream.sessions and stream.joining == 0:
            if self.streams.get(stream.project_id) is stream:
                del self.streams[stream.project_id]
                self.on_project(stream.project_id, False)
            stream.close()

    def sessions(self) -> list[Session]:
        return [s for stream in self.streams.values() for s in stream.sessions]

    # -- the fan-out -----------------------------------------------------------------------

    def on_message(self, data: bytes | str) -> None:
        try:
            message: dict[str, Any] = json.loads(data)
            stream = self.streams.get(uuid.UUID(str(message["project_id"])))
            if stream is None:
                return
            epoch, seq = int(message["epoch"]), int(message["seq"])
            public = dict(message["public"])
            public.setdefault("task_id", message.get("task_id"))
            public.setdefault("task_version", message.get("task_version"))
        except (ValueError, KeyError, TypeError) as exc:
            log(logger, logging.WARNING, "unreadable pub/sub message", error=repr(exc))
            return
        comment = ""
        if self.config.timing:  # diagnostic, off by default: see GatewayConfig.timing
            relayed, dispatched = message.get("relayed_at"), message.get("dispatched_at")
            comment = timing_comment(relayed, dispatched, time.time())
        stored_at, trace_id = message.get("stored_at"), message.get("trace_id")
        stream.on_live(
            epoch,
            make_event(
                epoch,
                seq,
                public,
                comment,
                stored_at=stored_at if isinstance(stored_at, float | int) else None,
                trace_id=trace_id if isinstance(trace_id, str) else None,
            ),
        )

    async def run(self, stopping: asyncio.Event) -> None:
        """Keep one subscription to the channel; after every (re)subscribe, a tail check."""
        backoff = 0.1
        while not stopping.is_set():
            subscription = self.fanout.subscription()
            try:
                await subscription.subscribe(self.channel)
                while not stopping.is_set():
                    event = await subscription.next(timeout=1.0)
                    while event is not None:
                        if isinstance(event, Subscribed):
                            # First subscribe, or the adapter's own reconnect re-subscribed:
                            # messages may have been lost in between.
                            metrics.REDIS_RECONNECTS.inc()
                            health.recovered()
                            self.subscribed.set()
                            self.on_subscribed()
                            backoff = 0.1
                            event = None
                        else:
                            event = await self._deliver_arrived(subscription, event.data)
            except FanoutError as exc:
                self.subscribed.clear()
                log(logger, logging.WARNING, "pub/sub connection lost", error=repr(exc))
                health.outage(self.fanout.service, exc)
                await asyncio.sleep(random.uniform(0, backoff))
                backoff = min(backoff * 2, 5.0)
            finally:
                await subscription.close()

    async def _deliver_arrived(self, subscription: Subscription, first: bytes) -> Subscribed | None:
        """Deliver ``first`` at once, then every message that has already arrived behind it (up
        to ``max_corked``) in one ``corked()`` scope: when the node fell behind, each connection
        gets the frames of several events in one write. Nothing waits for a message that has not
        arrived, so a node that keeps up delivers every event alone, at once. Returns a
        re-subscribe met on the way, for the caller to handle next."""
        self.on_message(first)
        batch: list[bytes] = []
        other: Subscribed | None = None
        while len(batch) < self.config.max_corked - 1:
            event = await subscription.next(timeout=0.0)
            if event is None:
                break
            if not isinstance(event, Message):
                other = event
                break
            batch.append(event.data)
        if batch:
            with corked():
                for data in batch:
                    self.on_message(data)
        return other

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()
