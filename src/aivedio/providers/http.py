"""The HTTP edge every adapter shares: explicit timeouts, one send, failures as named errors.

:class:`HttpSender` sends a request once (never retried here) and translates transport failures
and non-2xx answers into the :class:`~aivedio.providers.port.ProviderError` family, so each adapter
only says where to send what.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from aivedio.providers.port import (
    AuthFailed,
    MalformedResponse,
    NotFoundYet,
    ProviderUnavailable,
    RateLimited,
    Rejected,
    SubmitOutcomeUnknown,
)
from aivedio.providers.redact import sample_of

__all__ = ["HttpConfig", "HttpSender", "new_client", "retry_after"]


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """Timeouts (seconds) and pool size of an adapter's httpx client. A create gets its own,
    longer read timeout: hanging up early makes an unknown outcome."""

    connect_timeout_s: float = 3.0
    read_timeout_s: float = 10.0
    write_timeout_s: float = 10.0
    pool_timeout_s: float = 2.0
    create_read_timeout_s: float = 30.0
    max_connections: int = 100

    def timeout(self, *, create: bool = False) -> httpx.Timeout:
        return httpx.Timeout(
            connect=self.connect_timeout_s,
            read=self.create_read_timeout_s if create else self.read_timeout_s,
            write=self.write_timeout_s,
            pool=self.pool_timeout_s,
        )


def new_client(config: HttpConfig) -> httpx.AsyncClient:
    """An httpx client with explicit timeouts, no redirects and NO transport retries."""
    return httpx.AsyncClient(
        timeout=config.timeout(),
        follow_redirects=False,
        transport=httpx.AsyncHTTPTransport(
            retries=0, limits=httpx.Limits(max_connections=config.max_connections)
        ),
    )


# Transport failures that prove the request never left (safe to send again).
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


def retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date; None when absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


class HttpSender:
    """One adapter's HTTP edge: sends once, translates every failure into a ProviderError.

    ``reject`` maps a 4xx body to a public code (adapter-specific); the default is
    ``invalid_request`` for 400/422 and ``submit_rejected`` otherwise.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        config: HttpConfig,
        *,
        owns_client: bool,
    ) -> None:
        self.client = client
        self.config = config
        self._owns = owns_client

    async def aclose(self) -> None:
        if self._owns:
            await self.client.aclose()

    async def send(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        create: bool = False,
    ) -> httpx.Response:
        """Send once. Transport failures: :class:`ProviderUnavailable` when the request cannot
        have arrived; after sending, :class:`SubmitOutcomeUnknown` for a create and
        :class:`ProviderUnavailable` for anything else. Status codes are NOT checked here."""
        try:
            return await self.client.request(
                method,
                url,
                headers=dict(headers or {}),
                json=json_body,
                params=dict(params) if params else None,
                timeout=self.config.timeout(create=create),
            )
        except _NOT_SENT as exc:
            raise ProviderUnavailable(None, type(exc).__name__) from None
        except httpx.TransportError as exc:
            if create:
                raise SubmitOutcomeUnknown(
                    f"no answer after sending ({type(exc).__name__})"
                ) from None
            raise ProviderUnavailable(None, type(exc).__name__) from None

    @staticmethod
    def check(
        response: httpx.Response,
        *,
        reject: Any = None,
    ) -> None:
        """Raise the named error for a non-2xx answer."""
        status = response.status_code
        if 200 <= status < 300:
            return
        if status == 429:
            raise RateLimited(retry_after(response.headers.get("retry-after")))
        if status in (401, 403):
            raise AuthFailed(status)
        if status == 404:
            raise NotFoundYet(f"provider answered 404 for {response.request.method}")
        if status >= 500:
            raise ProviderUnavailable(status)
        body: Any
        try:
            body = response.json()
        except ValueError:
            body = None
        if reject is not None:
            code, provider_code = reject(status, body)
        else:
            code, provider_code = (
                ("invalid_request" if status in (400, 422) else "submit_rejected"),
                None,
            )
        raise Rejected(status, code, provider_code)

    @staticmethod
    def json_object(response: httpx.Response) -> Mapping[str, Any]:
        """The body as a JSON object, else :class:`MalformedResponse` with a redacted sample."""
        try:
            body = response.json()
        except ValueError:
            raise MalformedResponse(sample_of(response.content), "not_json") from None
        if not isinstance(body, dict):
            raise MalformedResponse(sample_of(body), "not_object")
        return body
