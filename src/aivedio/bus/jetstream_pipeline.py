"""nats-py plumbing for the JetStream adapter: error translation at the edge and a pipelined
publisher whose every future settles within a deadline."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from aivedio.bus.port import BusClosed, BusError, BusUnavailable, PublishAck

__all__ = ["NATS_ERRORS", "UNAVAILABLE", "AckPipeline", "Edge"]

UNAVAILABLE: tuple[type[BaseException], ...] = (
    TimeoutError,  # nats.errors.TimeoutError and asyncio's are subclasses
    nats.errors.NoRespondersError,
    nats.errors.NoServersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.errors.UnexpectedEOF,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    OSError,
)
NATS_ERRORS: tuple[type[BaseException], ...] = (nats.errors.Error, *UNAVAILABLE)


class Edge:
    """Translates nats-py errors into the port's errors (the adapter edge)."""

    def __init__(self, closed: Callable[[], bool]) -> None:
        self._closed = closed

    def translate(self, exc: BaseException, what: str) -> BusError:
        if isinstance(exc, BusError):
            return exc
        if isinstance(exc, nats.errors.ConnectionClosedError):
            if self._closed():
                return BusClosed(f"{what}: the bus is closed")
            return BusUnavailable(f"{what}: NATS connection closed")
        if isinstance(exc, UNAVAILABLE):
            return BusUnavailable(f"{what}: NATS unavailable ({type(exc).__name__})")
        return BusError(f"{what}: {exc}")

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        try:
            yield
        except BusError:
            raise
        except NATS_ERRORS as exc:
            raise self.translate(exc, what) from exc


class AckPipeline:
    """Pipelined JetStream publishing on core NATS: publish with a reply subject under one
    wildcard inbox, resolve a future per message when the PubAck arrives.

    This is what ``JetStreamContext.publish_async`` does, done here because (a) nats-py 2.16's
    ``_handle_async_reply`` calls ``APIError.from_error`` which *raises*, so a rejected publish
    leaves the future pending forever (nats-py issue #985), and (b) its futures have no timeout,
    so a PubAck lost in a reconnect never resolves. Every future here settles within
    ``timeout_s``: with the PubAck, the broker's error, or ``BusUnavailable``.
    """

    def __init__(self, nc: NatsClient, timeout_s: float) -> None:
        self._nc = nc
        self._timeout_s = timeout_s
        self._prefix = ""
        self._tokens = itertools.count()
        self._pending: dict[str, asyncio.Future[PublishAck]] = {}
        # Deadlines in send order (the timeout is constant, so they are sorted): one timer
        # sweeps them, instead of one timer per message.
        self._deadlines: deque[tuple[float, str]] = deque()
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        self._prefix = self._nc.new_inbox()
        await self._nc.subscribe(self._prefix + ".*", cb=self._on_reply)

    async def send(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> asyncio.Future[PublishAck]:
        """Publish; the returned future settles within ``timeout_s``. Raises nats errors."""
        loop = asyncio.get_running_loop()
        token = str(next(self._tokens))
        future: asyncio.Future[PublishAck] = loop.create_future()
        self._pending[token] = future
        deadline = loop.time() + self._timeout_s
        self._deadlines.append((deadline, token))
        if self._sweeper is None:
            self._sweeper = loop.call_at(deadline, self._sweep)
        try:
            await self._nc.publish(
                subject, payload, reply=f"{self._prefix}.{token}", headers=headers
            )
        except BaseException:
            self._pending.pop(token, None)
            future.cancel()
            raise
        return future

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, token = self._deadlines.popleft()
            future = self._pending.pop(token, None)
            if future is not None and not future.done():
                state = "connected" if self._nc.is_connected else "not connected"
                future.set_exception(
                    BusUnavailable(f"no JetStream ack within {self._timeout_s}s (NATS {state})")
                )
        self._sweeper = (
            loop.call_at(self._deadlines[0][0], self._sweep) if self._deadlines else None
        )

    def fail_all(self, exc: BusError) -> None:
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(exc)
        self._pending.clear()
        self._deadlines.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    async def _on_reply(self, msg: Msg) -> None:
        future = self._pending.pop(msg.subject[len(self._prefix) + 1 :], None)
        if future is None or future.done():
            return
        if msg.headers and msg.headers.get("Status") == "503":
            # No responders: no stream listens on the subject (JetStream restarting / stream
            # deleted). Transient from the caller's point of view.
            future.set_exception(BusUnavailable("no JetStream stream answered the publish"))
            return
        try:
            resp = json.loads(msg.data)
            if "error" in resp:
                err = resp["error"]
                kind = BusUnavailable if err.get("code") == 503 else BusError
                future.set_exception(kind(f"JetStream rejected the publish: {err}"))
                return
            future.set_result(
                PublishAck(
                    stream=str(resp["stream"]),
                    sequence=int(resp["seq"]),
                    duplicate=bool(resp.get("duplicate", False)),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            future.set_exception(BusError(f"unreadable JetStream PubAck: {exc}"))
