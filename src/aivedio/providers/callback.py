"""What the callback gateway needs from a provider: the :class:`CallbackProvider` protocol.

A provider adapter implements this small protocol (or uses :class:`StandardWebhooksJson` as is):

``name``
    The path segment of ``POST /v1/callbacks/{name}`` and the ``provider`` column of the inbox.
``verifier``
    An :class:`aivedio.providers.verify.Verifier` run on the raw bytes before anything is parsed
    (``StandardWebhooksVerifier``, ``FalEd25519Verifier``, ``CallbackTokenVerifier``).
``max_body_bytes``
    The body limit, enforced while reading (256 KiB unless the provider needs more).
``dedup(headers, payload, verified, payload_hash) -> DedupInfo``
    The dedup key and the ids the processor will need. Called only for an authentic body that
    parsed as a JSON object. It must be **total**: never raise for any JSON object (return None
    for ids it cannot find); the gateway answers 500 for an exception, and the provider retries.
    The dedup key is the provider's stable event id when it has one (``verified.event_id``), else
    :func:`fallback_dedup_key` of (provider task id, event type, provider updated_at, payload hash).
``minimize(payload) -> dict``
    The copy that is stored: temporary URLs and tokens redacted (:func:`redact`), anything the
    processor does not need may be dropped. Must not modify its argument.

The gateway parses no business meaning; the inbox processor normalizes the stored payload later.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from aivedio.providers.verify import Verified, Verifier

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "CallbackProvider",
    "DedupInfo",
    "StandardWebhooksJson",
    "fallback_dedup_key",
    "parse_time",
    "redact",
]

DEFAULT_MAX_BODY_BYTES = 256 * 1024
REDACTED = "[redacted]"

# Keys whose values are credentials wherever they appear in a payload (compared lower-cased).
SECRET_KEYS = frozenset(
    {
        "token",
        "access_token",
        "refresh_token",
        "api_key",
        "apikey",
        "secret",
        "password",
        "authorization",
        "signature",
        "sig",
        "x-amz-signature",
        "credential",
        "credentials",
    }
)
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


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


class CallbackProvider(Protocol):
    """One provider as the callback gateway sees it (see the module docstring)."""

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


def fallback_dedup_key(
    provider_task_id: str | None,
    event_type: str | None,
    updated_at: str | None,
    payload_hash: bytes,
) -> str:
    """The key for a provider without a stable event id: a hash of (task id, event type,
    provider updated_at, payload hash). Two deliveries of the same bytes collapse into one; two
    different states of a task never do."""
    parts = [provider_task_id or "", event_type or "", updated_at or "", payload_hash.hex()]
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()
    return "fb:" + digest


def parse_time(value: object) -> datetime | None:
    """An ISO 8601 time (``Z`` allowed) or Unix seconds as an aware datetime; None otherwise."""
    try:
        if isinstance(value, str) and 0 < len(value) <= 64:
            parsed = datetime.fromisoformat(value)
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return datetime.fromtimestamp(value, UTC)
    except (ValueError, OverflowError, OSError):
        return None
    return None


def _strip_url(value: str) -> str:
    """A URL without its query, fragment and user info: where signed, temporary tokens live."""
    try:
        parts = urlsplit(value)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
    except ValueError:
        return REDACTED
    if not (parts.query or parts.fragment or parts.username or parts.password):
        return value
    stripped = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    return stripped + ("?" + REDACTED if parts.query else "")


def redact(value: Any, url_keys: frozenset[str] = frozenset()) -> Any:
    """A JSON value with credentials redacted; ``value`` itself when there is nothing to redact
    (containers are copied only along the paths that change, never modified in place).

    Values under a :data:`SECRET_KEYS` key become ``"[redacted]"``; values under one of
    ``url_keys`` (temporary download links) become ``"[redacted]"`` too; any other string that is
    a URL loses its query, fragment and user info."""
    if isinstance(value, str):
        return _strip_url(value) if "://" in value and _URL.match(value) else value
    if isinstance(value, dict):
        return _redact_dict(value, url_keys)
    if isinstance(value, list):
        return _redact_list(value, url_keys)
    if isinstance(value, Mapping):  # any other mapping: redacted as the dict it would store
        return _redact_dict(dict(value), url_keys)
    return value


def _redact_dict(value: dict[str, Any], url_keys: frozenset[str]) -> dict[str, Any]:
    out: dict[str, Any] | None = None
    for key, item in value.items():
        kind = type(item)  # exact types first: what a JSON parser builds
        lowered = key.lower()
        if lowered in SECRET_KEYS or (item is not None and lowered in url_keys):
            new: Any = REDACTED
        elif kind is str:  # most values are strings without a URL
            if "://" not in item or not _URL.match(item):
                continue
            new = _strip_url(item)
        elif kind is dict:
            new = _redact_dict(item, url_keys)
        elif kind is int or kind is float or kind is bool or item is None:
            continue
        else:  # lists, and subclasses of str / dict / list
            new = redact(item, url_keys)
        if new is not item:
            if out is None:
                out = dict(value)
            out[key] = new
    return value if out is None else out


def _redact_list(value: list[Any], url_keys: frozenset[str]) -> list[Any]:
    out: list[Any] | None = None
    for index, item in enumerate(value):
        new = redact(item, url_keys)
        if new is not item:
            if out is None:
                out = list(value)
            out[index] = new
    return value if out is None else out


def _text(value: object) -> str | None:
    if isinstance(value, str):
        return value or None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


class StandardWebhooksJson:
    """A provider whose callbacks are ``{"type": ..., "data": {...}}`` JSON (the sandbox, and
    Replicate-style dialects), signed by any :class:`Verifier`.

    ``data`` carries ``id`` (provider task id), ``status``, ``updated_at``, ``sequence``,
    ``metadata.client_request_id`` and ``output.url`` (a temporary link, redacted when stored).
    The dedup key is the signed ``webhook-id``; without one (callback-token providers) it is
    :func:`fallback_dedup_key`.
    """

    def __init__(
        self,
        name: str,
        verifier: Verifier,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        url_keys: frozenset[str] = frozenset({"url"}),
    ) -> None:
        if max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be positive")
        self._name = name
        self._verifier = verifier
        self._max_body_bytes = max_body_bytes
        self._url_keys = url_keys

    @property
    def name(self) -> str:
        return self._name

    @property
    def verifier(self) -> Verifier:
        return self._verifier

    @property
    def max_body_bytes(self) -> int:
        return self._max_body_bytes

    def dedup(
        self,
        headers: Mapping[str, str],
        payload: Mapping[str, Any],
        verified: Verified,
        payload_hash: bytes,
    ) -> DedupInfo:
        event_type = _text(payload.get("type"))
        data = payload.get("data")
        data = data if isinstance(data, dict) else {}
        metadata = data.get("metadata")
        metadata = metadata if isinstance(metadata, dict) else {}
        task_id = _text(data.get("id"))
        updated_at = data.get("updated_at")
        event_id = verified.event_id
        key = event_id or fallback_dedup_key(
            task_id, event_type, _text(updated_at) or repr(updated_at), payload_hash
        )
        return DedupInfo(
            dedup_key=key,
            event_type=event_type,
            provider_event_id=event_id,
            provider_task_id=task_id,
            client_request_id=_text(metadata.get("client_request_id")),
            occurred_at=parse_time(updated_at),
        )

    def minimize(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = redact(payload, self._url_keys)  # itself when unchanged
        return result
