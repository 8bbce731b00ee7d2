"""Every use of nats-py internals, in one place, with a probe that they exist.

The JetStream adapter is faster than nats-py's public API in three spots, each relying on
nats-py private names (pyproject pins nats-py to the tested minor release):

* :class:`RawWriter` writes pre-encoded frames into the client's buffer (``_send_command``,
  ``_flush_pending``, ``_flush_queue``, ``_pending_data_size``, ``_max_pending_size``).
* :func:`fast_headers` replaces ``Client._parse_header_lines`` with a faster parser.
* :class:`_RawRouter` takes ``Client._process_msg`` over for our inboxes (``Subscription._id``).

:func:`probe` checks that every name exists on the installed nats-py. If one is missing, the
adapter logs it once and uses the public API for all three (``Client.publish``, nats-py's own
header parser, callback subscriptions): slower, same behaviour. :func:`public_api_only` forces
that path (the bus contract suite runs the adapter both ways). Building a ``Msg`` for
settlements (its ``_client`` field) has no public alternative; the probe refuses to start
without it.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Mapping

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from aivedio.bus.port import BusError

__all__ = [
    "Pulled",
    "RawHandler",
    "RawWriter",
    "fast_headers",
    "internals_enabled",
    "probe",
    "public_api_only",
    "subscribe_direct",
    "unsubscribe_direct",
]

log = logging.getLogger("aivedio.bus.jetstream")

_CLIENT_METHODS = ("_send_command", "_flush_pending", "_process_msg", "_parse_header_lines")
_CLIENT_ATTRIBUTES = ("_flush_queue", "_pending_data_size", "_max_pending_size")
_SUBSCRIPTION_ATTRIBUTES = ("_id",)


class _Switch:
    enabled: bool | None = None  # None: not probed yet
    forced_off: bool = False


def missing_internals() -> list[str]:
    """The nats-py private names this module uses that the installed nats-py lacks."""
    missing = [f"Client.{n}" for n in _CLIENT_METHODS if not callable(getattr(NatsClient, n, None))]
    client = NatsClient()
    missing += [f"Client().{n}" for n in _CLIENT_ATTRIBUTES if not hasattr(client, n)]
    fields = getattr(Subscription.__init__, "__code__", None)
    names = fields.co_names + fields.co_varnames if fields else ()
    missing += [f"Subscription.{n}" for n in _SUBSCRIPTION_ATTRIBUTES if n not in names]
    return missing


def probe() -> bool:
    """Check the internals once (at the adapter's start-up): ``True`` if they are all there.
    Raises ``BusError`` if ``Msg`` cannot be built the way the adapter needs."""
    fields = getattr(Msg, "__dataclass_fields__", {})
    if "_client" not in fields or "_ackd" not in fields or not hasattr(Msg, "is_acked"):
        raise BusError(
            "this nats-py has no Msg._client / Msg._ackd fields or Msg.is_acked: "
            "install the nats-py version pyproject.toml pins"
        )
    if _Switch.enabled is None:
        missing = missing_internals()
        _Switch.enabled = not missing
        if missing:
            log.warning(
                "nats-py internals missing, using its public API (slower): %s", ", ".join(missing)
            )
    return internals_enabled()


def internals_enabled() -> bool:
    if _Switch.forced_off:
        return False
    if _Switch.enabled is None:
        probe()
    return bool(_Switch.enabled)


@contextlib.contextmanager
def public_api_only() -> Iterator[None]:
    """Inside: clients connected from now on use only nats-py's public API."""
    before = _Switch.forced_off
    _Switch.forced_off = True
    try:
        yield
    finally:
        _Switch.forced_off = before


_HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # nats-py's own rule


class RawWriter:
    """Pre-encoded protocol frames straight into nats-py's outgoing buffer.

    ``Client.publish`` costs ~10 us per message in Python (subject validation twice, a header
    loop with a regex per header, a bytearray, an f-string, stats); the relay publishes and the
    dispatcher acks every event, so this builds each frame with one f-string and hands it to
    the same buffer and flusher ``publish`` uses (``_send_command`` / ``_flush_pending``, the
    same checks and buffering during a reconnect). Headers that nats-py would rewrite (a value
    with CR/LF or outer blanks, an unusual name) make ``hpub`` return ``None``: the caller then
    goes through ``Client.publish``. A nats-py without these internals (``supported`` false)
    sends everything through ``Client.publish``; pyproject pins the tested nats-py range.
    """

    _INTERNALS = (
        "_send_command",
        "_flush_pending",
        "_flush_queue",
        "_pending_data_size",
        "_max_pending_size",
    )

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._keys: set[str] = set()  # header names that passed the check
        self.supported = internals_enabled() and all(hasattr(nc, n) for n in self._INTERNALS)

    async def ack(self, subject: str) -> None:
        """What ``Msg.ack`` sends: an empty message to ``subject``."""
        if self.supported:
            await self.write(f"PUB {subject} 0\r\n\r\n".encode())
        else:
            await self._nc.publish(subject, b"")

    async def write(self, frame: bytes) -> None:
        """Queue ``frame``; raises the nats errors ``Client.publish`` raises."""
        nc = self._nc
        if nc.is_closed:
            raise nats.errors.ConnectionClosedError
        if nc.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        if not nc.is_connected:
            limit = nc._max_pending_size
            if limit <= 0 or len(frame) + nc._pending_data_size > limit:
                raise nats.errors.OutboundBufferLimitError
        await nc._send_command(frame)
        flush_queue = nc._flush_queue
        if flush_queue is not None and flush_queue.empty():
            await nc._flush_pending()

    def hpub(
        self, subject: str, reply: str, payload: bytes, headers: Mapping[str, str]
    ) -> bytes | None:
        """The HPUB frame, or ``None`` if ``Client.publish`` must encode these headers."""
        if not self.supported:
            return None
        if len(payload) > self._nc.max_payload:
            raise nats.errors.MaxPayloadError
        lines = ["NATS/1.0\r\n"]
        for key, value in headers.items():
            if key not in self._keys:
                if not _HEADER_KEY.fullmatch(key) or len(self._keys) > 100:
                    return None
                self._keys.add(key)
            if "\n" in value or "\r" in value or value.strip() != value:
                return None
            lines.append(f"{key}: {value}\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode()
        size = len(head)
        return b"".join(
            (
                f"HPUB {subject} {reply} {size} {size + len(payload)}\r\n".encode(),
                head,
                payload,
                b"\r\n",
            )
        )


_OWS = " \t\n\r\x0b\x0c"  # what bytes.strip() strips
_SPACE = re.compile(r"\s")


def _header_lines(raw: bytes, slow: Callable[[bytes], dict[str, str]]) -> dict[str, str]:
    """``Client._parse_header_lines`` for ASCII header blocks, ~3x faster (no generator per
    header name); anything else goes to nats-py's own parser. Same result: lines split on the
    first ``:``, name and value stripped like ``bytes.strip``, names with blanks skipped."""
    text = raw.decode("ascii", "replace")
    if "\ufffd" in text:
        return slow(raw)
    out: dict[str, str] = {}
    for line in text.split("\r\n"):
        name, sep, value = line.partition(":")
        if not sep:
            continue
        key = name.strip(_OWS)
        if _SPACE.search(key) is None:
            out[key] = value.strip(_OWS)
    return out


def _utf8_header_lines(raw: bytes) -> dict[str, str]:
    """The public-API path's parser for non-ASCII header blocks (nats-py's rule, in UTF-8)."""
    out: dict[str, str] = {}
    for line in raw.decode("utf-8", "replace").split("\r\n"):
        name, sep, value = line.partition(":")
        key = name.strip(_OWS)
        if sep and _SPACE.search(key) is None:
            out[key] = value.strip(_OWS)
    return out


def fast_headers(nc: NatsClient) -> None:
    """Give ``nc`` the faster header parser (every delivery carries two or more headers)."""
    slow = getattr(type(nc), "_parse_header_lines", None)
    if internals_enabled() and callable(slow):
        nc._parse_header_lines = lambda raw: _header_lines(raw, slow)  # type: ignore[method-assign]


RawHandler = Callable[[bytes, bytes, bytes, "bytes | None"], None]


class _RawRouter:
    """Messages of our inboxes straight from nats-py's parser to a plain handler.

    nats-py's parser calls ``Client._process_msg(sid, subject, reply, data, headers)`` per
    message, which parses the header block, builds a ``Msg`` and queues it for the
    subscription's task (a queue put, a get and a task switch). For the PubAck and pull inboxes
    this router takes the raw parts instead (subject, reply, payload, header block as bytes);
    the handler parses what it needs. Other subscriptions take nats-py's path unchanged.
    """

    def __init__(self, nc: NatsClient) -> None:
        self._original = nc._process_msg
        self.handlers: dict[int, RawHandler] = {}
        nc._process_msg = self._process  # type: ignore[method-assign]

    async def _process(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        handler = self.handlers.get(sid)
        if handler is None:
            await self._original(sid, subject, reply, data, headers)  # type: ignore[arg-type]
            return
        try:
            handler(subject, reply, data, headers)
        except Exception:  # an error must not reach (and reset) nats-py's read loop
            log.exception("NATS message handler failed")


def _router(nc: NatsClient) -> _RawRouter | None:
    if not internals_enabled():
        return None
    router: _RawRouter | None = getattr(nc, "_aivedio_router", None)
    if router is None and callable(getattr(nc, "_process_msg", None)):
        router = _RawRouter(nc)
        nc._aivedio_router = router  # type: ignore[attr-defined]
    return router


def _raw_headers(headers: Mapping[str, str] | None) -> bytes | None:
    """A header block as the server sent it, from nats-py's parsed headers (fallback path)."""
    if not headers:
        return None
    status = headers.get("Status", "")
    lines = [f"NATS/1.0 {status}\r\n" if status else "NATS/1.0\r\n"]
    lines += [f"{k}: {v}\r\n" for k, v in headers.items() if k not in ("Status", "Description")]
    return ("".join(lines) + "\r\n").encode()


async def subscribe_direct(nc: NatsClient, subject: str, handler: RawHandler) -> Subscription:
    """Subscribe with ``handler`` called from the read loop with the raw message parts (see
    :class:`_RawRouter`); with a nats-py whose internals differ, a callback subscription that
    hands the handler the same parts."""
    router = _router(nc)
    if router is not None:
        sub = await nc.subscribe(subject)
        sid = getattr(sub, "_id", None)
        if isinstance(sid, int):
            router.handlers[sid] = handler
            return sub
        await sub.unsubscribe()

    async def callback(msg: Msg) -> None:
        handler(msg.subject.encode(), msg.reply.encode(), msg.data, _raw_headers(msg.headers))

    return await nc.subscribe(subject, cb=callback)


def unsubscribe_direct(nc: NatsClient, sub: Subscription) -> None:
    router: _RawRouter | None = getattr(nc, "_aivedio_router", None)
    if router is not None:
        router.handlers.pop(getattr(sub, "_id", -1), None)


class Pulled:
    """One message of a pull request, headers parsed only when asked; :meth:`msg` builds the
    nats-py ``Msg`` for the rarer settlements (nak, in progress, term, dead letter)."""

    __slots__ = ("_headers", "_msg", "_nc", "_raw", "acked", "data", "reply", "subject")

    def __init__(
        self, nc: NatsClient, subject: str, reply: str, data: bytes, raw: bytes | None
    ) -> None:
        self._nc = nc
        self.subject = subject
        self.reply = reply
        self.data = data
        self._raw = raw
        self._headers: dict[str, str] | bool | None = False  # False: not parsed yet
        self._msg: Msg | None = None
        self.acked = False

    @property
    def headers(self) -> dict[str, str] | None:
        if self._headers is False:
            raw = self._raw
            parsed: dict[str, str] | None = None
            if raw is not None and len(raw) > 12:
                slow = (
                    type(self._nc)._parse_header_lines
                    if internals_enabled()
                    else _utf8_header_lines
                )
                if raw[8:9] == b" ":  # a status line first: rare for a delivery
                    end = raw.find(b"\r\n")
                    parsed = _header_lines(raw[end + 2 :], slow) if end > 0 else {}
                else:
                    parsed = _header_lines(raw[10:], slow)
            self._headers = parsed or None
        return self._headers if isinstance(self._headers, dict) else None

    def has_header(self, name: bytes) -> bool:
        """Cheap pre-check: could the block hold header ``name``?"""
        return self._raw is not None and name in self._raw

    def msg(self) -> Msg:
        if self._msg is None:
            self._msg = Msg(
                _client=self._nc,
                subject=self.subject,
                reply=self.reply,
                data=self.data,
                headers=self.headers,
            )
        self._msg._ackd = self.acked or self._msg._ackd
        return self._msg
