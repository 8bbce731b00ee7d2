"""The ``kling`` adapter: Kling-style tasks with UNSIGNED callbacks.

- create ``POST {base}/v1/videos/text2video`` with ``Authorization: Bearer <JWT>`` (HS256,
  ``iss`` = access key, signed with the secret key, 30 min) and body ``{model_name, prompt,
  callback_url, external_task_id, ...params}`` -> ``{code, message, request_id, data: {task_id,
  task_status, task_info: {external_task_id}, created_at, updated_at}}``; ``code`` 0 is success;
- query ``GET {base}/v1/videos/text2video/{task_id}``; lookup by our id (``external_task_id``)
  ``GET {base}/v1/videos/text2video?external_task_id=K``; no cancel operation;
- the callback body is the task itself: ``{task_id, task_status, task_status_msg, created_at,
  updated_at (ms), task_info: {external_task_id}, task_result: {videos: [{id, url, duration}]}}``
  with statuses ``submitted | processing | succeed | failed``;
- nothing is signed: the callback URL carries ``?token=`` minted per attempt
  (:func:`~aivedio.providers.verify.mint_callback_token`), which authenticates the URL, not the
  body.
  ``needs_refetch_on_callback``: the processor queries the task before it changes any state.
- envelope ``code`` -> error: 1000-1099 auth, 1100-1199 account (submit_rejected), 1200-1299
  parameters (invalid_request), 1300-1301 content policy (content_rejected), 1302-1304 rate or
  concurrency limits (RateLimited), 5000+ provider errors. ``task_status_msg`` of a failed task is
  free text: content-moderation wording -> ``content_rejected``, else ``generation_failed``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

import httpx

from aivedio.domain.observation import ProviderStatus
from aivedio.providers.common import AdapterBase, fallback_dedup_key, mapping_of, text_of, time_of
from aivedio.providers.http import HttpConfig
from aivedio.providers.port import (
    DEFAULT_MAX_BODY_BYTES,
    AuthFailed,
    DedupInfo,
    InboxFields,
    JobState,
    MalformedResponse,
    PayloadError,
    ProviderUnavailable,
    RateLimited,
    Rejected,
    SubmitRequest,
    SubmitResult,
    Unsupported,
    Verified,
)
from aivedio.providers.redact import sample_of
from aivedio.providers.verify import CallbackTokenVerifier, mint_callback_token

STATUSES: dict[str, ProviderStatus] = {
    "submitted": ProviderStatus.QUEUED,
    "processing": ProviderStatus.RUNNING,
    "succeed": ProviderStatus.SUCCEEDED,
    "failed": ProviderStatus.FAILED,
}
_CONTENT_MARKERS = ("risk", "moderation", "sensitive", "content security", "policy")
_DROPPED = frozenset({"final_unit_deduction"})
JWT_TTL_S = 1800
_JWT_REFRESH_S = 300


def failure_code(message: object) -> str:
    text = message.lower() if isinstance(message, str) else ""
    return "content_rejected" if any(m in text for m in _CONTENT_MARKERS) else "generation_failed"


def envelope_error(http_status: int, code: object) -> Exception | None:
    """The named error for a Kling envelope ``code`` (None for 0 = success)."""
    if code == 0:
        return None
    number = code if isinstance(code, int) and not isinstance(code, bool) else -1
    if 1000 <= number < 1100:
        return AuthFailed(http_status if http_status in (401, 403) else 401)
    if 1100 <= number < 1200:
        return Rejected(http_status, "submit_rejected", str(number))
    if 1200 <= number < 1300:
        return Rejected(http_status, "invalid_request", str(number))
    if number in (1300, 1301):
        return Rejected(http_status, "content_rejected", str(number))
    if 1302 <= number <= 1304:
        return RateLimited(None)
    if number >= 5000:
        return ProviderUnavailable(http_status, str(number))
    return MalformedResponse(f'{{"code":{number}}}', "unknown_code")


def task_state(provider: str, data: Mapping[str, Any]) -> JobState:
    task_id = text_of(data.get("task_id"))
    raw = data.get("task_status")
    status = STATUSES.get(raw) if isinstance(raw, str) else None
    if task_id is None or status is None:
        raise PayloadError("unknown_status" if task_id else "missing_id", sample_of(data))
    failed = status is ProviderStatus.FAILED
    return JobState(
        provider_task_id=task_id,
        status=status,
        client_request_id=text_of(mapping_of(data.get("task_info")).get("external_task_id")),
        occurred_at=time_of(data.get("updated_at"), millis=True),
        error_code=failure_code(data.get("task_status_msg")) if failed else None,
        output_ref=f"{provider}:{task_id}" if status is ProviderStatus.SUCCEEDED else None,
    )


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def kling_jwt(access_key: str, secret_key: str, now: float) -> str:
    header = _b64url(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    claims = {"iss": access_key, "exp": int(now) + JWT_TTL_S, "nbf": int(now) - 5}
    body = _b64url(json.dumps(claims, separators=(",", ":")).encode())
    signing_input = f"{header}.{body}".encode("ascii")
    signature = hmac.new(secret_key.encode(), signing_input, hashlib.sha256).digest()
    return f"{header}.{body}.{_b64url(signature)}"


class KlingAdapter(AdapterBase):
    signed_callbacks = False
    needs_refetch_on_callback = True
    supports_lookup = True

    def __init__(
        self,
        *,
        access_key: str,
        secret_key: str,
        callback_token_secrets: tuple[tuple[str, bytes], ...],
        public_url: str | None,
        base_url: str = "https://api-singapore.klingai.com",
        name: str = "kling",
        http: HttpConfig | None = None,
        client: httpx.AsyncClient | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            name,
            CallbackTokenVerifier(callback_token_secrets),
            public_url=public_url,
            http=http,
            client=client,
            max_body_bytes=max_body_bytes,
        )
        self._base = base_url.rstrip("/")
        self._access_key = access_key
        self._secret_key = secret_key
        self._token_secret = callback_token_secrets[0][1]
        self._clock = clock
        self._jwt: tuple[str, float] | None = None

    def _headers(self) -> dict[str, str]:
        now = self._clock()
        if self._jwt is None or self._jwt[1] - now < _JWT_REFRESH_S:
            self._jwt = (kling_jwt(self._access_key, self._secret_key, now), now + JWT_TTL_S)
        return {"Authorization": f"Bearer {self._jwt[0]}"}

    # -- gateway / processor side -----------------------------------------------------------

    def webhook_url_for(self, attempt_id: str) -> str | None:
        base = super().webhook_url_for(attempt_id)
        if base is None:
            return None
        return f"{base}?token={quote(mint_callback_token(self._token_secret, attempt_id))}"

    def dedup(
        self,
        headers: Mapping[str, str],
        payload: Mapping[str, Any],
        verified: Verified,
        payload_hash: bytes,
    ) -> DedupInfo:
        task_id = text_of(payload.get("task_id"))
        status = text_of(payload.get("task_status"))
        updated = text_of(payload.get("updated_at"))
        return DedupInfo(
            dedup_key=fallback_dedup_key(task_id, status, updated, payload_hash),
            event_type=status,
            provider_task_id=task_id,
            client_request_id=text_of(mapping_of(payload.get("task_info")).get("external_task_id")),
            occurred_at=time_of(payload.get("updated_at"), millis=True),
        )

    def minimize(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        return super().minimize({k: v for k, v in payload.items() if k not in _DROPPED})

    def normalize(self, payload: Mapping[str, Any], fields: InboxFields) -> JobState:
        """The callback's CLAIM (unauthenticated): the processor re-fetches before applying."""
        return task_state(self.name, payload)

    # -- outbound side ----------------------------------------------------------------------

    def _data(self, response: httpx.Response) -> Mapping[str, Any]:
        """The envelope's ``data``; an HTTP error or a non-zero ``code`` as the named error."""
        if response.status_code == 404:
            self.http.check(response)  # NotFoundYet, whatever the envelope code
        if response.status_code >= 400:
            try:
                code = mapping_of(response.json()).get("code")
            except ValueError:
                code = None
            error = envelope_error(response.status_code, code) if code is not None else None
            if error is not None and not isinstance(error, MalformedResponse):
                raise error
            self.http.check(response)
        envelope = self.http.json_object(response)
        error = envelope_error(response.status_code, envelope.get("code"))
        if error is not None:
            raise error
        data = envelope.get("data")
        if not isinstance(data, Mapping):
            raise MalformedResponse(sample_of(envelope), "missing_data")
        return data

    async def submit(self, request: SubmitRequest) -> SubmitResult:
        body: dict[str, Any] = {
            "model_name": request.model,
            "prompt": request.prompt,
            **request.params,
            "external_task_id": request.client_request_id,
        }
        if request.webhook_url:
            body["callback_url"] = request.webhook_url
        response = await self.http.send(
            "POST",
            f"{self._base}/v1/videos/text2video",
            headers={**self._headers(), "Idempotency-Key": request.client_request_id},
            json_body=body,
            create=True,
        )
        data = self._data(response)
        task_id = text_of(data.get("task_id"))
        if task_id is None:
            raise MalformedResponse(sample_of(data), "missing_task_id")
        raw = data.get("task_status")
        return SubmitResult(
            provider_task_id=task_id,
            status=STATUSES.get(raw) if isinstance(raw, str) else None,
        )

    async def query(self, provider_task_id: str) -> JobState:
        response = await self.http.send(
            "GET",
            f"{self._base}/v1/videos/text2video/{quote(provider_task_id, safe='')}",
            headers=self._headers(),
        )
        data = self._data(response)
        try:
            return task_state(self.name, data)
        except PayloadError as exc:
            raise MalformedResponse(exc.sample, exc.code) from None

    async def cancel(self, provider_task_id: str) -> bool:
        raise Unsupported("kling has no cancel operation")

    async def lookup(self, client_request_id: str) -> str | None:
        response = await self.http.send(
            "GET",
            f"{self._base}/v1/videos/text2video",
            headers=self._headers(),
            params={"external_task_id": client_request_id},
        )
        if response.status_code == 404:
            return None
        data = self._data(response)
        return text_of(data.get("task_id"))
