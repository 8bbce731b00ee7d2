"""The outbound half of the provider contract, and the provider's side of the conversation.

:class:`OutboundContract` (a base of :class:`tests.contract.provider_contract.ProviderContract`)
checks the error mapping of ``submit``, ``query``, ``cancel`` and ``lookup``. The provider's side:
:class:`Recorder`, an ``httpx.MockTransport`` handler that answers what a case needs and records
every request (the adapter tests use it too, through :func:`answered`), and
:class:`LocalProvider`, a real HTTP/1.1 server on a local socket that refuses, hangs up or
answers, reached through :class:`ToLocal`. The tables name what each answer must become:
``ERROR_CASES`` for any call, ``SUBMIT_CASES`` for a create.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

import httpx
import pytest

from aivedio.providers.port import (
    AuthFailed,
    MalformedResponse,
    NotFoundYet,
    ProviderAdapter,
    ProviderError,
    ProviderUnavailable,
    RateLimited,
    SubmitOutcomeUnknown,
    SubmitRequest,
    Unsupported,
)

Handler = Callable[[httpx.Request], httpx.Response]


class Recorder:
    """A MockTransport handler that records requests and answers with ``respond``."""

    def __init__(self, respond: Handler) -> None:
        self.respond = respond
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.respond(request)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self))


def raising(exc: Exception) -> Handler:
    def respond(request: httpx.Request) -> httpx.Response:
        raise exc

    return respond


async def answered(
    make: Callable[[httpx.AsyncClient], ProviderAdapter],
    respond: Handler,
    call: Callable[[ProviderAdapter], Awaitable[Any]],
) -> tuple[Any, list[httpx.Request]]:
    """``call`` on an adapter whose provider answers with ``respond``; the result and requests."""
    recorder = Recorder(respond)
    async with recorder.client() as client:
        result = await call(make(client))
    return result, recorder.requests


# What any call does with each answer (query, cancel and lookup; a create has its own table).
ERROR_CASES: list[tuple[str, Handler, type[ProviderError]]] = [
    ("429", lambda r: httpx.Response(429, headers={"Retry-After": "7"}), RateLimited),
    ("500", lambda r: httpx.Response(500, json={"error": "boom"}), ProviderUnavailable),
    ("502", lambda r: httpx.Response(502, text="bad gateway"), ProviderUnavailable),
    ("503", lambda r: httpx.Response(503), ProviderUnavailable),
    ("401", lambda r: httpx.Response(401, json={"error": "no"}), AuthFailed),
    ("403", lambda r: httpx.Response(403), AuthFailed),
    ("read_timeout", raising(httpx.ReadTimeout("slow")), ProviderUnavailable),
    ("connect_error", raising(httpx.ConnectError("refused")), ProviderUnavailable),
]
NOT_FOUND: tuple[str, Handler, type[ProviderError]] = (
    "404",
    lambda r: httpx.Response(404, json={"error": "not found"}),
    NotFoundYet,
)
MALFORMED_CASES: list[tuple[str, Handler, type[ProviderError]]] = [
    ("not_json", lambda r: httpx.Response(200, text="<html>oops</html>"), MalformedResponse),
    ("not_object", lambda r: httpx.Response(200, json=["x"]), MalformedResponse),
]
# A create is never retried by the adapter; an answer lost after sending is "unknown".
SUBMIT_CASES: list[tuple[str, Handler, type[ProviderError]]] = [
    ("429", lambda r: httpx.Response(429, headers={"Retry-After": "3"}), RateLimited),
    ("500", lambda r: httpx.Response(500), ProviderUnavailable),
    ("503", lambda r: httpx.Response(503), ProviderUnavailable),
    ("401", lambda r: httpx.Response(401), AuthFailed),
    ("read_timeout", raising(httpx.ReadTimeout("slow")), SubmitOutcomeUnknown),
    ("reset", raising(httpx.RemoteProtocolError("reset")), SubmitOutcomeUnknown),
    ("connect_error", raising(httpx.ConnectError("refused")), ProviderUnavailable),
    ("connect_timeout", raising(httpx.ConnectTimeout("refused")), ProviderUnavailable),
    *MALFORMED_CASES,
]


class LocalProvider:
    """A real HTTP/1.1 server on 127.0.0.1 (port 0) standing in for the provider: it reads each
    request whole, then answers ``response`` (raw bytes) or, when that is None, hangs up
    without a word. ``requests`` counts the requests it read."""

    def __init__(self, response: bytes | None) -> None:
        self.response = response
        self.requests = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> LocalProvider:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            self.requests += 1
            if self.response is not None:
                writer.write(self.response)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class ToLocal(httpx.AsyncBaseTransport):
    """The adapter's requests, to its own provider URLs, sent over a real socket to ``port``."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._real = httpx.AsyncHTTPTransport(retries=0)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(scheme="http", host="127.0.0.1", port=self._port)
        return await self._real.handle_async_request(request)

    async def aclose(self) -> None:
        await self._real.aclose()


def refused_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def http_answer(status: str, headers: str = "", body: bytes = b"") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\n{headers}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


class OutboundContract:
    """Every outbound failure is a named :class:`ProviderError`, and a create is sent once."""

    cancels: ClassVar[bool] = True
    """False: the provider has no cancel (``cancel`` raises :class:`Unsupported`)."""
    task_id: ClassVar[str] = "job_1"

    def make(
        self, client: httpx.AsyncClient | None = None, *, keys: Sequence[str] = ("k0",)
    ) -> ProviderAdapter:
        """The adapter (on ``client`` when given) with the callback keys (secrets) named by
        ``keys`` active, the first being the current one."""
        raise NotImplementedError

    def submit_request(self) -> SubmitRequest:
        return SubmitRequest(client_request_id="cr_1", model="m", prompt="p")

    async def _check(
        self,
        cases: Sequence[tuple[str, Handler, type[ProviderError]]],
        call: Callable[[ProviderAdapter], Awaitable[Any]],
    ) -> list[list[httpx.Request]]:
        sent: list[list[httpx.Request]] = []
        for name, respond, expected in cases:
            recorder = Recorder(respond)
            async with recorder.client() as client:
                with pytest.raises(expected) as caught:
                    await call(self.make(client))
            assert len(recorder.requests) == 1, name  # sent once, never retried here
            error = caught.value
            if isinstance(error, RateLimited):
                assert error.retry_after_s in (3.0, 7.0), name
            if isinstance(error, MalformedResponse):
                assert "<html>" not in error.sample or len(error.sample) <= 300
            if isinstance(error, ProviderUnavailable | AuthFailed):
                assert "boom" not in str(error) and "sk_" not in str(error)
            sent.append(recorder.requests)
        return sent

    async def test_query_error_mapping(self) -> None:
        await self._check(
            [*ERROR_CASES, NOT_FOUND, *MALFORMED_CASES], lambda a: a.query(self.task_id)
        )

    async def test_create_is_sent_once_whatever_happens(self) -> None:
        request = self.submit_request()
        for requests in await self._check(SUBMIT_CASES, lambda a: a.submit(request)):
            assert requests[0].method == "POST"
            assert requests[0].headers["idempotency-key"] == request.client_request_id

    async def _over_a_socket(
        self,
        port: int,
        call: Callable[[ProviderAdapter], Awaitable[Any]],
        expected: type[ProviderError],
    ) -> ProviderError:
        async with httpx.AsyncClient(transport=ToLocal(port)) as client:
            with pytest.raises(expected) as caught:
                await call(self.make(client))
        return caught.value

    async def test_errors_over_a_real_socket(self) -> None:
        """The same mapping when a real peer refuses, hangs up or answers: what httpx raises
        for real sockets, not what a mock chose to raise."""
        request = self.submit_request()

        async def submit(adapter: ProviderAdapter) -> Any:
            return await adapter.submit(request)

        async def query(adapter: ProviderAdapter) -> Any:
            return await adapter.query(self.task_id)

        for call in (submit, query):  # nothing listens: the request never left
            await self._over_a_socket(refused_port(), call, ProviderUnavailable)
        for call, expected in ((submit, SubmitOutcomeUnknown), (query, ProviderUnavailable)):
            async with LocalProvider(None) as provider:  # read the request, then hung up
                await self._over_a_socket(provider.port, call, expected)
            assert provider.requests == 1
        answers: list[tuple[bytes, type[ProviderError]]] = [
            (http_answer("429 Too Many Requests", "Retry-After: 5\r\n"), RateLimited),
            (http_answer("503 Service Unavailable"), ProviderUnavailable),
            (http_answer("401 Unauthorized"), AuthFailed),
            (http_answer("200 OK", "Content-Type: text/html\r\n", b"<html>"), MalformedResponse),
        ]
        for call in (submit, query):
            for answer, expected in answers:
                async with LocalProvider(answer) as provider:
                    error = await self._over_a_socket(provider.port, call, expected)
                assert provider.requests == 1  # sent once
                if isinstance(error, RateLimited):
                    assert error.retry_after_s == 5.0

    async def _unsupported(self, call: Callable[[ProviderAdapter], Awaitable[Any]]) -> None:
        """Refused with :class:`Unsupported` before anything is sent."""
        recorder = Recorder(lambda r: httpx.Response(200))
        async with recorder.client() as client:
            with pytest.raises(Unsupported):
                await call(self.make(client))
        assert recorder.requests == []

    async def test_cancel_error_mapping(self) -> None:
        if not self.cancels:
            await self._unsupported(lambda a: a.cancel(self.task_id))
            return
        await self._check(ERROR_CASES, lambda a: a.cancel(self.task_id))

    async def test_lookup_error_mapping(self) -> None:
        if not self.make().supports_lookup:
            await self._unsupported(lambda a: a.lookup("cr_1"))
            return
        await self._check(ERROR_CASES, lambda a: a.lookup("cr_1"))
