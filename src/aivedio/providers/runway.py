"""The ``runway`` adapter: a Runway-style task API. Poll-only: Runway sends no webhooks.

- create ``POST {base}/v1/text_to_video`` (or ``/v1/image_to_video`` when ``params`` carries
  ``promptImage``) with ``Authorization: Bearer``, ``X-Runway-Version`` and body
  ``{model, promptText, ...params}`` -> ``{id}``;
- query ``GET {base}/v1/tasks/{id}`` -> ``{id, status, createdAt, progress, output, failure,
  failureCode}``; statuses ``PENDING | THROTTLED | RUNNING | SUCCEEDED | FAILED | CANCELLED``
  (THROTTLED: waiting for a concurrency slot at Runway, i.e. provider-queued); ``progress`` is a
  float 0..1, scaled to 0..100; a new task may answer 404 for a moment (:class:`NotFoundYet`);
- cancel ``DELETE {base}/v1/tasks/{id}`` -> 204 (on a finished task this deletes it: call it
  only for an attempt that is still in flight);
- ``failureCode`` -> public code: ``SAFETY.*`` and ``INPUT_PREPROCESSING.SAFETY.*`` ->
  ``content_rejected``; ``INPUT_PREPROCESSING.*`` and ``ASSET.INVALID`` -> ``invalid_request``;
  ``INTERNAL.BAD_OUTPUT.*``, ``INTERNAL*`` and anything else -> ``generation_failed``. The
  ``failure`` text is never shown.
- No idempotency key, no lookup by our id: an unknown create outcome goes to reconciliation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from aivedio.domain.observation import ProviderStatus
from aivedio.providers.common import (
    AdapterBase,
    NoCallbacks,
    clamp_progress,
    fallback_dedup_key,
    public_code,
    require_text,
    text_of,
    time_of,
)
from aivedio.providers.http import HttpConfig
from aivedio.providers.port import (
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

API_VERSION = "2024-11-06"

STATUSES: dict[str, ProviderStatus] = {
    "PENDING": ProviderStatus.QUEUED,
    "THROTTLED": ProviderStatus.QUEUED,
    "RUNNING": ProviderStatus.RUNNING,
    "SUCCEEDED": ProviderStatus.SUCCEEDED,
    "FAILED": ProviderStatus.FAILED,
    "CANCELLED": ProviderStatus.CANCELED,
}
ERRORS: dict[str, str] = {"ASSET.INVALID": "invalid_request"}
ERROR_PREFIXES: dict[str, str] = {
    "SAFETY.": "content_rejected",
    "INPUT_PREPROCESSING.SAFETY.": "content_rejected",
    "INPUT_PREPROCESSING.": "invalid_request",
    "ASSET.": "invalid_request",
    "INTERNAL": "generation_failed",
}


def task_state(provider: str, body: Mapping[str, Any]) -> JobState:
    task_id = text_of(body.get("id"))
    raw = body.get("status")
    status = STATUSES.get(raw) if isinstance(raw, str) else None
    if task_id is None or status is None:
        raise PayloadError("unknown_status" if task_id else "missing_id", sample_of(body))
    failed = status is ProviderStatus.FAILED
    return JobState(
        provider_task_id=task_id,
        status=status,
        progress=clamp_progress(body.get("progress"), scale=100.0),
        occurred_at=time_of(body.get("createdAt")),
        error_code=(
            public_code(text_of(body.get("failureCode")), ERRORS, ERROR_PREFIXES)
            if failed
            else None
        ),
        output_ref=f"{provider}:{task_id}" if status is ProviderStatus.SUCCEEDED else None,
    )


def _reject(status: int, body: Any) -> tuple[str, str | None]:
    return ("invalid_request" if status in (400, 422) else "submit_rejected"), None


class RunwayAdapter(AdapterBase):
    supports_webhooks = False
    signed_callbacks = False
    url_keys = frozenset({"output"})

    def __init__(
        self,
        *,
        api_key: str,
        base_url: str = "https://api.dev.runwayml.com",
        api_version: str = API_VERSION,
        name: str = "runway",
        http: HttpConfig | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(name, NoCallbacks(), public_url=None, http=http, client=client)
        self._base = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}", "X-Runway-Version": api_version}

    def dedup(
        self,
        headers: Mapping[str, str],
        payload: Mapping[str, Any],
        verified: Verified,
        payload_hash: bytes,
    ) -> DedupInfo:
        task_id = text_of(payload.get("id"))
        status = text_of(payload.get("status"))
        return DedupInfo(
            dedup_key=fallback_dedup_key(task_id, status, None, payload_hash),
            event_type=status,
            provider_task_id=task_id,
        )

    def normalize(self, payload: Mapping[str, Any], fields: InboxFields) -> JobState:
        """A task object (Runway sends no callbacks; used for recorded payloads)."""
        return task_state(self.name, payload)

    async def submit(self, request: SubmitRequest) -> SubmitResult:
        path = "image_to_video" if "promptImage" in request.params else "text_to_video"
        response = await self.http.send(
            "POST",
            f"{self._base}/v1/{path}",
            headers={**self._headers, "Idempotency-Key": request.client_request_id},
            json_body={"model": request.model, "promptText": request.prompt, **request.params},
            create=True,
        )
        self.http.check(response, reject=_reject)
        answer = self.http.json_object(response)
        return SubmitResult(provider_task_id=require_text(answer, "id"))

    async def query(self, provider_task_id: str) -> JobState:
        response = await self.http.send(
            "GET", f"{self._base}/v1/tasks/{provider_task_id}", headers=self._headers
        )
        self.http.check(response)
        body = self.http.json_object(response)
        try:
            return task_state(self.name, body)
        except PayloadError as exc:
            raise MalformedResponse(exc.sample, exc.code) from None

    async def cancel(self, provider_task_id: str) -> bool:
        response = await self.http.send(
            "DELETE", f"{self._base}/v1/tasks/{provider_task_id}", headers=self._headers
        )
        self.http.check(response)
        return True
