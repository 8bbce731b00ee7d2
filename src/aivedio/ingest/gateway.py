"""The callback gateway: ``POST /v1/callbacks/{provider}``. Check, dedup key, INSERT, 204.

The checks live in :class:`CallbackEndpoint`, independent of any transport:
:meth:`~CallbackEndpoint.begin` runs those that need only the request head (rows 1 to 5); the
transport then reads the body within the provider's limit and ``read_timeout_s`` (rows 5 and 6,
reported with :meth:`~CallbackEndpoint.abort`); :meth:`~CallbackEndpoint.finish` verifies, parses
and stores it (rows 7 to 9). Each returns an :class:`Answer` (status, headers, body). Two
transports use it: the lean HTTP/1.1 protocol of :mod:`aivedio.ingest.http` (the production path,
on the shared port through the sniffer of :mod:`aivedio.process.http_server`), and the endpoint
itself as a plain ASGI callable behind one Starlette ``Route`` (reading the body chunk by chunk).
Each check has its own status and stores nothing; the first that fails answers:

====  ===========================  ======================================================
 #    status (``error.code``)      when
====  ===========================  ======================================================
 1    404 ``not_found``            no provider of that name is configured
 2    405 ``method_not_allowed``   not POST (``Allow: POST``)
 3    415 ``unsupported_media_type``  Content-Type is not ``application/json``
 4    431 ``headers_too_large``    more than ``max_headers`` headers or ``max_header_bytes``
      414 ``uri_too_long``         a query string over ``max_query_bytes``
 5    413 ``body_too_large``       Content-Length over the provider's ``max_body_bytes``
                                   (answered without reading), or the streamed body
                                   passes it (reading stops there)
 6    408 ``request_timeout``      the body did not arrive within ``read_timeout_s``
 7    401 ``unauthorized``         the verifier refused the request; the reason goes only to
                                   ``aivedio_callbacks_rejected_total`` and a log line
      503 ``unavailable``          the verifier could not obtain keys (``keys_unavailable``)
 8    400 ``invalid_encoding``     the body is not UTF-8 (the bytes are not text at all)
      422 ``invalid_json``         UTF-8 but not JSON (NaN / Infinity refused)
      422 ``invalid_payload``      JSON but not an object, nested deeper than
                                   ``max_json_depth``, or holding what PostgreSQL ``jsonb``
                                   cannot store (``\\u0000``, lone surrogates, 1e400)
 9    204                          stored now, or already stored (duplicate)
      503 ``unavailable``          the database is unavailable or the queue is full
                                   (``Retry-After``); nothing is acknowledged uncommitted
      500 ``internal``             the database refused the row, or an adapter hook raised
====  ===========================  ======================================================

A 2xx is sent only after the row's group-commit batch committed (:mod:`.group_commit`).
The values a transport shares with the endpoint (request, answer, refusals) are in
:mod:`.messages`; the body's parsing and the row stored for it in :mod:`.payload`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import parse_qsl

from prometheus_client import Counter
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from aivedio.errors import DatabaseUnavailable
from aivedio.ingest.group_commit import InboxWriter
from aivedio.ingest.inbox_row import InboxClosed, InboxError, InboxFull, InboxRow, Outcome
from aivedio.ingest.messages import (
    NO_CONTENT,
    REFUSALS,
    Answer,
    CallbackRequest,
    Reject,
    error_answer,
)
from aivedio.ingest.payload import ENCODER, inbox_row, parse_body
from aivedio.logs import log, new_trace_id, trace_id_var
from aivedio.providers.port import CallbackProvider, VerificationError, Verified

__all__ = [
    "CallbackConfig",
    "CallbackEndpoint",
    "callback_endpoint",
    "callback_routes",
    "find_callback_endpoint",
]

logger = logging.getLogger("aivedio.ingest")

ACCEPTED = Counter(
    "aivedio_callbacks_accepted_total",
    "Callbacks verified and committed as new inbox rows",
    ["provider", "key_version"],
)
DUPLICATES = Counter(
    "aivedio_callbacks_duplicate_total",
    "Callbacks verified whose dedup key was already stored (answered 204, nothing changed)",
    ["provider"],
)
REJECTED = Counter(
    "aivedio_callbacks_rejected_total",
    "Callbacks answered non-2xx, by reason (verification reason codes or the gateway's own)",
    ["provider", "reason"],
)


@dataclass(frozen=True, slots=True)
class CallbackConfig:
    path: str = "/v1/callbacks/{provider}"
    max_headers: int = 64
    max_header_bytes: int = 16 * 1024
    max_query_bytes: int = 4 * 1024
    read_timeout_s: float = 10.0
    retry_after_s: int = 2
    max_json_depth: int = 64


def _token(request: CallbackRequest) -> str | None:
    """The callback token of an unsigned provider's callback URL (``?token=``)."""
    return dict(parse_qsl(request.query.decode("latin-1"))).get("token") if request.query else None


def _verification_rejection(exc: VerificationError, config: CallbackConfig) -> Reject:
    if exc.retryable:
        retry = str(config.retry_after_s)
        return Reject(503, "unavailable", exc.reason.value, **{"retry-after": retry})
    return Reject(401, "unauthorized", exc.reason.value)


def _store_rejection(exc: BaseException, config: CallbackConfig) -> Reject:
    """Row 9 when the row was not stored: 503 (retry later) or 500."""
    retry = {"retry-after": str(config.retry_after_s)}
    if isinstance(exc, DatabaseUnavailable):
        return Reject(503, "unavailable", "database_unavailable", **retry)
    if isinstance(exc, InboxFull):
        return Reject(503, "unavailable", "queue_full", **retry)
    if isinstance(exc, InboxClosed):
        return Reject(503, "unavailable", "shutting_down", **retry)
    if not isinstance(exc, InboxError):
        log(logger, logging.ERROR, "inbox write failed", error=type(exc).__name__)
    return Reject(500, "internal", "store_failed")


class CallbackEndpoint:
    """``POST /v1/callbacks/{provider}`` (see the module docstring): the checks as methods any
    transport calls, and the ASGI app (``__call__``) for a Starlette ``Route``."""

    def __init__(
        self,
        config: CallbackConfig,
        providers: Mapping[str, CallbackProvider],
        inbox: InboxWriter,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.providers = dict(providers)
        self.inbox = inbox
        self.clock = clock
        self._accepted: dict[tuple[str, str], Any] = {}  # metric children, looked up once
        self._duplicates: dict[str, Any] = {}

    # -- the transport-independent steps ------------------------------------------------------

    def begin(
        self,
        provider_name: str,
        method: str,
        raw_headers: Sequence[tuple[bytes, bytes]],
        query: bytes,
        trace_id: str,
    ) -> CallbackRequest | Answer:
        """Rows 1 to 5 (413 by ``Content-Length``): a :class:`CallbackRequest` whose body the
        transport reads next, or the :class:`Answer` that ends the request here."""
        provider = self.providers.get(provider_name)
        try:
            if provider is None:
                raise Reject(404, "not_found", "unknown_provider")
            return self._head(provider, method, raw_headers, query, trace_id)
        except Reject as rejection:
            label = provider_name if provider is not None else "unknown"
            return self._rejected(label, rejection, trace_id)

    def abort(self, request: CallbackRequest, status: int) -> Answer:
        """The transport stopped reading the body: 413 (the body passed
        :attr:`CallbackRequest.max_body_bytes`), 408 (``read_timeout_s`` passed) or 499 (the
        client went away; nothing can be sent, the answer is only for the record)."""
        return self.refuse(request.provider.name, status, request.trace_id)

    def refuse(self, provider_name: str, status: int, trace_id: str) -> Answer:
        """A refusal the transport decided itself, counted and logged like the others: 400 (not
        HTTP it can parse), 408, 413, 431 (a head past its cap) or 499 (see :meth:`abort`)."""
        code, reason = REFUSALS[status]
        label = provider_name if provider_name in self.providers else "unknown"
        return self._rejected(label, Reject(status, code, reason), trace_id)

    async def finish(self, request: CallbackRequest, body: bytes) -> Answer:
        """Rows 7 to 9: verify the raw ``body``, parse it, store it; 204 only after the commit."""
        provider = request.provider
        try:
            verified = await self._verify(provider, request.headers, body, _token(request))
            row = self._prepare(request, body, verified)
            try:
                outcome = await self.inbox.submit(row)
            except Exception as exc:
                raise _store_rejection(exc, self.config) from None
        except Reject as rejection:
            return self._rejected(provider.name, rejection, request.trace_id)
        return self._stored(request, row, verified, outcome)

    def finish_now(
        self, request: CallbackRequest, body: bytes, reply: Callable[[Answer], None]
    ) -> bool:
        """:meth:`finish` without a coroutine, when the provider's verifier never waits
        (:class:`~aivedio.providers.verify.ImmediateVerifier`): checks now, the row queued with
        :meth:`InboxWriter.enqueue`, and ``reply(answer)`` called once, with the rejection at
        once or with the outcome after the commit. False (nothing done) for another verifier:
        await :meth:`finish` instead."""
        verify_now = getattr(request.provider.verifier, "verify_now", None)
        if verify_now is None:
            return False
        provider = request.provider
        try:
            try:
                verified: Verified = verify_now(
                    request.headers, body, self.clock(), callback_token=_token(request)
                )
            except VerificationError as exc:
                raise _verification_rejection(exc, self.config) from None
            row = self._prepare(request, body, verified)
            try:
                self.inbox.enqueue(row, partial(self._settled, request, row, verified, reply))
            except Exception as exc:
                raise _store_rejection(exc, self.config) from None
        except Reject as rejection:
            reply(self._rejected(provider.name, rejection, request.trace_id))
        return True

    def _settled(
        self,
        request: CallbackRequest,
        row: InboxRow,
        verified: Verified,
        reply: Callable[[Answer], None],
        outcome: Outcome | BaseException,
    ) -> None:
        """The inbox writer's answer for a row of :meth:`finish_now`: always a reply."""
        name = request.provider.name
        try:
            if isinstance(outcome, BaseException):
                rejection = _store_rejection(outcome, self.config)
                answer = self._rejected(name, rejection, request.trace_id)
            else:
                answer = self._stored(request, row, verified, outcome)
        except Exception as exc:  # a bug counting or logging: the row's fate still gets out
            log(logger, logging.ERROR, "callback answer failed", error=type(exc).__name__)
            answer = error_answer(Reject(500, "internal", "internal"), request.trace_id)
        reply(answer)

    async def handle(
        self,
        provider_name: str,
        method: str,
        raw_headers: Sequence[tuple[bytes, bytes]],
        query: bytes,
        body: bytes,
        trace_id: str | None = None,
    ) -> Answer:
        """The whole table for a request whose body was read already (the limit still applies)."""
        started = self.begin(provider_name, method, raw_headers, query, trace_id or new_trace_id())
        if isinstance(started, Answer):
            return started
        if len(body) > started.max_body_bytes:
            return self.abort(started, 413)
        return await self.finish(started, body)

    # -- the ASGI adapter ---------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        trace_id = trace_id_var.get() or new_trace_id()
        name = str(scope.get("path_params", {}).get("provider", ""))
        started = self.begin(
            name, scope["method"], scope["headers"], scope.get("query_string", b""), trace_id
        )
        if isinstance(started, Answer):
            await _send_answer(send, started)
            return
        body = await self._receive_body(started, receive)
        if isinstance(body, Answer):
            if body.status != 499:  # nobody is listening
                await _send_answer(send, body)
            return
        await _send_answer(send, await self.finish(started, body))

    async def _receive_body(self, request: CallbackRequest, receive: Receive) -> bytes | Answer:
        limit = request.max_body_bytes
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return self.abort(request, 499)
                    chunk: bytes = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:  # stop reading here; the rest is never pulled
                        return self.abort(request, 413)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return self.abort(request, 408)
        return b"".join(chunks)

    # -- the checks ---------------------------------------------------------------------------

    def _rejected(self, label: str, rejection: Reject, trace_id: str) -> Answer:
        REJECTED.labels(label, rejection.reason).inc()
        log(
            logger,
            logging.WARNING if rejection.status != 404 else logging.INFO,
            "callback rejected",
            provider=label,
            reason=rejection.reason,
            status=rejection.status,
            trace_id=trace_id,
        )
        return error_answer(rejection, trace_id)

    def _head(
        self,
        provider: CallbackProvider,
        method: str,
        raw_headers: Sequence[tuple[bytes, bytes]],
        query: bytes,
        trace_id: str,
    ) -> CallbackRequest:
        cfg = self.config
        if method != "POST":
            raise Reject(405, "method_not_allowed", "method_not_allowed", allow="POST")
        # the first value of a repeated header wins: built from the last to the first
        headers: dict[str, str] = {}
        header_bytes = 0
        for name, value in reversed(raw_headers):
            headers[name.decode("latin-1").lower()] = value.decode("latin-1")
            header_bytes += len(name) + len(value) + 4
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise Reject(415, "unsupported_media_type", "unsupported_media_type")
        if len(raw_headers) > cfg.max_headers or header_bytes > cfg.max_header_bytes:
            raise Reject(431, "headers_too_large", "headers_too_large")
        if len(query) > cfg.max_query_bytes:
            raise Reject(414, "uri_too_long", "uri_too_long")
        declared = headers.get("content-length")
        if (
            declared is not None
            and declared.strip().isdigit()
            and int(declared) > provider.max_body_bytes
        ):
            raise Reject(413, "body_too_large", "body_too_large")
        return CallbackRequest(provider, headers, query, trace_id)

    def _prepare(self, request: CallbackRequest, body: bytes, verified: Verified) -> InboxRow:
        """The row to store for an authentic ``body``: parsed (row 8), dedup key and ids from
        the adapter, the payload minimized."""
        provider = request.provider
        text, payload = parse_body(body, self.config.max_json_depth)
        payload_hash = hashlib.sha256(body).digest()
        try:
            info = provider.dedup(request.headers, payload, verified, payload_hash)
            minimized = provider.minimize(payload)
            # Nothing redacted or dropped: the body's own text is the minimized payload (the
            # same jsonb value; numbers keep their exact digits). Equality is cheap here, as
            # redaction shares every container it did not change.
            payload_json = (
                text if minimized is payload or minimized == payload else ENCODER.encode(minimized)
            )
        except Exception as exc:  # an adapter bug: 500, the provider retries later
            log(
                logger,
                logging.ERROR,
                "callback adapter failed",
                error=type(exc).__name__,
                trace_id=request.trace_id,
            )
            raise Reject(500, "internal", "adapter_error") from None
        return inbox_row(
            provider.name, info, verified, payload_hash, payload_json, request.trace_id
        )

    def _stored(
        self, request: CallbackRequest, row: InboxRow, verified: Verified, outcome: Outcome
    ) -> Answer:
        """Row 9 once the row's batch committed: counted, 204."""
        name = request.provider.name
        if outcome is Outcome.NEW:
            self._count_accepted(name, verified.key_version or "")
        else:
            self._count_duplicate(name)
        if logger.isEnabledFor(logging.DEBUG):
            log(
                logger,
                logging.DEBUG,
                "callback stored",
                provider=name,
                outcome=outcome.value,
                dedup_key=row.dedup_key,
                provider_task_id=row.provider_task_id,
                trace_id=request.trace_id,
            )
        return NO_CONTENT

    def _count_accepted(self, provider: str, key_version: str) -> None:
        child = self._accepted.get((provider, key_version))
        if child is None:
            child = self._accepted[provider, key_version] = ACCEPTED.labels(provider, key_version)
        child.inc()

    def _count_duplicate(self, provider: str) -> None:
        child = self._duplicates.get(provider)
        if child is None:
            child = self._duplicates[provider] = DUPLICATES.labels(provider)
        child.inc()

    async def _verify(
        self,
        provider: CallbackProvider,
        headers: Mapping[str, str],
        body: bytes,
        token: str | None,
    ) -> Verified:
        try:
            return await provider.verifier.verify(headers, body, self.clock(), callback_token=token)
        except VerificationError as exc:
            raise _verification_rejection(exc, self.config) from None


async def _send_answer(send: Send, answer: Answer) -> None:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers]
    if answer.status != 204:
        headers.append((b"content-length", str(len(answer.body)).encode()))
    if answer.close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


def callback_endpoint(
    config: CallbackConfig,
    providers: Mapping[str, CallbackProvider],
    inbox: InboxWriter,
    *,
    clock: Callable[[], float] = time.time,
) -> CallbackEndpoint:
    """The endpoint for ``providers`` (each registered under its own name)."""
    for key, provider in providers.items():
        if key != provider.name:
            raise ValueError(f"provider registered as {key!r} is named {provider.name!r}")
    return CallbackEndpoint(config, providers, inbox, clock=clock)


def callback_routes(
    config: CallbackConfig,
    providers: Mapping[str, CallbackProvider],
    inbox: InboxWriter,
    *,
    clock: Callable[[], float] = time.time,
) -> list[BaseRoute]:
    """The gateway's routes for ``create_app(..., extra_routes=...)``. ``inbox`` must be started
    (``inbox.start()``) before the first request and closed (``await inbox.close()``) at shutdown.

    Served by :func:`aivedio.process.http_server.serve_http`, the route's endpoint is found in the
    app and ``POST`` requests to it take the lean HTTP/1.1 path (:mod:`aivedio.ingest.http`); the
    route itself answers any other transport (ASGI test clients, other servers).
    """
    endpoint = callback_endpoint(config, providers, inbox, clock=clock)
    return [Route(config.path, endpoint=endpoint, name="callbacks")]


def find_callback_endpoint(app: object) -> CallbackEndpoint | None:
    """The :class:`CallbackEndpoint` mounted in a Starlette ``app`` by :func:`callback_routes`,
    if any (looked up once, when a server starts)."""
    for route in getattr(app, "routes", ()):
        endpoint = getattr(route, "endpoint", None)
        if isinstance(endpoint, CallbackEndpoint):
            return endpoint
    return None
