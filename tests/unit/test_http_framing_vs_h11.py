"""The lean callback path's HTTP/1.1 request framing (``ingest/http_framing.py``) against h11.

Hypothesis writes pipelined streams of requests whose framing varies: Content-Length, chunked
with odd chunk sizes, size spellings, extensions and trailers, heads up to the cap, and the
malformed and smuggling cases (both length headers, a length sent twice, signed, negative or
not digits, obs-fold, other or repeated transfer codings, chunk sizes past 64 bits or without
their CRLF, oversize heads, bodies over the limit); a request that is not a callback may come
between them, and the stream may end inside a valid request. h11 reads the stream as a server
would; :class:`Framing` (the framer ``CallbackProtocol`` runs) reads it in arbitrary pieces, as
they arrive on a socket. Request by request they must agree on the head, the body, the trailers
and where the next request starts; where h11 refuses, the framer refuses that request and reads
nothing more; a request that is not a callback is handed back exactly where the previous one
ended.

Where the two differ on purpose it is named in ``STRICTER``, with the reasons of
``tests/integration/test_ingest_http_vs_h11.py`` (RFC 9112 6.3 lets a server refuse both
Content-Length and Transfer-Encoding, where h11 lets chunked win; a Content-Length sent twice
with one value, which h11 merges; obs-fold, which h11 unfolds and RFC 9112 5.2 lets a server
refuse) and four of the framer's own: no protocol upgrade on the callback path (h11 reads the
request, then pauses); whitespace after a chunk size with no extension, outside RFC 9112 7.1's
grammar, which h11 skips; the head cap, which h11 applies only to a head still incomplete in its
buffer; the body limit, which h11 does not have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import h11
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aivedio.ingest.http_framing import Body, End, Event, Framing, HandBack, Head, Refuse

HEAD_LIMIT = 2048
BODY_LIMIT = 512
PREFIX = b"/v1/callbacks/"

READ = ("length", "chunked", "chunked-upper", "big-head")  # both read these
REFUSED = (  # both refuse these
    "length,other",
    "signed-length",
    "negative-length",
    "length-junk",
    "gzip,chunked",
    "identity",
    "chunked,chunked",
    "chunk-overflow",
    "chunk-bare-lf",
    "chunk-no-crlf",
)
STRICTER = frozenset(
    {
        "length+chunked",
        "chunked+length",
        "length,length",
        "obs-fold",
        "upgrade",
        "chunk-size-ows",
        "oversize-head",
        "length-over-limit",
        "chunked-over-limit",
    }
)
NOT_OURS = ("not-ours", "bad-request-line")  # handed back: the framer does not judge them
FRAMINGS = READ + REFUSED + tuple(sorted(STRICTER)) + NOT_OURS
STATUS = {"oversize-head": 431, "length-over-limit": 413, "chunked-over-limit": 413}  # else 400

EXTENSIONS = (b"", b";x=y", b";x", b";a=1;b=2")
SIZES = (b"%x", b"%X", b"000%x")  # how a chunk size is spelled


@dataclass(frozen=True)
class Message:
    framing: str
    body: bytes
    chunks: tuple[int, ...]  # chunk sizes for the chunked framings (the rest in one chunk)
    extension: bytes
    size_format: bytes
    trailer: bool
    headers: tuple[tuple[bytes, bytes], ...]
    target: bytes
    pad: int  # for the heads sized against the cap


def _chunked(m: Message) -> bytes:
    body, out, at = m.body, [], 0
    sizes = [*m.chunks, len(body)]
    for size in sizes:
        piece = body[at : at + size]
        if not piece:
            break
        out.append(_chunk_line(m, len(piece)) + piece + _chunk_end(m))
        at += len(piece)
    out.append(b"0\r\n" + (b"x-trailer: t\r\n" if m.trailer else b"") + b"\r\n")
    return b"".join(out)


def _chunk_line(m: Message, size: int) -> bytes:
    if m.framing == "chunk-overflow":
        return b"1" + b"0" * 24 + b"\r\n"
    spelled = m.size_format % size
    if m.framing == "chunk-size-ows":
        return spelled + b" \r\n"
    return spelled + m.extension + (b"\n" if m.framing == "chunk-bare-lf" else b"\r\n")


def _chunk_end(m: Message) -> bytes:
    return b"XX" if m.framing == "chunk-no-crlf" else b"\r\n"


def _head(m: Message, *fields: bytes, line: bytes | None = None) -> bytes:
    lines = [line or b"POST " + PREFIX + m.target + b" HTTP/1.1", b"host: example.test"]
    lines += [b"content-type: application/json"]
    lines += [name + b":" + value for name, value in m.headers]
    lines += fields
    head = b"\r\n".join(lines) + b"\r\n"
    if m.framing in ("big-head", "oversize-head"):  # a head of HEAD_LIMIT - pad, or past it
        size = HEAD_LIMIT - m.pad if m.framing == "big-head" else HEAD_LIMIT + 1 + m.pad
        head += b"x-pad: " + b"p" * (size - len(head) - len(b"x-pad: \r\n\r\n")) + b"\r\n"
    return head + b"\r\n"


def encode(m: Message) -> bytes:
    f, body, n = m.framing, m.body, len(m.body)
    length = b"content-length: %d" % n
    te = b"transfer-encoding: chunked"
    simple = {
        "length": (length,),
        "big-head": (length,),
        "oversize-head": (length,),
        "length-over-limit": (length,),
        "length,length": (length, length),
        "length,other": (length, b"content-length: %d" % (n + 1)),
        "signed-length": (b"content-length: +%d" % n,),
        "negative-length": (b"content-length: -%d" % n,),
        "length-junk": (b"content-length: %da" % n,),
        "obs-fold": (b"x-folded: a\r\n b", length),
        "upgrade": (b"connection: upgrade", b"upgrade: h2c", length),
    }
    if f in simple:
        return _head(m, *simple[f]) + body
    if f == "not-ours":
        return b"GET /v1/tasks/task_1 HTTP/1.1\r\nhost: example.test\r\n\r\n"
    if f == "bad-request-line":
        return _head(m, length, line=b"POST  " + PREFIX + m.target + b" HTTP/1.1") + body
    codings = {
        "chunked-upper": (b"Transfer-Encoding: Chunked",),
        "gzip,chunked": (b"transfer-encoding: gzip, chunked",),
        "identity": (b"transfer-encoding: identity",),
        "chunked,chunked": (te, te),
        "length+chunked": (length, te),
        "chunked+length": (te, length),
    }
    return _head(m, *codings.get(f, (te,))) + _chunked(m)


tokens = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
values = st.builds(
    lambda value, trailing: value.strip().encode() + b" " * trailing,
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20),
    st.integers(0, 2),
)
extra_headers = st.lists(
    st.tuples(tokens.map(lambda t: b"x-" + t.encode()), values.map(lambda v: b" " + v)),
    max_size=4,
).map(tuple)
targets = st.builds(
    lambda name, query: name.encode() + (b"?" + query.encode() if query else b""),
    st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10),
    st.text("abcdefghij=&", max_size=12),
)


@st.composite
def messages(draw: st.DrawFn, framings: tuple[str, ...] = FRAMINGS) -> Message:
    framing = draw(st.sampled_from(framings))
    over = framing.endswith("-over-limit")
    # a chunk-* framing needs a chunk of data to show its fault
    size = (BODY_LIMIT + 1, BODY_LIMIT + 64) if over else (framing.startswith("chunk-"), 200)
    return Message(
        framing=framing,
        body=draw(st.binary(min_size=size[0], max_size=size[1])),
        chunks=tuple(draw(st.lists(st.integers(1, 64 if not over else 300), max_size=5))),
        extension=draw(st.sampled_from(EXTENSIONS)),
        size_format=draw(st.sampled_from(SIZES)),
        trailer=draw(st.booleans()),
        headers=draw(extra_headers),
        target=draw(targets),
        pad=draw(st.integers(0, 200)),
    )


@dataclass
class Read:
    """One complete request as read: what both readers must agree on."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]  # names lower-cased, values without surrounding OWS
    body: bytes
    trailers: list[tuple[bytes, bytes]]
    end: int  # where the next request starts in the stream


def _normal(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """As h11 gives them: names in lower case, values without surrounding whitespace, and
    the transfer codings in lower case."""
    out = [(bytes(name).lower(), bytes(value).strip(b" \t")) for name, value in headers]
    return [(n, v.lower() if n == b"transfer-encoding" else v) for n, v in out]


def h11_reads(stream: bytes) -> tuple[list[Read], bool]:
    """The complete requests h11 reads from ``stream`` (the connection still open), and whether
    it refused the next one."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(stream)
    reads: list[Read] = []
    request: Read | None = None
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return reads, True
        if isinstance(event, h11.Request):
            request = Read(event.method, event.target, _normal(list(event.headers)), b"", [], 0)
        elif isinstance(event, h11.Data):
            assert request is not None
            request.body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            request.trailers = _normal(list(event.headers))
            request.end = len(stream) - len(conn.trailing_data[0])
            reads.append(request)
            conn.send(h11.Response(status_code=204, headers=[]))
            conn.send(h11.EndOfMessage())
            conn.start_next_cycle()
        elif event is h11.NEED_DATA:
            return reads, False
        else:
            raise AssertionError(event)


def framer_reads(stream: bytes, cuts: list[int]) -> tuple[list[Read], Event | None, Read | None]:
    """The complete requests the framer reads from ``stream`` fed in pieces (cut at ``cuts``),
    how it stopped (:class:`Refuse`, :class:`HandBack`, or None: it waits for more) and the
    request it stopped in, as far as it was read."""
    framing = Framing(HEAD_LIMIT, BODY_LIMIT, PREFIX)
    events: list[Event] = []
    at = 0
    for cut in [*sorted(cuts), len(stream)]:
        events += framing.feed(stream[at:cut])
        at = max(at, cut)
    reads: list[Read] = []
    request: Read | None = None
    for event in events:
        if isinstance(event, Head):
            assert request is None, events
            request = Read(event.method, event.target, _normal(event.headers), b"", [], 0)
        elif isinstance(event, Body):
            assert request is not None, events
            request.body += event.data
        elif isinstance(event, End):
            assert request is not None, events
            request.trailers, request.end = _normal(event.trailers), event.offset
            reads.append(request)
            request = None
        else:
            assert event is events[-1], events  # nothing after a refusal or a hand-back
            return reads, event, request
    return reads, None, request


def check(pipeline: list[Message], tail: bytes, cuts: list[int]) -> None:
    stream = b"".join(encode(m) for m in pipeline) + tail
    cuts = [c % (len(stream) + 1) for c in cuts]
    expected, refused = h11_reads(stream)
    sent = [b"" if m.framing == "not-ours" else m.body for m in pipeline]
    assert [r.body for r in expected] == sent[: len(expected)]  # the reference itself
    # where the framer stops: the first request it hands back or refuses on purpose, or h11's
    stop = next(
        (
            i
            for i, m in enumerate(pipeline[: len(expected) + 1])
            if m.framing in NOT_OURS or (m.framing in STRICTER and i < len(expected))
        ),
        len(expected),
    )
    reads, last, partial = framer_reads(stream, cuts)
    assert reads == expected[:stop], (pipeline, last)
    if stop < len(pipeline) and pipeline[stop].framing in NOT_OURS:
        assert last == HandBack(expected[stop - 1].end if stop else 0), (pipeline, last)
    elif stop < len(expected) or refused:
        assert isinstance(last, Refuse), (pipeline, last)
        assert last.status == STATUS.get(pipeline[stop].framing, 400), (pipeline, last)
        if pipeline[stop].framing == "length-over-limit":  # refused before any of the body
            assert partial is not None and partial.body == b"", (pipeline, last)
    else:  # all read, perhaps the start of one more request: the framer waits for the rest
        assert last is None, (pipeline, last)


@st.composite
def tails(draw: st.DrawFn) -> bytes:
    """The start of a valid request, the rest not sent yet (or nothing)."""
    if not draw(st.booleans()):
        return b""
    whole = encode(draw(messages(("length", "chunked"))))
    return whole[: draw(st.integers(0, len(whole) - 1))]


@settings(
    max_examples=1500,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    st.lists(messages(), min_size=1, max_size=5),
    tails(),
    st.lists(st.integers(0, 1 << 16), max_size=12),
)
def test_the_framer_frames_requests_as_h11_does(
    pipeline: list[Message], tail: bytes, cuts: list[int]
) -> None:
    check(pipeline, tail, cuts)


# -- the edges, one example each ---------------------------------------------------------------


def _message(framing: str, body: bytes = b"{}", pad: int = 0) -> Message:
    return Message(framing, body, (), b"", b"%x", False, (), b"fal", pad)


def test_a_head_of_exactly_the_cap_is_read_and_one_byte_more_is_431_byte_by_byte() -> None:
    at_cap = encode(_message("big-head"))
    assert len(at_cap) - len(b"{}") == HEAD_LIMIT
    cuts = list(range(len(at_cap)))  # a byte at a time: the cap does not depend on the pieces
    reads, last, _ = framer_reads(at_cap, cuts)
    assert [r.body for r in reads] == [b"{}"] and last is None
    over = encode(_message("oversize-head", pad=0))
    assert len(over) - len(b"{}") == HEAD_LIMIT + 1
    reads, last, _ = framer_reads(over, list(range(len(over))))
    assert reads == [] and last == Refuse(431, "head_too_large")


def test_a_content_length_over_the_limit_is_413_before_any_of_the_body_arrives() -> None:
    body = b"x" * (BODY_LIMIT + 1)
    head = encode(_message("length-over-limit", body))[: -len(body)]
    events = Framing(HEAD_LIMIT, BODY_LIMIT, PREFIX).feed(head)
    assert [type(e) for e in events] == [Head, Refuse]
    assert events[-1] == Refuse(413, "body_too_large")


def test_a_chunked_body_stops_at_the_piece_that_passes_the_limit() -> None:
    stream = encode(replace(_message("chunked-over-limit", b"y" * 1000), chunks=(100,) * 10))
    framing = Framing(HEAD_LIMIT, BODY_LIMIT, PREFIX)
    events = framing.feed(stream)
    assert events[-1] == Refuse(413, "body_too_large")
    assert sum(len(e.data) for e in events if isinstance(e, Body)) == 600  # a line at a time
    assert framing.feed(b"more") == []  # nothing is read after a refusal


def test_a_request_that_is_not_ours_is_handed_back_where_the_previous_one_ended() -> None:
    first, second = encode(_message("length")), encode(_message("chunked", b"ab\r\ncd"))
    other = encode(_message("not-ours"))
    stream = first + second + other + first
    for cuts in ([], list(range(len(stream)))):
        reads, last, _ = framer_reads(stream, cuts)
        assert [r.end for r in reads] == [len(first), len(first) + len(second)]
        assert last == HandBack(len(first) + len(second))
        assert stream[last.offset :].startswith(b"GET /v1/tasks/")
