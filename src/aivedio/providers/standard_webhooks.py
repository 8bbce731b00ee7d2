"""A ready-made callback half of the port for senders of ``{"type": ..., "data": {...}}`` JSON."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aivedio.providers.common import fallback_dedup_key, text_of, time_of
from aivedio.providers.port import DEFAULT_MAX_BODY_BYTES, DedupInfo, Verified, Verifier
from aivedio.providers.redact import redact

__all__ = ["StandardWebhooksJson"]


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
        event_type = text_of(payload.get("type"))
        data = payload.get("data")
        data = data if isinstance(data, dict) else {}
        metadata = data.get("metadata")
        metadata = metadata if isinstance(metadata, dict) else {}
        task_id = text_of(data.get("id"))
        updated_at = data.get("updated_at")
        event_id = verified.event_id
        key = event_id or fallback_dedup_key(
            task_id, event_type, text_of(updated_at) or repr(updated_at), payload_hash
        )
        return DedupInfo(
            dedup_key=key,
            event_type=event_type,
            provider_event_id=event_id,
            provider_task_id=task_id,
            client_request_id=text_of(metadata.get("client_request_id")),
            occurred_at=time_of(updated_at),
        )

    def minimize(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = redact(payload, self._url_keys)  # itself when unchanged
        return result
