"""The provider port: one :class:`ProviderAdapter` protocol, the values it speaks, its errors.

An adapter has two sides:

gateway / processor side
    the :class:`~aivedio.providers.callback.CallbackProvider` protocol (``name``,
    ``verifier``, ``max_body_bytes``, ``dedup``, ``minimize``) plus
    :meth:`ProviderAdapter.normalize`, which turns a stored (minimized) callback payload
    into a :class:`JobState`.
outbound side (submitter, poller, cancel worker, reconciler)
    ``submit``, ``query``, ``cancel``, ``lookup``; every failure is one of the named
    :class:`ProviderError` subclasses below, each carrying what the poller needs to decide.

Capability flags say what the provider offers: ``honours_idempotency_key`` (a create retried with
the same key never makes a second job), ``supports_webhooks``, ``signed_callbacks`` (the body is
authenticated) and ``needs_refetch_on_callback`` (only the URL is authenticated: the processor
queries the job before it changes any state).

Adapters never log payloads or signed URLs: error samples are redacted (:func:`sample_of`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Protocol, runtime_checkable

import httpx

from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.domain.public import PUBLIC_ERRORS
from aivedio.errors import AivedioError
from aivedio.providers.callback import CallbackProvider, redact

__all__ = [
    "AuthFailed",
    "HttpConfig",
    "HttpSender",
    "InboxFields",
    "JobState",
    "MalformedResponse",
    "NormalizedCallback",
    "NotFoundYet",
    "PayloadError",
    "ProviderAdapter",
    "ProviderError",
    "ProviderUnavailable",
    "QueryResult",
    "RateLimited",
    "Rejected",
    "SubmitOutcomeUnknown",
    "SubmitRequest",
    "SubmitResult",
    "Unsupported",
    "clamp_progress",
    "public_code",
    "sample_of",
]

SAMPLE_CHARS = 300


# --- values ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class InboxFields:
    """What the gateway stored beside the payload (the ``provider_callback_inbox`` columns)."""

    provider: str
    dedup_key: str
    provider_event_id: str | None = None
    provider_task_id: str | None = None
    client_request_id: str | None = None
    provider_occurred_at: datetime | None = None
    event_type: str | None = None
    attempt_id: str | None = None
    """The attempt a callback token authenticated (unsigned providers only)."""
    payload_authenticated: bool = True
    received_at: datetime | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class JobState:
    """One normalized look at a provider job: from a callback (:data:`NormalizedCallback`) or
    from a query (:data:`QueryResult`). Only public error codes, no raw provider text."""

    provider_task_id: str | None
    status: ProviderStatus
    client_request_id: str | None = None
    progress: int | None = None
    """0..100 (clamped by the adapter), None when the provider reports none."""
    sequence: int | None = None
    """The provider's own change counter, None when it has none (then arrival order is not
    trusted either: the state machine's successor table decides)."""
    occurred_at: datetime | None = None
    """The provider's time of the change (informational; never used for ordering)."""
    error_code: str | None = None
    """A key of :data:`aivedio.domain.public.PUBLIC_ERRORS` when ``status`` is failed."""
    output_ref: str | None = None
    """``"<provider>:<task id>"`` once succeeded: names the output, never a (signed) URL. The
    media worker asks the provider for a fresh URL."""

    def __post_init__(self) -> None:
        if self.progress is not None and not 0 <= self.progress <= 100:
            raise ValueError("progress must be within 0..100")
        if self.error_code is not None and self.error_code not in PUBLIC_ERRORS:
            raise ValueError(f"{self.error_code!r} is not a public error code")

    def observation(
        self,
        provider: str,
        attempt_id: Any,
        source: Source,
        **extra: Any,
    ) -> ProviderObservation:
        """The :class:`ProviderObservation` the state service applies."""
        return ProviderObservation(
            provider=provider,
            attempt_id=attempt_id,
            status=self.status,
            source=source,
            provider_task_id=self.provider_task_id,
            client_request_id=self.client_request_id,
            provider_sequence=self.sequence,
            provider_occurred_at=self.occurred_at,
            progress=self.progress,
            error_code=self.error_code,
            error_message=PUBLIC_ERRORS[self.error_code] if self.error_code else None,
            output_refs=(self.output_ref,) if self.output_ref else (),
            **extra,
        )


NormalizedCallback = JobState
"""What :meth:`ProviderAdapter.normalize` returns."""
QueryResult = JobState
"""What :meth:`ProviderAdapter.query` returns."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmitRequest:
    client_request_id: str
    """Our id for the attempt: sent as the idempotency key and echoed where the provider can."""
    model: str
    prompt: str
    params: Mapping[str, Any] = field(default_factory=dict)
    webhook_url: str | None = None
    """Where the provider calls back (see :meth:`ProviderAdapter.webhook_url_for`); None: poll."""
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmitResult:
    provider_task_id: str
    status: ProviderStatus | None = None
    replayed: bool = False
    """True when the provider says it returned an existing job for the same idempotency key."""


# --- errors ----------------------------------------------------------------------------------


class ProviderError(AivedioError):
    """Root of every outbound-call failure. ``str()`` never holds a secret or a payload."""

    retryable: bool = True
    """False: the same call will fail the same way (auth, rejection, unsupported)."""


class RateLimited(ProviderError):
    """HTTP 429. ``retry_after_s`` from the ``Retry-After`` header, None when absent."""

    def __init__(self, retry_after_s: float | None) -> None:
        super().__init__(f"rate limited (retry after {retry_after_s})")
        self.retry_after_s = retry_after_s


class ProviderUnavailable(ProviderError):
    """5xx, a connection that could not be made, or a query timeout. ``status`` is None for a
    transport failure. On a create this means the request was NOT sent (safe to retry)."""

    def __init__(self, status: int | None, detail: str = "") -> None:
        super().__init__(f"provider unavailable ({status or detail or 'transport'})")
        self.status = status


class NotFoundYet(ProviderError):
    """HTTP 404: just after submit this is eventual consistency (retry within a grace period);
    long after it, a reconciliation case."""


class AuthFailed(ProviderError):
    """HTTP 401/403: a credential problem. Open the credential's breaker; no hot retry."""

    retryable = False

    def __init__(self, status: int) -> None:
        super().__init__(f"provider refused our credentials (HTTP {status})")
        self.status = status


class MalformedResponse(ProviderError):
    """The answer was not what the protocol promises. ``sample`` is redacted and short."""

    def __init__(self, sample: str, reason: str = "malformed") -> None:
        super().__init__(f"malformed provider response: {reason}")
        self.sample = sample
        self.reason = reason


class SubmitOutcomeUnknown(ProviderError):
    """A create was sent and no answer came back (timeout or reset after sending): the job may
    exist. Retry with the same key only where ``honours_idempotency_key``; else ``lookup``."""


class Rejected(ProviderError):
    """The provider refused the request itself (4xx other than 401/403/404/429).
    ``public_code`` is the stable product code for the task's error."""

    retryable = False

    def __init__(self, status: int, public_code: str, provider_code: str | None = None) -> None:
        super().__init__(f"provider rejected the request (HTTP {status}, {public_code})")
        self.status = status
        self.public_code = public_code
        self.provider_code = provider_code


class Unsupported(ProviderError):
    """The provider has no such operation (e.g. lookup by our id)."""

    retryable = False


class PayloadError(AivedioError):
    """A stored callback payload the adapter cannot normalize. ``code`` is stable (metrics,
    ``last_error_code``); ``sample`` is redacted and short."""

    def __init__(self, code: str, sample: str = "") -> None:
        super().__init__(code)
        self.code = code
        self.sample = sample


# --- the protocol ----------------------------------------------------------------------------


@runtime_checkable
class ProviderAdapter(CallbackProvider, Protocol):
    """One provider, as the gateway, the inbox processor, the submitter and the poller see it."""

    @property
    def honours_idempotency_key(self) -> bool: ...

    @property
    def supports_webhooks(self) -> bool: ...

    @property
    def signed_callbacks(self) -> bool: ...

    @property
    def needs_refetch_on_callback(self) -> bool: ...

    @property
    def supports_lookup(self) -> bool: ...

    def webhook_url_for(self, attempt_id: str) -> str | None:
        """The callback URL to hand the provider for this attempt (a per-attempt token in it
        for unsigned providers); None for a poll-only provider."""
        ...

    def normalize(self, payload: Mapping[str, Any], fields: InboxFields) -> JobState:
        """The stored callback as a :class:`JobState`; raises :class:`PayloadError`."""
        ...

    async def submit(self, request: SubmitRequest) -> SubmitResult:
        """Create the job, sent once (never retried here)."""
        ...

    async def query(self, provider_task_id: str) -> JobState: ...

    async def cancel(self, provider_task_id: str) -> bool:
        """True when the provider accepted the cancel (or it was already canceled); False when
        the job had already finished otherwise."""
        ...

    async def lookup(self, client_request_id: str) -> str | None:
        """The provider task id of the job created with our id, None when there is none;
        :class:`Unsupported` when the provider cannot search by our id."""
        ...

    async def aclose(self) -> None: ...


# --- helpers shared by the adapters ----------------------------------------------------------


def clamp_progress(value: object, scale: float = 1.0) -> int | None:
    """A provider's progress figure as an integer 0..100 (``value * scale``), None when absent
    or not a finite number. Strings like ``"42%"`` are accepted."""
    if isinstance(value, str):
        value = value.strip().removesuffix("%")
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    scaled = float(value) * scale
    if not math.isfinite(scaled):
        return None
    return max(0, min(100, round(scaled)))


def public_code(code: str | None, table: Mapping[str, str], prefixes: Mapping[str, str]) -> str:
    """Map a provider error code to a public one: exact match in ``table``, then the longest
    matching prefix in ``prefixes``, then ``generation_failed``."""
    if code:
        if code in table:
            return table[code]
        best = max((p for p in prefixes if code.startswith(p)), key=len, default=None)
        if best is not None:
            return prefixes[best]
        if code in PUBLIC_ERRORS:
            return code
    return "generation_failed"


def sample_of(value: object, limit: int = SAMPLE_CHARS) -> str:
    """A short, redacted rendering of a payload or response body for an error record."""
    if isinstance(value, bytes):
        raw = value
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            value = raw[:limit].decode("utf-8", "replace")
    try:
        text = json.dumps(redact(value), separators=(",", ":"), default=str)
    except (TypeError, ValueError):
        text = repr(type(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def text_of(value: object) -> str | None:
    if isinstance(value, str):
        return value or None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def mapping_of(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def time_of(value: object, *, millis: bool = False) -> datetime | None:
    """ISO 8601 (``Z`` allowed) or Unix seconds (milliseconds with ``millis``)."""
    try:
        if isinstance(value, str) and 0 < len(value) <= 64:
            parsed = datetime.fromisoformat(value)
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return datetime.fromtimestamp(value / 1000 if millis else value, UTC)
    except (ValueError, OverflowError, OSError):
        return None
    return None


# --- HTTP ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """Timeouts (seconds) and pool size of an adapter's httpx client. A create gets its own,
    longer read timeout: hanging up early makes an unknown outcome."""

    connect_timeout_s: float = 3.0
    read_timeout_s: float = 10.0
    write_timeout_s: float = 10.0
    pool_timeout_s: float = 2.0
    create_read_timeout_s: float = 30.0
    max_connections: int = 100

    def timeout(self, *, create: bool = False) -> httpx.Timeout:
        return httpx.Timeout(
            connect=self.connect_timeout_s,
            read=self.create_read_timeout_s if create else self.read_timeout_s,
            write=self.write_timeout_s,
            pool=self.pool_timeout_s,
        )


def new_client(config: HttpConfig) -> httpx.AsyncClient:
    """An httpx client with explicit timeouts, no redirects and NO transport retries."""
    return httpx.AsyncClient(
        timeout=config.timeout(),
        follow_redirects=False,
        transport=httpx.AsyncHTTPTransport(
            retries=0, limits=httpx.Limits(max_connections=config.max_connections)
        ),
    )


# Transport failures that prove the request never left (safe to send again).
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


def retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date; None when absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


class HttpSender:
    """One adapter's HTTP edge: sends once, translates every failure into a ProviderError.

    ``reject`` maps a 4xx body to a public code (adapter-specific); the default is
    ``invalid_request`` for 400/422 and ``submit_rejected`` otherwise.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        config: HttpConfig,
        *,
        owns_client: bool,
    ) -> None:
        self.client = client
        self.config = config
        self._owns = owns_client

    async def aclose(self) -> None:
        if self._owns:
            await self.client.aclose()

    async def send(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        create: bool = False,
    ) -> httpx.Response:
        """Send once. Transport failures: :class:`ProviderUnavailable` when the request cannot
        have arrived; after sending, :class:`SubmitOutcomeUnknown` for a create and
        :class:`ProviderUnavailable` for anything else. Status codes are NOT checked here."""
        try:
            return await self.client.request(
                method,
                url,
                headers=dict(headers or {}),
                json=json_body,
                params=dict(params) if params else None,
                timeout=self.config.timeout(create=create),
            )
        except _NOT_SENT as exc:
            raise ProviderUnavailable(None, type(exc).__name__) from None
        except httpx.TransportError as exc:
            if create:
                raise SubmitOutcomeUnknown(
                    f"no answer after sending ({type(exc).__name__})"
                ) from None
            raise ProviderUnavailable(None, type(exc).__name__) from None

    @staticmethod
    def check(
        response: httpx.Response,
        *,
        reject: Any = None,
    ) -> None:
        """Raise the named error for a non-2xx answer."""
        status = response.status_code
        if 200 <= status < 300:
            return
        if status == 429:
            raise RateLimited(retry_after(response.headers.get("retry-after")))
        if status in (401, 403):
            raise AuthFailed(status)
        if status == 404:
            raise NotFoundYet(f"provider answered 404 for {response.request.method}")
        if status >= 500:
            raise ProviderUnavailable(status)
        body: Any
        try:
            body = response.json()
        except ValueError:
            body = None
        if reject is not None:
            code, provider_code = reject(status, body)
        else:
            code, provider_code = (
                ("invalid_request" if status in (400, 422) else "submit_rejected"),
                None,
            )
        raise Rejected(status, code, provider_code)

    @staticmethod
    def json_object(response: httpx.Response) -> Mapping[str, Any]:
        """The body as a JSON object, else :class:`MalformedResponse` with a redacted sample."""
        try:
            body = response.json()
        except ValueError:
            raise MalformedResponse(sample_of(response.content), "not_json") from None
        if not isinstance(body, dict):
            raise MalformedResponse(sample_of(body), "not_object")
        return body


def require_text(body: Mapping[str, Any], key: str) -> str:
    value = text_of(body.get(key))
    if value is None:
        raise MalformedResponse(sample_of(body), f"missing_{key}")
    return value
