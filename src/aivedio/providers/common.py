"""What every adapter shares: name, verifier, body limit, HTTP edge, callback URL."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from aivedio.providers.base import HttpConfig, HttpSender, Unsupported, new_client
from aivedio.providers.callback import DEFAULT_MAX_BODY_BYTES, redact
from aivedio.providers.verify import Reason, VerificationError, Verified, Verifier

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
