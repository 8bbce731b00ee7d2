"""The ``sandbox`` adapter: the DESIGN.md sandbox protocol (aivedio's own fake provider).

- create ``POST {base}/v1/generations`` with ``Idempotency-Key: <client_request_id>`` (honoured:
  the same key returns the same generation), ``metadata.client_request_id`` echoed everywhere;
- query ``GET {base}/v1/generations/{id}``, cancel ``POST .../{id}/cancel`` (409 = already
  finished), lookup ``GET {base}/v1/generations?idempotency_key=K``;
- webhooks: Standard Webhooks, body ``{"type": "generation.updated", "data": <GET body>}``,
  dedup key = ``webhook-id`` (``msg_<generation>_<sequence>``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from aivedio.domain.observation import ProviderStatus
from aivedio.providers.common import (
    AdapterBase,
    clamp_progress,
    mapping_of,
    public_code,
    require_text,
    text_of,
    time_of,
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
)
from aivedio.providers.redact import sample_of
from aivedio.providers.standard_webhooks import StandardWebhooksJson
from aivedio.providers.verify import StandardWebhooksVerifier

STATUSES: dict[str, ProviderStatus] = {
    "queued": ProviderStatus.QUEUED,
    "running": ProviderStatus.RUNNING,
    "succeeded": ProviderStatus.SUCCEEDED,
    "failed": ProviderStatus.FAILED,
    "canceled": ProviderStatus.CANCELED,
}

# The sandbox's error.code -> public code (anything else: generation_failed).
ERRORS: dict[str, str] = {
    "content_policy": "content_rejected",
    "content_rejected": "content_rejected",
    "safety": "content_rejected",
    "invalid_request": "invalid_request",
    "invalid_params": "invalid_request",
    "timeout": "timeout",
    "provider_unavailable": "provider_unavailable",
    "output_expired": "output_expired",
}


def _reject(status: int, body: Any) -> tuple[str, str | None]:
    code = text_of(mapping_of(mapping_of(body).get("error")).get("code"))
    if status in (400, 422) or code in ("invalid_body", "invalid_sandbox_params"):
        return "invalid_request", code
    return "submit_rejected", code


def generation_state(provider: str, data: Mapping[str, Any]) -> JobState:
    """A sandbox generation view (GET body or webhook ``data``) as a :class:`JobState`."""
    task_id = text_of(data.get("id"))
    raw_status = data.get("status")
    status = STATUSES.get(raw_status) if isinstance(raw_status, str) else None
    if task_id is None or status is None:
        raise PayloadError("unknown_status" if task_id else "missing_id", sample_of(data))
    sequence = data.get("sequence")
    error = mapping_of(data.get("error"))
    return JobState(
        provider_task_id=task_id,
        status=status,
        client_request_id=text_of(mapping_of(data.get("metadata")).get("client_request_id")),
        progress=clamp_progress(data.get("progress")),
        sequence=sequence if isinstance(sequence, int) and not isinstance(sequence, bool) else None,
        occurred_at=time_of(data.get("updated_at")),
        error_code=(
            public_code(text_of(error.get("code")), ERRORS, {})
            if status is ProviderStatus.FAILED
            else None
        ),
        output_ref=f"{provider}:{task_id}" if status is ProviderStatus.SUCCEEDED else None,
    )


class SandboxAdapter(AdapterBase):
    honours_idempotency_key = True
    supports_lookup = True

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        webhook_secrets: tuple[tuple[str, str], ...],
        public_url: str | None,
        name: str = "sandbox",
        tolerance_s: float = 300.0,
        http: HttpConfig | None = None,
        client: httpx.AsyncClient | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        verifier = StandardWebhooksVerifier(webhook_secrets, tolerance_s)
        super().__init__(
            name,
            verifier,
            public_url=public_url,
            http=http,
            client=client,
            max_body_bytes=max_body_bytes,
        )
        self._base = base_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {api_key}"}
        self._envelope = StandardWebhooksJson(name, verifier, max_body_bytes=max_body_bytes)

    # -- gateway / processor side -----------------------------------------------------------

    def dedup(
        self,
        headers: Mapping[str, str],
        payload: Mapping[str, Any],
        verified: Verified,
        payload_hash: bytes,
    ) -> DedupInfo:
        return self._envelope.dedup(headers, payload, verified, payload_hash)

    def normalize(self, payload: Mapping[str, Any], fields: InboxFields) -> JobState:
        data = payload.get("data")
        if not isinstance(data, Mapping):
            raise PayloadError("missing_data", sample_of(payload))
        return generation_state(self.name, data)

    # -- outbound side ----------------------------------------------------------------------

    async def submit(self, request: SubmitRequest) -> SubmitResult:
        body = {
            "model": request.model,
            "prompt": request.prompt,
            "params": dict(request.params),
            "webhook_url": request.webhook_url,
            "metadata": {**request.metadata, "client_request_id": request.client_request_id},
        }
        headers = {**self._auth, "Idempotency-Key": request.client_request_id}
        response = await self.http.send(
            "POST", f"{self._base}/v1/generations", headers=headers, json_body=body, create=True
        )
        self.http.check(response, reject=_reject)
        answer = self.http.json_object(response)
        raw_status = answer.get("status")
        return SubmitResult(
            provider_task_id=require_text(answer, "id"),
            status=STATUSES.get(raw_status) if isinstance(raw_status, str) else None,
            replayed=response.headers.get("idempotent-replayed", "").lower() == "true",
        )

    async def query(self, provider_task_id: str) -> JobState:
        response = await self.http.send(
            "GET", f"{self._base}/v1/generations/{provider_task_id}", headers=self._auth
        )
        self.http.check(response)
        return self._state(self.http.json_object(response))

    async def cancel(self, provider_task_id: str) -> bool:
        response = await self.http.send(
            "POST", f"{self._base}/v1/generations/{provider_task_id}/cancel", headers=self._auth
        )
        if response.status_code == 409:
            return False
        self.http.check(response)
        return True

    async def lookup(self, client_request_id: str) -> str | None:
        response = await self.http.send(
            "GET",
            f"{self._base}/v1/generations",
            headers=self._auth,
            params={"idempotency_key": client_request_id},
        )
        self.http.check(response)
        data = self.http.json_object(response).get("data")
        if not isinstance(data, list):
            raise MalformedResponse(sample_of(data), "missing_data")
        if not data:
            return None
        first = data[0]
        return require_text(first if isinstance(first, Mapping) else {}, "id")

    def _state(self, body: Mapping[str, Any]) -> JobState:
        try:
            return generation_state(self.name, body)
        except PayloadError as exc:
            raise MalformedResponse(exc.sample, exc.code) from None
