"""HTTP/1.1 request framing for the lean callback path, pure: bytes in, decisions out.

No sockets, no asyncio, no logging: :class:`RequestFramer` takes bytes from the start of a
buffer its caller keeps and says where each part of a request ends. It is what
:class:`aivedio.ingest.http.CallbackProtocol` runs on its connection's buffer; :class:`Framing`
drives the same steps over a stream fed in pieces and reports :data:`Event` values, which is
how ``tests/unit/test_http_framing_vs_h11.py`` compares it with h11. The decisions:

- a head ends at the first blank line (``CRLF CRLF``), which must come within ``head_limit``
  bytes, else :class:`Refused` 431;
- a request line that is not ``<method> <prefix...> <version>`` is not ours
  (:data:`NOT_OURS`): nothing of it is taken, so the request handed back starts exactly where
  the previous one ended;
- the head is parsed by httptools (llhttp, strict), fed exactly those bytes: what it refuses is
  400, among them obs-fold, a ``Content-Length`` that is not digits (signed, negative, a list)
  or is sent twice, ``Content-Length`` with ``Transfer-Encoding``, a repeated
  ``Transfer-Encoding``, a protocol upgrade; so is a head whose end the parser places
  elsewhere, and a transfer coding other than ``chunked`` alone (RFC 9112 6.1);
- a ``Content-Length`` body over the caller's limit is 413 before any of it is read; otherwise
  the body is that many bytes, and the parser must agree it ended there (else 400);
- a chunked body (extensions and trailers allowed; a chunk size past 64 bits, or anything else
  llhttp refuses, is 400) is fed to the parser a line at a time, so it can only end just after
  a line feed; it is counted as it arrives, and the piece that passes the limit is 413.

Keep-alive and ``Connection: close`` are not decided here (the protocol's job); the parser's
:attr:`RequestFramer.keep_alive` is reported. The import-linter contract ``pure-framing`` keeps
the event loop, sockets and logging out of this module.
"""

from __future__ import annotations

from typing import NamedTuple

import httptools

__all__ = [
    "NEED_DATA",
    "NOT_OURS",
    "Body",
    "End",
    "Event",
    "Framing",
    "HandBack",
    "Head",
    "Refuse",
    "Refused",
    "RequestFramer",
]

NEED_DATA = 0
"""From :meth:`RequestFramer.read_head`: the head's end has not arrived yet."""
NOT_OURS = -1
"""From :meth:`RequestFramer.read_head`: not a request for the prefix; nothing was taken."""


class Refused(Exception):
    """The request cannot be read on: answer ``status`` (400, 413, 431) and close."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(status, reason)
        self.status = status
        self.reason = reason


class RequestFramer:
    """One connection's request framing, over bytes at the start of the caller's buffer.

    Per request: :meth:`read_head`; then, unless :attr:`complete` (no body), :meth:`start_body`
    with the body limit and :meth:`read_body` until :attr:`complete`; then :meth:`take_body`.
    Each step returns how many bytes of the buffer it took (the caller drops them) or raises
    :class:`Refused`. ``note`` names one header (lower case) whose last value is kept in
    :attr:`noted`, so that the caller need not search :attr:`headers` for it.
    """

    __slots__ = (
        "_lengths",
        "_note",
        "body",
        "body_limit",
        "body_size",
        "chunked",
        "complete",
        "content_length",
        "expect_continue",
        "head_limit",
        "headers",
        "headers_done",
        "keep_alive",
        "method",
        "noted",
        "other_coding",
        "parser",
        "prefix",
        "remaining",
        "url",
    )

    def __init__(self, head_limit: int, prefix: bytes = b"/", note: bytes = b"") -> None:
        self.head_limit = head_limit
        self.prefix = prefix
        self._note = note
        # expect, content-length, transfer-encoding: the names on_header looks at
        self._lengths = frozenset({6, 14, 17, len(note)} if note else {6, 14, 17})
        self.parser = httptools.HttpRequestParser(self)
        self.method = b""
        self.keep_alive = True
        self.body_limit = 0
        self.chunked = False
        self.remaining = 0  # of a Content-Length body
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []  # then the trailers, if any
        self.content_length = -1  # -1: none (then chunked, or no body)
        self.other_coding = False  # a transfer coding other than chunked alone
        self.expect_continue = False
        self.noted: bytes | None = None
        self.headers_done = False
        self.body: list[bytes] = []
        self.body_size = 0
        self.complete = False

    # -- httptools callbacks ------------------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        if len(name) in self._lengths:
            lowered = name.lower()
            if lowered == b"transfer-encoding":
                self.other_coding = self.other_coding or value.strip().lower() != b"chunked"
            elif lowered == b"content-length":
                self.content_length = int(value)  # llhttp checked the digits
            elif lowered == self._note:
                self.noted = value
            elif lowered == b"expect":
                self.expect_continue = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.keep_alive = self.parser.should_keep_alive()
        self.method = self.parser.get_method()

    def on_body(self, body: bytes) -> None:
        self.body_size += len(body)
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # -- the steps ----------------------------------------------------------------------------

    def read_head(self, buffer: bytes) -> int:
        """The next request's head, from the start of ``buffer``: its length once read (the
        fields above are set), :data:`NEED_DATA` or :data:`NOT_OURS`. Raises :class:`Refused`
        431 (no blank line within ``head_limit``; :attr:`url` is the request line's target, if
        any) or 400."""
        limit = self.head_limit
        end = buffer.find(b"\r\n\r\n", 0, limit)
        if end < 0:
            if len(buffer) >= limit:
                self._reset()
                line_end = buffer.find(b"\r\n", 0, limit)
                target = buffer[:line_end].split(b" ")[1:2] if line_end >= 0 else []
                if target:
                    self.url = target[0]
                raise Refused(431, "head_too_large")
            return NEED_DATA
        line_end = buffer.find(b"\r\n")
        parts = buffer[:line_end].split(b" ")
        if len(parts) != 3 or not parts[1].startswith(self.prefix):
            return NOT_OURS
        self._reset()
        size = end + 4
        self._feed(buffer if size == len(buffer) else buffer[:size])
        if not self.headers_done:  # our blank line is not the parser's end of the head
            raise Refused(400, "head_end")
        if self.other_coding:  # framing we would not decode (RFC 9112 6.1), as h11 refuses it
            raise Refused(400, "transfer_coding")
        return size

    def start_body(self, limit: int) -> None:
        """The body of the head just read is read within ``limit`` bytes: a ``Content-Length``
        over it raises :class:`Refused` 413 now, before any of the body."""
        self.body_limit = limit
        self.chunked = self.content_length < 0
        self.remaining = self.content_length
        if self.content_length > limit:
            raise Refused(413, "body_too_large")

    def read_body(self, buffer: bytes) -> int:
        """Body bytes from the start of ``buffer``: how many were taken; :attr:`complete` once
        the message ended there. Raises :class:`Refused` 400 or 413 (past the limit)."""
        if not self.chunked:
            take = min(self.remaining, len(buffer))
            self.remaining -= take
        else:  # a chunked body can only end just after a line feed: feed a line at a time
            newline = buffer.find(b"\n")
            take = len(buffer) if newline < 0 else newline + 1
        self._feed(buffer if take == len(buffer) else buffer[:take])
        if self.body_size > self.body_limit:  # stop here; the rest is never read
            raise Refused(413, "body_too_large")
        if not self.complete and not self.chunked and self.remaining == 0:
            raise Refused(400, "body_end")  # the parser disagrees on the length
        return take

    def take_body(self) -> bytes:
        """The body of the message just completed, in one piece."""
        body = self.body
        return body[0] if len(body) == 1 else b"".join(body)

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise Refused(400, "upgrade") from None  # no protocol upgrades here
        except httptools.HttpParserError as exc:
            raise Refused(400, str(exc)) from None


# -- the same steps as events over a stream -------------------------------------------------


class Head(NamedTuple):
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]  # as sent (names not lower-cased)


class Body(NamedTuple):
    data: bytes


class End(NamedTuple):
    offset: int  # in the stream: where the next message starts
    trailers: list[tuple[bytes, bytes]]


class HandBack(NamedTuple):
    offset: int  # in the stream: where the request that is not ours starts


class Refuse(NamedTuple):
    status: int
    reason: str


Event = Head | Body | End | HandBack | Refuse


class Framing:
    """:class:`RequestFramer` over a stream fed in pieces, as
    :meth:`aivedio.ingest.http.CallbackProtocol._process` runs it: every body read within
    ``body_limit``. After a :class:`HandBack` or :class:`Refuse` nothing more is read."""

    def __init__(self, head_limit: int, body_limit: int, prefix: bytes = b"/") -> None:
        self.framer = RequestFramer(head_limit, prefix)
        self.body_limit = body_limit
        self.buffer = b""
        self.offset = 0  # of buffer[0] in the stream
        self.in_body = False
        self.head_size = 0  # how many of framer.headers are the head's (the rest: trailers)
        self.stopped = False

    def feed(self, data: bytes) -> list[Event]:
        events: list[Event] = []
        if self.stopped:
            return events
        self.buffer += data
        try:
            while self.buffer and not self.stopped:
                if self.in_body:
                    self._body(events)
                elif not self._head(events):
                    break  # the head's end has not arrived
        except Refused as refusal:
            events.append(Refuse(refusal.status, refusal.reason))
            self.stopped = True
        return events

    def _take(self, size: int) -> None:
        self.buffer = self.buffer[size:]
        self.offset += size

    def _head(self, events: list[Event]) -> bool:
        framer = self.framer
        size = framer.read_head(self.buffer)
        if size == NEED_DATA:
            return False
        if size == NOT_OURS:
            events.append(HandBack(self.offset))
            self.stopped = True
            return True
        self._take(size)
        self.head_size = len(framer.headers)
        events.append(Head(framer.method, framer.url, list(framer.headers)))
        if framer.complete:
            events.append(End(self.offset, []))
            return True
        framer.start_body(self.body_limit)
        self.in_body = True
        return True

    def _body(self, events: list[Event]) -> None:
        framer = self.framer
        parts = len(framer.body)
        try:
            self._take(framer.read_body(self.buffer))
        finally:  # the body as far as it was read, also before a refusal
            events.extend(Body(piece) for piece in framer.body[parts:])
        if framer.complete:
            self.in_body = False
            events.append(End(self.offset, framer.headers[self.head_size :]))
