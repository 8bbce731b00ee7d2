"""The gateway: accepts SSE requests and WebSocket upgrades handed over by the HTTP server and
runs their lifecycle; both transports share everything below.

Open: connect rate -> parse -> (WebSocket: Origin allow-list) -> authenticate (tenant + project)
-> per-user/tenant limits -> response head + ``retry:`` (SSE) or the 101 answer (WebSocket) ->
join the project stream (subscribe FIRST) -> read the position -> replay or ``reset`` -> live.
WebSocket commands (subscribe, unsubscribe, resume) are handled here too.
Close: one log line with reason and duration (seed 004).
Background: the fan-out subscription, the heartbeat wheel, the tail check, credential re-checks,
batched counter releases, polling-interest marks and (node fan-out) this node's routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid

from redis.asyncio import Redis

from aivedio.channels import node_channel
from aivedio.db.pool import Database
from aivedio.errors import DatabaseUnavailable
from aivedio.fanout import FanoutSubscriber
from aivedio.fanout.redis import RedisFanout
from aivedio.gateway import frames, metrics
from aivedio.gateway.auth import (
    Refused,
    StreamTokens,
    authenticate,
    connection_lifetime,
    revoked_credentials,
)
from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.commands import Command, CommandError, parse_command
from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.hub import Hub
from aivedio.gateway.limits import ConnectionCounters, ConnectRate
from aivedio.gateway.outage import Outages
from aivedio.gateway.protocol import BadRequest, Cursor, StreamRequest, origin_allowed, parse_head
from aivedio.gateway.resume import resume
from aivedio.gateway.routing import (
    InterestMarks,
    NodeRoutes,
    Target,
    check_node_id,
    new_node_id,
)
from aivedio.gateway.session import NOTHING, Identity, Session
from aivedio.gateway.store import EventStore
from aivedio.gateway.tailcheck import TailCheck
from aivedio.gateway.timers import Wheel
from aivedio.gateway.transport import SseTransport
from aivedio.gateway.websocket import WsTransport
from aivedio.logs import log
from aivedio.process.health import Health
from aivedio.process.parts import Loop
from aivedio.process.supervisor import supervise

logger = logging.getLogger("aivedio.gateway")

StreamTransport = SseTransport | WsTransport


class Gateway:
    def __init__(
        self,
        db: Database,
        config: GatewayConfig,
        redis: Redis | None = None,
        *,
        health: Health | None = None,
        fanout: FanoutSubscriber | None = None,
    ) -> None:
        self.config = config
        # The background jobs run supervised (restarted when they fail), as loops of the role
        # ``gateway`` in the process's health (``/readyz``) when it is given.
        self.health = health if health is not None else Health()
        self.store = EventStore(db)
        self.redis = redis if redis is not None else _redis_client(config)
        self.tailcheck: TailCheck
        # Fan-out: the broadcast channel, or this node's own channel plus its routes in Redis.
        if config.fanout not in ("broadcast", "node"):
            raise ValueError(f"fanout is 'broadcast' or 'node', not {config.fanout!r}")
        self.node_id = check_node_id(config.node_id or new_node_id())
        self.routes: NodeRoutes | None = None
        channel = self._fanout_channel()
        # The events arrive by the fan-out: Redis Pub/Sub on the same client unless given.
        self.fanout = fanout if fanout is not None else RedisFanout(self.redis)
        self.hub = Hub(
            self.fanout,
            self.store,
            config,
            on_subscribed=self._on_subscribed,
            channel=channel,
            on_project=self._on_project,
        )
        metrics.watch(self.hub)
        self.tailcheck = TailCheck(self.hub, self.store, config)
        self.interest = InterestMarks(
            self.redis,
            self._interest_targets,
            ttl_s=config.interest_ttl_s,
            prefix=config.interest_prefix,
            timeout_s=config.redis_timeout_s,
        )
        self.wheel = Wheel(config.heartbeat_s)
        self.tokens = StreamTokens(config.token_secret) if config.token_secret else None
        self.rate = ConnectRate(config.connect_rate_per_s, config.connect_burst)
        self.counters = ConnectionCounters(
            self.redis,
            config.key_prefix,
            int(config.session_cap_s * config.counter_ttl_factor) + 60,
            config.max_conns_per_user,
            config.max_conns_per_tenant,
        )
        self.by_key: dict[uuid.UUID, set[Session]] = {}
        self.uncounted: set[Session] = set()
        self.draining = False
        self.outages = Outages()
        self._opening: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._jobs: list[asyncio.Task[None]] = []

    def _fanout_channel(self) -> str:
        """The channel this node listens on: the broadcast channel, or (``node`` fan-out) its
        own channel, with its routes in Redis set up in ``self.routes``."""
        config = self.config
        if config.fanout == "broadcast":
            return config.channel
        self.routes = NodeRoutes(
            self.redis,
            config.channel_prefix,
            self.node_id,
            ttl_s=config.route_ttl_s,
            timeout_s=config.redis_timeout_s,
            on_registered=self._on_registered,
        )
        return node_channel(config.channel_prefix, self.node_id)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        jobs: list[tuple[str, Loop]] = [
            ("hub", self.hub.run),
            ("heartbeats", self.wheel.run),
            ("tailcheck", self.tailcheck.run),
            ("recheck", self._recheck_loop),
            ("counters", self.counters.run),
            ("interest", self.interest.run),
        ]
        if self.routes is not None:
            jobs.append(("routes", self.routes.run))
        for name, job in jobs:
            unit = self.health.unit("gateway", name)
            self._jobs.append(
                asyncio.create_task(supervise(unit, job, self._stopping), name=f"gateway/{name}")
            )

    async def wait_subscribed(self) -> None:
        await self.hub.subscribed.wait()

    def _on_subscribed(self) -> None:
        """After every Redis (re)subscribe: messages may have been lost, and a restarted Redis
        has forgotten this node's routes and interest marks."""
        self.tailcheck.wake()
        self.interest.remark()
        if self.routes is not None:
            self.routes.reregister()

    # -- routes and interest ---------------------------------------------------------------

    def _on_project(self, project_id: uuid.UUID, watched: bool) -> None:
        if self.routes is not None:
            if watched:
                self.routes.add(project_id)
            else:
                self.routes.discard(project_id)

    def _on_registered(self, project_ids: list[uuid.UUID]) -> None:
        """A dispatcher may have published events of these projects before it learned the
        route: check their heads shortly (a registration race costs at most this delay)."""
        self.tailcheck.soon(project_ids, self.config.route_check_delay_s)

    @staticmethod
    def interest_target(session: Session) -> Target | None:
        """What a session watches, for the poller: its task, or its whole project."""
        if session.task_filter is None:
            return ("project", str(session.project_id))
        if session.task_filter == NOTHING:
            return None
        return ("task", session.task_filter)

    def _interest_targets(self) -> set[Target]:
        targets: set[Target] = set()
        for session in self.hub.sessions():
            target = self.interest_target(session)
            if target is not None:
                targets.add(target)
        return targets

    async def drain(self) -> None:
        """Refuse new streams, then close the open ones spread over ``drain_s`` (reconnects of
        thousands of clients do not arrive at the other nodes all at once)."""
        self.draining = True
        sessions = self.hub.sessions()
        random.shuffle(sessions)
        steps = max(1, int(self.config.drain_s / 0.1))
        batch = max(1, -(-len(sessions) // steps))
        for i in range(0, len(sessions), batch):
            for session in sessions[i : i + batch]:
                session.close(CloseReason.SHUTDOWN)
            if i + batch < len(sessions):
                await asyncio.sleep(0.1)

    def kill(self, project_id: uuid.UUID, seconds: float) -> int:
        """The sandbox's stream outage: cut the project's streams on this node with no goodbye
        frame and refuse its new ones for ``seconds``; how many streams were cut."""
        self.outages.start(project_id, seconds)
        cut = [s for s in self.hub.sessions() if s.project_id == project_id]
        for session in cut:
            session.close(CloseReason.KILLED)
        return len(cut)

    async def close(self) -> None:
        self._stopping.set()
        for task in list(self._opening):
            task.cancel()
        await asyncio.gather(*self._jobs, *self._opening, return_exceptions=True)
        await self.counters.flush()
        self.hub.close()
        await self.redis.aclose()

    # -- open ----------------------------------------------------------------------------

    def accept(self, transport: StreamTransport, head: bytes) -> None:
        """A complete stream request head arrived on ``transport`` (synchronous; spawns the
        open). The server picked the transport by path; ``parse_head`` checks the rest."""
        if self.draining:
            self._refuse(
                transport, 503, "shutdown", "the gateway is shutting down", {"Retry-After": "1"}
            )
            return
        wait = self.rate.take()
        if wait > 0:
            self._refuse(
                transport,
                503,
                "rate_limited",
                "too many new connections",
                {"Retry-After": str(max(1, round(wait)))},
            )
            return
        try:
            req = parse_head(head)
        except BadRequest as exc:
            self._refuse(transport, exc.status, "bad_request", str(exc), exc.headers)
            return
        if req.websocket != isinstance(transport, WsTransport):
            self._refuse(transport, 400, "bad_request", "not a stream request", {})
            return
        if req.websocket and not origin_allowed(req, self.config.ws_allowed_origins):
            self._refuse(transport, 403, "origin_not_allowed", "this Origin may not connect", {})
            return
        task = asyncio.create_task(self._open(transport, req))
        self._opening.add(task)
        task.add_done_callback(self._opening.discard)

    def _refuse(
        self,
        transport: StreamTransport,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str],
    ) -> None:
        metrics.REFUSED.labels(code).inc()
        transport.reject(status, code, message, headers)

    async def _open(self, transport: StreamTransport, req: StreamRequest) -> None:
        session: Session | None = None
        try:
            try:
                identity = await authenticate(self.store, self.tokens, req)
            except Refused as exc:
                headers = (
                    {"WWW-Authenticate": 'Bearer realm="aivedio"'} if exc.status == 401 else {}
                )
                self._refuse(transport, exc.status, exc.code, exc.message, headers)
                return
            outage = self.outages.active(req.project_id)
            if outage > 0:
                retry = {"Retry-After": str(max(1, round(outage)))}
                self._refuse(transport, 503, "stream_outage", "a stream outage (chaos)", retry)
                return
            counted = await self.counters.acquire(identity)
            if isinstance(counted, str):
                self._refuse(
                    transport,
                    429,
                    "too_many_connections",
                    f"too many open streams for this {counted}",
                    {"Retry-After": "5"},
                )
                return
            if not transport.writable:  # the client went away meanwhile
                if counted is None:
                    self.counters.release(identity)
                return
            session = self._session(transport, req, identity)
            if counted is False:
                self.uncounted.add(session)
            transport.session = session
            if isinstance(transport, WsTransport):
                assert req.ws_key is not None
                transport.commands = self.command
                transport.upgrade(req.ws_key)
            else:
                transport.begin(self.config.retry_ms)
            stream, joined_at = await self.hub.join(session)
            if session.closed is not None:
                self.hub.leave(session)
                return
            self.by_key.setdefault(identity.credential_id, set()).add(session)
            self.wheel.add(session)
            self.interest.note(self.interest_target(session))
            metrics.CONNECTIONS.labels(transport.kind).inc()
            metrics.OPENED.labels(transport.kind).inc()
            position = await self.store.position(req.project_id)
            if position is None:
                session.close(CloseReason.FORBIDDEN)
                return
            await resume(session, stream, req.cursor, position, joined_at, self.store, self.config)
        except (DatabaseUnavailable, LookupError, OSError) as exc:
            log(logger, logging.WARNING, "stream open failed", error=repr(exc))
            if session is None:
                self._refuse(transport, 503, "unavailable", "retry later", {"Retry-After": "2"})
            else:
                session.close(CloseReason.SERVER_ERROR)

    def _session(
        self, transport: StreamTransport, req: StreamRequest, identity: Identity
    ) -> Session:
        cap = connection_lifetime(identity, self.config.session_cap_s)
        return Session(
            transport,
            self,
            self.config,
            req.project_id,
            identity,
            req.task_id,
            time.monotonic() + cap,
        )

    # -- WebSocket commands --------------------------------------------------------------

    def command(self, session: Session, text: str) -> None:
        """A client's text frame (synchronous: the reply is written in order with events)."""
        try:
            cmd = parse_command(text)
        except CommandError as exc:
            self._reply(session, exc.request_id, exc.code, exc.message)
            return
        if cmd.type == "subscribe":
            session.task_filter = cmd.task_id
            self.interest.note(self.interest_target(session))
        elif cmd.type == "unsubscribe":
            session.task_filter = NOTHING
        elif session.backlog is not None or session.pending is not None:
            self._reply(session, cmd.request_id, "busy", "a replay or a backlog is in progress")
            return
        else:
            self._reply(session, cmd.request_id)
            assert cmd.after is not None
            task = asyncio.create_task(self._resume_command(session, cmd, cmd.after))
            self._opening.add(task)
            task.add_done_callback(self._opening.discard)
            return
        self._reply(session, cmd.request_id)

    def _reply(
        self, session: Session, request_id: str | int | None, code: str = "", message: str = ""
    ) -> None:
        data: dict[str, object] = {"type": "error" if code else "ack", "request_id": request_id}
        if code:
            data |= {"code": code, "message": message}
        session.write_control(frames.reply_event(data))

    async def _resume_command(self, session: Session, cmd: Command, after: Cursor) -> None:
        """``resume`` on an open connection: the same algorithm as on connect (the session is
        already subscribed; from now on live events wait in its backlog)."""
        stream = self.hub.streams.get(session.project_id)
        if stream is None or session.closed is not None:
            return
        session.backlog = []
        joined_at = stream.last
        try:
            position = await self.store.position(session.project_id)
            if position is None:
                session.close(CloseReason.FORBIDDEN)
                return
            await resume(session, stream, after, position, joined_at, self.store, self.config)
        except (DatabaseUnavailable, OSError) as exc:
            log(logger, logging.WARNING, "resume command failed", error=repr(exc))
            session.close(CloseReason.SERVER_ERROR)

    # -- close ---------------------------------------------------------------------------

    def forget(self, session: Session, reason: CloseReason) -> None:
        """Called once per session when it closes, whatever closed it."""
        self.hub.leave(session)
        self.wheel.remove(session)
        sessions = self.by_key.get(session.identity.credential_id)
        registered = sessions is not None and session in sessions
        if sessions is not None:
            sessions.discard(session)
            if not sessions:
                del self.by_key[session.identity.credential_id]
        if session in self.uncounted:
            self.uncounted.discard(session)
        else:
            self.counters.release(session.identity)
        if registered:
            metrics.CONNECTIONS.labels(session.transport.kind).dec()
        metrics.CLOSED.labels(reason.label).inc()
        if reason is CloseReason.SLOW:
            metrics.SLOW.inc()
        log(
            logger,
            logging.INFO,
            "stream closed",
            transport=session.transport.kind,
            reason=reason.label,
            code=reason.code,
            duration_s=round(time.monotonic() - session.opened_at, 3),
            project_id=str(session.project_id),
            user_id=str(session.identity.user_id),
            last_seq=session.sent,
        )

    async def _recheck_loop(self, stopping: asyncio.Event) -> None:
        """Revoked credentials close their streams within ``recheck_s``."""
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.config.recheck_s)
            if stopping.is_set() or not self.by_key:
                continue
            try:
                revoked = await revoked_credentials(self.store.db, list(self.by_key))
            except (DatabaseUnavailable, OSError) as exc:
                log(logger, logging.WARNING, "credential re-check failed", error=repr(exc))
                continue
            for key_id in revoked:
                for session in list(self.by_key.get(key_id, ())):
                    session.close(CloseReason.CREDENTIAL_REVOKED)

    @property
    def connections(self) -> int:
        return sum(len(s) for s in self.by_key.values())


def _redis_client(config: GatewayConfig) -> Redis:
    return Redis.from_url(
        config.redis_url,
        socket_timeout=config.redis_timeout_s,
        socket_connect_timeout=config.redis_timeout_s,
    )
