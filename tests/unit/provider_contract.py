"""Shared checks every provider adapter's outbound side passes (run from each test_provider_*).

Each check builds the adapter around an ``httpx.MockTransport`` that answers what the case
needs and records every request, then asserts the named error and that a create is sent once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

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
)

Handler = Callable[[httpx.Request], httpx.Response]
Factory = Callable[[httpx.AsyncClient], ProviderAdapter]


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


ERROR_CASES: list[tuple[str, Handler, type[ProviderError]]] = [
    ("429", lambda r: httpx.Response(429, headers={"Retry-After": "7"}), RateLimited),
    ("500", lambda r: httpx.Response(500, json={"error": "boom"}), ProviderUnavailable),
    ("502", lambda r: httpx.Response(502, text="bad gateway"), ProviderUnavailable),
    ("503", lambda r: httpx.Response(503), ProviderUnavailable),
    ("404", lambda r: httpx.Response(404, json={"error": "not found"}), NotFoundYet),
    ("401", lambda r: httpx.Response(401, json={"error": "no"}), AuthFailed),
    ("403", lambda r: httpx.Response(403), AuthFailed),
    ("not_json", lambda r: httpx.Response(200, text="<html>oops</html>"), MalformedResponse),
    ("not_object", lambda r: httpx.Response(200, json=["x"]), MalformedResponse),
    ("read_timeout", raising(httpx.ReadTimeout("slow")), ProviderUnavailable),
    ("connect_error", raising(httpx.ConnectError("refused")), ProviderUnavailable),
]


async def check_query_errors(make: Factory, task_id: str = "job_1") -> None:
    for name, respond, expected in ERROR_CASES:
        recorder = Recorder(respond)
        async with recorder.client() as client:
            adapter = make(client)
            with pytest.raises(expected) as caught:
                await adapter.query(task_id)
        assert len(recorder.requests) == 1, name
        if isinstance(caught.value, RateLimited):
            assert caught.value.retry_after_s == 7.0
        if isinstance(caught.value, MalformedResponse):
            assert "<html>" not in caught.value.sample or len(caught.value.sample) <= 300


async def check_submit_sent_once(make: Factory, request: SubmitRequest) -> None:
    """A create is never retried by the adapter; an answer lost after sending is 'unknown'."""
    cases: list[tuple[Handler, type[ProviderError]]] = [
        (lambda r: httpx.Response(503), ProviderUnavailable),
        (lambda r: httpx.Response(500), ProviderUnavailable),
        (raising(httpx.ReadTimeout("slow")), SubmitOutcomeUnknown),
        (raising(httpx.RemoteProtocolError("reset")), SubmitOutcomeUnknown),
        (raising(httpx.ConnectError("refused")), ProviderUnavailable),
        (raising(httpx.ConnectTimeout("refused")), ProviderUnavailable),
        (lambda r: httpx.Response(429, headers={"Retry-After": "3"}), RateLimited),
        (lambda r: httpx.Response(401), AuthFailed),
    ]
    for respond, expected in cases:
        recorder = Recorder(respond)
        async with recorder.client() as client:
            with pytest.raises(expected):
                await make(client).submit(request)
        assert len(recorder.requests) == 1, expected
        assert recorder.requests[0].headers["idempotency-key"] == request.client_request_id


async def answered(
    make: Factory, respond: Handler, call: Callable[[ProviderAdapter], Awaitable[Any]]
) -> tuple[Any, list[httpx.Request]]:
    recorder = Recorder(respond)
    async with recorder.client() as client:
        result = await call(make(client))
    return result, recorder.requests
