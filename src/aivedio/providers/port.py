"""The provider port: what the rest of aivedio needs from a provider, and nothing else.

Adapters (``providers/{sandbox,replicate,fal,kling,runway}.py``) implement it; the callback gateway,
the inbox processor, the submitter, the cancel worker, the poller and the reconciler speak only
to it. Every adapter passes the same contract suite (``tests/contract/provider_contract.py``).

:class:`CallbackProvider`
    the inbound half (``name``, ``verifier``, ``max_body_bytes``, ``dedup``, ``minimize``): all
    the callback gateway needs.
:class:`ProviderAdapter`
    extends it with :meth:`~ProviderAdapter.normalize` (a stored, minimized callback payload as a
    :class:`JobState`) and the outbound calls ``submit``, ``query``, ``cancel``, ``lookup``; every
    outbound failure is one of the named :class:`ProviderError` subclasses.
:class:`Verifier`
    the authenticity check run on the raw bytes (:class:`ImmediateVerifier` when it never waits);
    it returns :class:`Verified` or raises :class:`VerificationError` with a stable
    :class:`Reason`. The schemes are in :mod:`aivedio.providers.verify` and
    :mod:`aivedio.providers.jwks`.

Capability flags say what the provider offers: ``honours_idempotency_key`` (a create retried with
the same key never makes a second job), ``supports_webhooks``, ``signed_callbacks`` (the body is
authenticated) and ``needs_refetch_on_callback`` (only the URL is authenticated: the processor
queries the job before it changes any state).

What adapters share to implement it (HTTP edge, parsing helpers, redaction) is in
:mod:`~aivedio.providers.http`, :mod:`~aivedio.providers.common` and
:mod:`~aivedio.providers.redact`; the port imports none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.domain.public import PUBLIC_ERRORS
from aivedio.errors import AivedioError

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "AuthFailed",
    "CallbackProvider",
    "DedupInfo",
    "ImmediateVerifier",
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
    "Reason",
    "Rejected",
    "SubmitOutcomeUnknown",
    "SubmitRequest",
    "SubmitResult",
    "Unsupported",
    "VerificationError",
    "Verified",
    "Verifier",
]

DEFAULT_MAX_BODY_BYTES = 256 * 1024
"""A callback body limit (enforced while reading) unless the provider needs more."""


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


@dataclass(slots=True, kw_only=True)
class DedupInfo:
    """What the gateway stores beside the payload. Only ``dedup_key`` is required. A value:
    never changed once made (not ``frozen``, whose ``__init__`` costs 2.6x, once per callback)."""

    dedup_key: str
    """Unique per provider: the same event delivered twice has the same key."""
    event_type: str | None = None
    provider_event_id: str | None = None
    provider_task_id: str | None = None
    client_request_id: str | None = None
    """Our id for the attempt when the provider echoes it (maps a callback before submit)."""
    occurred_at: datetime | None = None
    """The provider's own time of the change (its ``updated_at``); informational only."""


@dataclass(slots=True, kw_only=True)
class Verified:
    """What a successful check established about a callback. A value: never changed once made
    (not ``frozen``, whose ``__init__`` costs 2.6x as much, once per callback)."""

    key_version: str | None
    """Label of the secret, JWKS key id or token secret that matched."""
    event_id: str | None
    """The provider's delivery id when the scheme signs one (``webhook-id``), else None."""
    timestamp: int | None
    """The signed timestamp (Unix seconds), None when the scheme has none."""
    attempt_id: str | None = None
    """The attempt a callback token authenticates (callback-token scheme only)."""
    payload_authenticated: bool = True
    """False when only the URL was authenticated, not the body: the processor must re-fetch the
    job from the provider before it changes any state."""


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


class Reason(StrEnum):
    """Why a callback was rejected. Stable codes: metrics, logs and dashboards key on them."""

    MISSING_HEADERS = "missing_headers"
    """A header the scheme requires is absent or empty."""
    MALFORMED_HEADER = "malformed_header"
    """A header is present but not in the scheme's format (timestamp, signature encoding, id)."""
    UNSUPPORTED_SCHEME = "unsupported_scheme"
    """The signature header carries only schemes this verifier does not implement (not ``v1``)."""
    BAD_SIGNATURE = "bad_signature"
    """No signature matched any active secret or key."""
    UNKNOWN_KEY = "unknown_key"
    """The callback names a key id that is not published, even after a JWKS refresh."""
    UNEXPECTED_ACCOUNT = "unexpected_account"
    """Genuinely signed by the provider, but for an account (fal user id) that is not ours."""
    STALE_TIMESTAMP = "stale_timestamp"
    """Signed, but the timestamp is older than the tolerance: a replay or a slow retry."""
    FUTURE_TIMESTAMP = "future_timestamp"
    """Signed, but the timestamp is further ahead than the tolerance: clock skew."""
    MISSING_TOKEN = "missing_token"  # noqa: S105 - a reason code, not a credential
    """The callback URL carries no callback token."""
    BAD_TOKEN = "bad_token"  # noqa: S105 - a reason code, not a credential
    """The callback token is malformed or was not minted by us."""
    KEYS_UNAVAILABLE = "keys_unavailable"
    """No verification key could be obtained (JWKS unreachable); our fault, retryable."""


_RETRYABLE: frozenset[Reason] = frozenset({Reason.KEYS_UNAVAILABLE})


class VerificationError(AivedioError):
    """The callback is not authentic, or could not be checked. ``str()`` is the reason code."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.value)
        self.reason = reason

    @property
    def retryable(self) -> bool:
        """True when the failure is ours (answer 503 so the provider retries), not the caller's."""
        return self.reason in _RETRYABLE


# --- the protocols -------------------------------------------------------------------------


class Verifier(Protocol):
    """One provider's authenticity check, run on the raw bytes before anything is parsed.

    A verifier that never needs to wait (no I/O, no lock) also offers the same check as a plain
    call, ``verify_now(headers, body, now, *, callback_token=None) -> Verified``
    (:class:`ImmediateVerifier`): the lean HTTP path then takes a callback from its body to the
    inbox queue without a coroutine or a task. A verifier without it (JWKS fetches) is awaited
    in a task of its own.
    """

    async def verify(
        self,
        headers: Mapping[str, str],
        body: bytes,
        now: float,
        *,
        callback_token: str | None = None,
    ) -> Verified:
        """Return what was verified, or raise :class:`VerificationError`."""
        ...


class ImmediateVerifier(Verifier, Protocol):
    """A :class:`Verifier` whose check never waits. A class that subclasses it writes only
    ``verify_now``; ``verify`` is that, awaited."""

    def verify_now(
        self,
        headers: Mapping[str, str],
        body: bytes,
        now: float,
        *,
        callback_token: str | None = None,
    ) -> Verified:
        """The check as a plain call: what was verified, or :class:`VerificationError`."""
        ...

    async def verify(
        self,
        headers: Mapping[str, str],
        body: bytes,
        now: float,
        *,
        callback_token: str | None = None,
    ) -> Verified:
        return self.verify_now(headers, body, now, callback_token=callback_token)


class CallbackProvider(Protocol):
    """The inbound half of the port: one provider as the callback gateway sees it.

    ``name`` is the path segment of ``POST /v1/callbacks/{name}`` and the inbox ``provider``;
    ``verifier`` runs on the raw bytes before anything is parsed; ``max_body_bytes`` is enforced
    while reading. ``dedup`` is called only for an authentic body that parsed as a JSON object and
    must be total (never raise: the gateway answers 500 and the provider retries); its key is the
    provider's stable event id when it has one (``verified.event_id``), else
    :func:`aivedio.providers.common.fallback_dedup_key`. ``minimize`` returns the copy that is
    stored (temporary URLs and tokens redacted) and never modifies its argument."""

    @property
    def name(self) -> str: ...

    @property
    def verifier(self) -> Verifier: ...

    @property
    def max_body_bytes(self) -> int: ...

    def dedup(
        self,
        headers: Mapping[str, str],
        payload: Mapping[str, Any],
        verified: Verified,
        payload_hash: bytes,
    ) -> DedupInfo: ...

    def minimize(self, payload: Mapping[str, Any]) -> dict[str, Any]: ...


@runtime_checkable
class ProviderAdapter(CallbackProvider, Protocol):
    """One provider, as the gateway, the inbox processor, the submitter and the poller see it:
    the callback half plus ``normalize`` and the outbound calls."""

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
