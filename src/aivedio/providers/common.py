"""What every adapter shares: the plumbing (:class:`AdapterBase`: name, verifier, body limit,
HTTP edge, callback URL) and the helpers that read a provider's JSON into the port's values."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import httpx

from aivedio.domain.public import PUBLIC_ERRORS
from aivedio.providers.http import HttpConfig, HttpSender, new_client
from aivedio.providers.port import (
    DEFAULT_MAX_BODY_BYTES,
    MalformedResponse,
    Reason,
    Unsupported,
    VerificationError,
    Verified,
    Verifier,
)
from aivedio.providers.redact import redact, sample_of

__all__ = [
    "CALLBACK_PATH",
    "AdapterBase",
    "NoCallbacks",
    "clamp_progress",
    "fallback_dedup_key",
    "mapping_of",
    "public_code",
    "require_text",
    "text_of",
    "time_of",
]

CALLBACK_PATH = "/v1/callbacks/{name}"


class AdapterBase:
    """Holds the plumbing; subclasses add the dialect (dedup, normalize, submit, query...)."""

    honours_idempotency_key = False
    supports_webhooks = True
    signed_callbacks = True
    needs_refetch_on_callback = False
    supports_lookup = False
    url_keys: frozenset[str] = frozenset({"url"})
    """Keys whose values are temporary download links: redacted in the stored payload."""

    def __init__(
        self,
        name: str,
        verifier: Verifier,
        *,
        public_url: str | None,
        http: HttpConfig | None = None,
        client: httpx.AsyncClient | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        if max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be positive")
        self._name = name
        self._verifier = verifier
        self._max_body_bytes = max_body_bytes
        self._public_url = public_url.rstrip("/") if public_url else None
        config = http or HttpConfig()
        self.http = HttpSender(client or new_client(config), config, owns_client=client is None)

    @property
    def name(self) -> str:
        return self._name

    @property
    def verifier(self) -> Verifier:
        return self._verifier

    @property
    def max_body_bytes(self) -> int:
        return self._max_body_bytes

    def webhook_url_for(self, attempt_id: str) -> str | None:
        if not self.supports_webhooks or self._public_url is None:
            return None
        return self._public_url + CALLBACK_PATH.format(name=self._name)

    def minimize(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = redact(payload, self.url_keys)  # itself when unchanged
        return result

    async def lookup(self, client_request_id: str) -> str | None:
        raise Unsupported(f"{self._name} cannot find a job by our id")

    async def aclose(self) -> None:
        await self.http.aclose()


class NoCallbacks:
    """The verifier of a poll-only provider: every callback is refused (401 at the gateway).
    Such an adapter is normally not registered with the gateway at all."""

    async def verify(
        self,
        headers: Mapping[str, str],
        body: bytes,
        now: float,
        *,
        callback_token: str | None = None,
    ) -> Verified:
        raise VerificationError(Reason.BAD_SIGNATURE)


# --- reading a provider's JSON ------------------------------------------------------------


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


def require_text(body: Mapping[str, Any], key: str) -> str:
    value = text_of(body.get(key))
    if value is None:
        raise MalformedResponse(sample_of(body), f"missing_{key}")
    return value


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
