"""The ``replicate`` adapter: a Replicate-style prediction API.

- create ``POST {base}/v1/predictions`` (body ``{version, input, webhook,
  webhook_events_filter}``) or ``POST {base}/v1/models/{owner}/{name}/predictions`` for an
  official model (``model`` without ``:version``); the answer is the prediction object;
- query ``GET {base}/v1/predictions/{id}``, cancel ``POST {base}/v1/predictions/{id}/cancel``;
- webhooks: Standard Webhooks signatures; the body is the prediction object itself (no envelope):
  ``{id, status, created_at, started_at, completed_at, output, error, logs, metrics, ...}``;
  statuses ``starting | processing | succeeded | failed | canceled`` (and ``aborted``).
- No progress figure and no sequence: ``logs`` and ``metrics`` are ignored (and not stored);
  ``output`` (a URL or list of URLs) is redacted when stored. The prediction does not echo our
  id, so an early callback waits as an orphan until the submitter records the prediction id.
- Replicate documents no idempotency key: ``honours_idempotency_key`` is False (an unknown
  submit outcome is reconciled, never blindly retried), and there is no lookup by our id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from aivedio.domain.observation import ProviderStatus
from aivedio.providers.common import AdapterBase, fallback_dedup_key, require_text, text_of, time_of
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
from aivedio.providers.verify import StandardWebhooksVerifier

STATUSES: dict[str, ProviderStatus] = {
    "starting": ProviderStatus.QUEUED,
    "processing": ProviderStatus.RUNNING,
    "succeeded": ProviderStatus.SUCCEEDED,
    "failed": ProviderStatus.FAILED,
    "canceled": ProviderStatus.CANCELED,
    "aborted": ProviderStatus.CANCELED,
}
_CONTENT_MARKERS = ("nsfw", "safety", "content policy", "flagged")
WEBHOOK_EVENTS = ("start", "output", "completed")
_DROPPED = frozenset({"input", "logs", "metrics"})


def error_code(message: object) -> str:
    """Replicate's ``error`` is free text: a content-filter refusal is ``content_rejected``,
    anything else ``generation_failed``. The text itself never leaves the adapter."""
    text = message.lower() if isinstance(message, str) else ""
    return "content_rejected" if any(m in text for m in _CONTENT_MARKERS) else "generation_failed"


def prediction_state(provider: str, body: Mapping[str, Any]) -> JobState:
    task_id = text_of(body.get("id"))
    raw = body.get("status")
    status = STATUSES.get(raw) if isinstance(raw, str) else None
    if task_id is None or status is None:
        raise PayloadError("unknown_status" if task_id else "missing_id", sample_of(body))
    return JobState(
        provider_task_id=task_id,
        status=status,
        occurred_at=time_of(
            body.get("completed_at") or body.get("started_at") or body.get("created_at")
        ),
        error_code=error_code(body.get("error")) if status is ProviderStatus.FAILED else None,
        output_ref=f"{provider}:{task_id}" if status is ProviderStatus.SUCCEEDED else None,
    )


class ReplicateAdapter(AdapterBase):
    url_keys = frozenset({"output"})

    def __init__(
        self,
        *,
        api_token: str,
        webhook_secrets: tuple[tuple[str, str], ...],
        public_url: str | None,
        base_url: str = "https://api.replicate.com",
        name: str = "replicate",
        tolerance_s: float = 300.0,
        http: HttpConfig | None = None,
        client: httpx.AsyncClient | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        super().__init__(
            name,
            StandardWebhooksVerifier(webhook_secrets, tolerance_s),
            public_url=public_url,
            http=http,
            client=client,
            max_body_bytes=max_body_bytes,
        )
        self._base = base_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {api_token}"}

    def dedup(
        self,
        headers: Mapping[str, str],
        payload: Mapping[str, Any],
        verified: Verified,
        payload_hash: bytes,
    ) -> DedupInfo:
        task_id = text_of(payload.get("id"))
        status = text_of(payload.get("status"))
        changed = payload.get("completed_at") or payload.get("started_at")
        key = verified.event_id or fallback_dedup_key(
            task_id, status, text_of(changed), payload_hash
        )
        return DedupInfo(
            dedup_key=key,
            event_type=status,
            provider_event_id=verified.event_id,
            provider_task_id=task_id,
            occurred_at=time_of(changed or payload.get("created_at")),
        )

    def minimize(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        return super().minimize({k: v for k, v in payload.items() if k not in _DROPPED})

    def normalize(self, payload: Mapping[str, Any], fields: InboxFields) -> JobState:
        return prediction_state(self.name, payload)

    async def submit(self, request: SubmitRequest) -> SubmitResult:
        body: dict[str, Any] = {"input": {"prompt": request.prompt, **request.params}}
        if request.webhook_url:
            body["webhook"] = request.webhook_url
            body["webhook_events_filter"] = list(WEBHOOK_EVENTS)
        owner_name, colon, version = request.model.partition(":")
        if colon:
            url = f"{self._base}/v1/predictions"
            body["version"] = version
        elif "/" in owner_name:
            url = f"{self._base}/v1/models/{owner_name}/predictions"
        else:
            url = f"{self._base}/v1/predictions"
            body["version"] = owner_name
        headers = {**self._auth, "Idempotency-Key": request.client_request_id}
        response = await self.http.send("POST", url, headers=headers, json_body=body, create=True)
        self.http.check(response)
        answer = self.http.json_object(response)
        raw = answer.get("status")
        return SubmitResult(
            provider_task_id=require_text(answer, "id"),
            status=STATUSES.get(raw) if isinstance(raw, str) else None,
        )

    async def query(self, provider_task_id: str) -> JobState:
        response = await self.http.send(
            "GET", f"{self._base}/v1/predictions/{provider_task_id}", headers=self._auth
        )
        self.http.check(response)
        return self._state(self.http.json_object(response))

    async def cancel(self, provider_task_id: str) -> bool:
        response = await self.http.send(
            "POST", f"{self._base}/v1/predictions/{provider_task_id}/cancel", headers=self._auth
        )
        self.http.check(response)
        state = self._state(self.http.json_object(response))
        return state.status not in (ProviderStatus.SUCCEEDED, ProviderStatus.FAILED)

    def _state(self, body: Mapping[str, Any]) -> JobState:
        try:
            return prediction_state(self.name, body)
        except PayloadError as exc:
            raise MalformedResponse(exc.sample, exc.code) from None
