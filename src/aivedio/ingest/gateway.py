"""The callback gateway: ``POST /v1/callbacks/{provider}``. Check, dedup key, INSERT, 204.

The endpoint is a plain ASGI callable behind one Starlette ``Route`` (it reads the body itself,
chunk by chunk). Each check has its own status and stores nothing; the first that fails answers:

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
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn
from urllib.parse import parse_qsl

from prometheus_client import Counter
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from aivedio.errors import DatabaseUnavailable
from aivedio.ingest.callback_provider import (
    DEFAULT_MAX_BODY_BYTES,
    CallbackProvider,
    DedupInfo,
    StandardWebhooksJson,
    fallback_dedup_key,
    redact,
)
from aivedio.ingest.group_commit import (
    InboxClosed,
    InboxError,
    InboxFull,
    InboxRow,
    InboxWriter,
    Outcome,
)
from aivedio.ingest.verify import VerificationError, Verified
from aivedio.logs import log, new_trace_id, trace_id_var

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "CallbackConfig",
    "CallbackEndpoint",
    "CallbackProvider",
    "DedupInfo",
    "StandardWebhooksJson",
    "callback_routes",
    "fallback_dedup_key",
    "redact",
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

_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")
_MAX_TEXT_CHARS = 512
_MAX_KEY_CHARS = 255


@dataclass(frozen=True, slots=True)
class CallbackConfig:
    path: str = "/v1/callbacks/{provider}"
    max_headers: int = 64
    max_header_bytes: int = 16 * 1024
    max_query_bytes: int = 4 * 1024
    read_timeout_s: float = 10.0
    retry_after_s: int = 2
    max_json_depth: int = 64


class _Reject(Exception):
    """Control flow inside the endpoint: answer ``status`` and stop. Never escapes it."""

    def __init__(self, status: int, code: str, reason: str, **headers: str) -> None:
        super().__init__(reason)
        self.status = status
        self.code = code
        self.reason = reason
        self.headers = headers


_MESSAGES = {
    400: "the body is not valid UTF-8",
    401: "the callback could not be authenticated",
    404: "no such callback endpoint",
    405: "use POST",
    408: "the body did not arrive in time",
    413: "the body is too large",
    414: "the query string is too long",
    415: "send application/json",
    422: "the body is not an acceptable JSON object",
    431: "the request headers are too large",
    500: "the callback could not be stored",
    503: "the service is temporarily unavailable; retry later",
}


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


class _Unstorable(ValueError):
    """Valid JSON that PostgreSQL jsonb cannot store."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as inf, which jsonb cannot store
        raise _Unstorable("number out of range")
    return value


def _check_storable(payload: object, max_depth: int) -> None:
    """Raise ValueError unless PostgreSQL jsonb can store ``payload`` (iterative, no recursion)."""
    stack: list[tuple[object, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _UNSTORABLE.search(value):
                raise ValueError("unstorable string")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError("unstorable number")
        elif isinstance(value, dict | list):
            if depth > max_depth:
                raise ValueError("too deep")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and _UNSTORABLE.search(key):
                    raise ValueError("unstorable key")
                stack.append((item, depth + 1))


def _clean(value: str | None, limit: int = _MAX_TEXT_CHARS) -> str | None:
    """Text PostgreSQL accepts: no NUL, no lone surrogate, bounded."""
    if value is None:
        return None
    return _UNSTORABLE.sub("\ufffd", value)[:limit] or None


def _key(value: str) -> str:
    cleaned = _UNSTORABLE.sub("\ufffd", value)
    if cleaned != value or len(cleaned) > _MAX_KEY_CHARS or not cleaned:
        return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return cleaned


class CallbackEndpoint:
    """The ASGI app behind ``POST /v1/callbacks/{provider}`` (see the module docstring)."""

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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        trace_id = trace_id_var.get() or new_trace_id()
        name = str(scope.get("path_params", {}).get("provider", ""))
        provider = self.providers.get(name)
        label = name if provider is not None else "unknown"
        try:
            if provider is None:
                raise _Reject(404, "not_found", "unknown_provider")
            await self._handle(provider, scope, receive, trace_id)
        except _Reject as rejection:
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
            if rejection.reason != "client_disconnected":
                await _send_error(send, rejection, trace_id)
            return
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def _handle(
        self, provider: CallbackProvider, scope: Scope, receive: Receive, trace_id: str
    ) -> None:
        cfg = self.config
        if scope["method"] != "POST":
            raise _Reject(405, "method_not_allowed", "method_not_allowed", allow="POST")
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        headers: dict[str, str] = {}
        for raw_name, raw_value in raw_headers:
            headers.setdefault(raw_name.decode("latin-1").lower(), raw_value.decode("latin-1"))
        media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise _Reject(415, "unsupported_media_type", "unsupported_media_type")
        header_bytes = sum(len(k) + len(v) + 4 for k, v in raw_headers)
        if len(raw_headers) > cfg.max_headers or header_bytes > cfg.max_header_bytes:
            raise _Reject(431, "headers_too_large", "headers_too_large")
        query: bytes = scope.get("query_string", b"")
        if len(query) > cfg.max_query_bytes:
            raise _Reject(414, "uri_too_long", "uri_too_long")
        body = await self._read_body(provider.max_body_bytes, headers, receive)
        token = dict(parse_qsl(query.decode("latin-1"))).get("token")
        verified = await self._verify(provider, headers, body, token)
        payload = self._parse(body)
        payload_hash = hashlib.sha256(body).digest()
        try:
            info = provider.dedup(headers, payload, verified, payload_hash)
            minimized = provider.minimize(payload)
            payload_json = json.dumps(minimized, separators=(",", ":"), allow_nan=False)
        except Exception as exc:  # an adapter bug: 500, the provider retries later
            log(logger, logging.ERROR, "callback adapter failed", error=type(exc).__name__)
            raise _Reject(500, "internal", "adapter_error") from None
        row = self._row(provider.name, info, verified, payload_hash, payload_json, trace_id)
        outcome = await self._store(row)
        if outcome is Outcome.NEW:
            ACCEPTED.labels(provider.name, verified.key_version or "").inc()
        else:
            DUPLICATES.labels(provider.name).inc()
        log(
            logger,
            logging.DEBUG,
            "callback stored",
            provider=provider.name,
            outcome=outcome.value,
            dedup_key=row.dedup_key,
            provider_task_id=row.provider_task_id,
            trace_id=trace_id,
        )

    async def _read_body(self, limit: int, headers: Mapping[str, str], receive: Receive) -> bytes:
        declared = headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise _Reject(413, "body_too_large", "body_too_large")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Reject(499, "client_disconnected", "client_disconnected")
                    chunk: bytes = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:  # stop reading here; the rest is never pulled
                        raise _Reject(413, "body_too_large", "body_too_large")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise _Reject(408, "request_timeout", "request_timeout") from None
        return b"".join(chunks)

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
            if exc.retryable:
                retry = str(self.config.retry_after_s)
                raise _Reject(
                    503, "unavailable", exc.reason.value, **{"retry-after": retry}
                ) from None
            raise _Reject(401, "unauthorized", exc.reason.value) from None

    def _parse(self, body: bytes) -> dict[str, Any]:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise _Reject(400, "invalid_encoding", "invalid_encoding") from None
        try:
            payload = json.loads(text, parse_constant=_reject_constant, parse_float=_finite)
        except _Unstorable:
            raise _Reject(422, "invalid_payload", "invalid_payload") from None
        except (ValueError, RecursionError):
            raise _Reject(422, "invalid_json", "invalid_json") from None
        if not isinstance(payload, dict):
            raise _Reject(422, "invalid_payload", "invalid_payload")
        # Fast path: without a \u escape no string can hold NUL or a lone surrogate (raw ones
        # are not valid JSON / UTF-8), and with few brackets the nesting cannot be too deep.
        if "\\u" in text or text.count("{") + text.count("[") > self.config.max_json_depth:
            try:
                _check_storable(payload, self.config.max_json_depth)
            except ValueError:
                raise _Reject(422, "invalid_payload", "invalid_payload") from None
        return payload

    def _row(
        self,
        provider: str,
        info: DedupInfo,
        verified: Verified,
        payload_hash: bytes,
        payload_json: str,
        trace_id: str,
    ) -> InboxRow:
        return InboxRow(
            provider=provider,
            dedup_key=_key(info.dedup_key),
            payload_hash=payload_hash,
            payload_json=payload_json,
            received_at=datetime.now(UTC),
            provider_event_id=_clean(info.provider_event_id),
            provider_task_id=_clean(info.provider_task_id),
            client_request_id=_clean(info.client_request_id),
            provider_occurred_at=info.occurred_at,
            signature_key_version=_clean(verified.key_version),
            event_type=_clean(info.event_type),
            attempt_id=_clean(verified.attempt_id),
            payload_authenticated=verified.payload_authenticated,
            trace_id=trace_id,
        )

    async def _store(self, row: InboxRow) -> Outcome:
        retry = {"retry-after": str(self.config.retry_after_s)}
        try:
            return await self.inbox.submit(row)
        except DatabaseUnavailable:
            raise _Reject(503, "unavailable", "database_unavailable", **retry) from None
        except InboxFull:
            raise _Reject(503, "unavailable", "queue_full", **retry) from None
        except InboxClosed:
            raise _Reject(503, "unavailable", "shutting_down", **retry) from None
        except InboxError:
            raise _Reject(500, "internal", "store_failed") from None


async def _send_error(send: Send, rejection: _Reject, trace_id: str) -> None:
    body = json.dumps(
        {
            "error": {
                "code": rejection.code,
                "message": _MESSAGES.get(rejection.status, "rejected"),
                "trace_id": trace_id,
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.encode(), v.encode()) for k, v in rejection.headers.items()),
    ]
    if rejection.status == 413:  # the rest of the body was not read: do not reuse the connection
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": rejection.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def callback_routes(
    config: CallbackConfig,
    providers: Mapping[str, CallbackProvider],
    inbox: InboxWriter,
    *,
    clock: Callable[[], float] = time.time,
) -> list[BaseRoute]:
    """The gateway's routes for ``create_app(..., extra_routes=...)``. ``inbox`` must be started
    (``inbox.start()``) before the first request and closed (``await inbox.close()``) at shutdown.
    """
    for key, provider in providers.items():
        if key != provider.name:
            raise ValueError(f"provider registered as {key!r} is named {provider.name!r}")
    endpoint = CallbackEndpoint(config, providers, inbox, clock=clock)
    return [Route(config.path, endpoint=endpoint, name="callbacks")]
