"""The ``fal`` adapter: fal's queue API and ED25519-signed webhooks.

- create ``POST {base}/{model}?fal_webhook=<url>`` (``Authorization: Key <key>``, body = the model
  input) -> ``{request_id, gateway_request_id, status_url, response_url, cancel_url}``;
- query ``GET {base}/{app}/requests/{request_id}/status`` -> ``{status: IN_QUEUE | IN_PROGRESS |
  COMPLETED, queue_position, ...}``; a ``COMPLETED`` status may carry ``error`` / ``error_type``,
  which means the request failed;
- cancel ``PUT {base}/{app}/requests/{request_id}/cancel`` -> 202 ``CANCELLATION_REQUESTED``, or
  400 ``ALREADY_COMPLETED``;
- one webhook per request, at completion: ``{request_id, gateway_request_id, status: OK | ERROR,
  payload, error, payload_error}``, signed ED25519 over ``request_id\\nuser_id\\ntimestamp\\n
  sha256hex(body)`` with keys from fal's JWKS (:class:`~aivedio.providers.jwks.FalEd25519Verifier`).
  fal signs no delivery id, so the dedup key is the fallback hash of (request_id, status, body).
- ``request_id`` is the task id used for mapping (``gateway_request_id`` only names the last try).
  fal echoes nothing of ours: an early callback waits as an orphan until the submitter records the
  request id. No documented idempotency key, no lookup by our id.
- Status and cancel URLs name the app (``owner/name``, no sub-path): one adapter per fal app.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx

from aivedio.domain.observation import ProviderStatus
from aivedio.providers.common import (
    AdapterBase,
    fallback_dedup_key,
    public_code,
    require_text,
    text_of,
)
from aivedio.providers.http import HttpConfig
from aivedio.providers.port import (
    DEFAULT_MAX_BODY_BYTES,
    DedupInfo,
    InboxFields,
    JobState,
    MalformedResponse,
    PayloadError,
    SubmitRequest,
    SubmitResult,
    Verified,
    Verifier,
)
from aivedio.providers.redact import sample_of

QUEUE_STATUSES: dict[str, ProviderStatus] = {
    "IN_QUEUE": ProviderStatus.QUEUED,
    "IN_PROGRESS": ProviderStatus.RUNNING,
    "COMPLETED": ProviderStatus.SUCCEEDED,  # unless it carries an error: then FAILED
    "FAILED": ProviderStatus.FAILED,
    "CANCELED": ProviderStatus.CANCELED,
    "CANCELLED": ProviderStatus.CANCELED,
}
WEBHOOK_STATUSES: dict[str, ProviderStatus] = {
    "OK": ProviderStatus.SUCCEEDED,
    "ERROR": ProviderStatus.FAILED,
}

# fal error types (``error_type`` on a status, ``payload.detail[].type`` on a webhook).
ERRORS: dict[str, str] = {
    "content_policy_violation": "content_rejected",
    "generation_timeout": "timeout",
    "request_timeout": "timeout",
    "downstream_service_error": "provider_unavailable",
    "downstream_service_unavailable": "provider_unavailable",
    "internal_server_error": "provider_unavailable",
    "file_download_error": "invalid_request",
    "image_load_error": "invalid_request",
    "image_too_large": "invalid_request",
    "image_too_small": "invalid_request",
    "file_too_large": "invalid_request",
    "feature_not_supported": "invalid_request",
    "missing": "invalid_request",
}
ERROR_PREFIXES: dict[str, str] = {
    "value_error": "invalid_request",
    "type_error": "invalid_request",
    "unsupported_": "invalid_request",
    "invalid_": "invalid_request",
}


def _detail_types(payload: object) -> list[str]:
    """The ``type`` of each entry of a validation-style ``detail`` list."""
    detail = payload.get("detail") if isinstance(payload, Mapping) else None
    if not isinstance(detail, list):
        return []
    return [
        t for entry in detail if isinstance(entry, Mapping) and (t := text_of(entry.get("type")))
    ]


def error_code(error_type: str | None, detail_types: list[str]) -> str:
    for candidate in [error_type, *detail_types]:
        code = public_code(candidate, ERRORS, ERROR_PREFIXES) if candidate else None
        if code is not None and code != "generation_failed":
            return code
    return "generation_failed"


class FalAdapter(AdapterBase):
    def __init__(
        self,
        *,
        api_key: str,
        app_id: str,
        verifier: Verifier,
        public_url: str | None,
        base_url: str = "https://queue.fal.run",
        name: str = "fal",
        http: HttpConfig | None = None,
        client: httpx.AsyncClient | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        super().__init__(
            name,
            verifier,
            public_url=public_url,
            http=http,
            client=client,
            max_body_bytes=max_body_bytes,
        )
        if app_id.count("/") != 1:
            raise ValueError("app_id is 'owner/name' (no sub-path)")
        self._base = base_url.rstrip("/")
        self._app = app_id
        self._auth = {"Authorization": f"Key {api_key}"}

    # -- gateway / processor side -----------------------------------------------------------

    def dedup(
        self,
        headers: Mapping[str, str],
        payload: Mapping[str, Any],
        verified: Verified,
        payload_hash: bytes,
    ) -> DedupInfo:
        request_id = text_of(payload.get("request_id")) or headers.get("x-fal-webhook-request-id")
        status = text_of(payload.get("status"))
        return DedupInfo(
            dedup_key=fallback_dedup_key(request_id, status, None, payload_hash),
            event_type=status,
            provider_task_id=request_id,
        )

    def minimize(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Only what normalization needs: ids, status, the error and the error detail types.
        The model output (file URLs) is dropped: the media worker fetches the result itself."""
        kept = {
            key: payload[key]
            for key in ("request_id", "gateway_request_id", "status", "error", "error_type")
            if key in payload
        }
        types = _detail_types(payload.get("payload"))
        if types:
            kept["detail_types"] = types
        if payload.get("payload_error") is not None:
            kept["payload_error"] = True
        return super().minimize(kept)

    def normalize(self, payload: Mapping[str, Any], fields: InboxFields) -> JobState:
        request_id = text_of(payload.get("request_id")) or fields.provider_task_id
        raw = payload.get("status")
        status = WEBHOOK_STATUSES.get(raw) if isinstance(raw, str) else None
        if request_id is None or status is None:
            raise PayloadError("unknown_status" if request_id else "missing_id", sample_of(payload))
        types = payload.get("detail_types")
        detail_types = [t for t in types if isinstance(t, str)] if isinstance(types, list) else []
        detail_types += _detail_types(payload.get("payload"))
        failed = status is ProviderStatus.FAILED
        return JobState(
            provider_task_id=request_id,
            status=status,
            error_code=(
                error_code(text_of(payload.get("error_type")), detail_types) if failed else None
            ),
            output_ref=None if failed else f"{self.name}:{request_id}",
        )

    # -- outbound side ----------------------------------------------------------------------

    def _request_url(self, request_id: str, suffix: str) -> str:
        return f"{self._base}/{self._app}/requests/{quote(request_id, safe='')}{suffix}"

    async def submit(self, request: SubmitRequest) -> SubmitResult:
        if not (request.model == self._app or request.model.startswith(self._app + "/")):
            raise ValueError(f"model {request.model!r} is not an endpoint of {self._app!r}")
        params = {"fal_webhook": request.webhook_url} if request.webhook_url else None
        headers = {**self._auth, "Idempotency-Key": request.client_request_id}
        response = await self.http.send(
            "POST",
            f"{self._base}/{request.model}",
            headers=headers,
            json_body={"prompt": request.prompt, **request.params},
            params=params,
            create=True,
        )
        self.http.check(response)
        answer = self.http.json_object(response)
        return SubmitResult(
            provider_task_id=require_text(answer, "request_id"), status=ProviderStatus.QUEUED
        )

    async def query(self, provider_task_id: str) -> JobState:
        response = await self.http.send(
            "GET", self._request_url(provider_task_id, "/status"), headers=self._auth
        )
        self.http.check(response)
        body = self.http.json_object(response)
        raw = body.get("status")
        status = QUEUE_STATUSES.get(raw) if isinstance(raw, str) else None
        if status is None:
            raise MalformedResponse(sample_of(body), "unknown_status")
        error_type = text_of(body.get("error_type"))
        if status is ProviderStatus.SUCCEEDED and (body.get("error") or error_type):
            status = ProviderStatus.FAILED
        return JobState(
            provider_task_id=provider_task_id,
            status=status,
            error_code=error_code(error_type, []) if status is ProviderStatus.FAILED else None,
            output_ref=(
                f"{self.name}:{provider_task_id}" if status is ProviderStatus.SUCCEEDED else None
            ),
        )

    async def cancel(self, provider_task_id: str) -> bool:
        response = await self.http.send(
            "PUT", self._request_url(provider_task_id, "/cancel"), headers=self._auth
        )
        if response.status_code == 400:
            try:
                body = response.json()
            except ValueError:
                body = None
            if isinstance(body, Mapping) and body.get("status") == "ALREADY_COMPLETED":
                return False
        self.http.check(response)
        return True
