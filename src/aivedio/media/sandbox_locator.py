"""The sandbox provider's output locator: ``GET {base}/v1/generations/{id}`` with the API key.

The provider adapters will later offer one locator for every provider; this one speaks the
sandbox protocol only (docs/reference/sandbox-provider.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx

from aivedio.media.errors import OutputUnavailable, OutputWithdrawn, TransientFetchError
from aivedio.media.locator import OutputRef

__all__ = ["SandboxLocatorConfig", "SandboxOutputLocator"]


@dataclass(frozen=True, slots=True)
class SandboxLocatorConfig:
    base_url: str
    api_key: str
    timeout_s: float = 5.0


class SandboxOutputLocator:
    def __init__(self, config: SandboxLocatorConfig, client: httpx.AsyncClient) -> None:
        self.config = config
        self.client = client  # owned by the caller

    async def fresh_output(self, provider: str, provider_task_id: str) -> OutputRef:
        if provider != "sandbox":
            raise OutputUnavailable(f"the sandbox locator cannot locate {provider} outputs")
        url = f"{self.config.base_url.rstrip('/')}/v1/generations/{quote(provider_task_id)}"
        try:
            response = await self.client.get(
                url,
                headers={"Authorization": f"Bearer {self.config.api_key}"},
                timeout=self.config.timeout_s,
            )
        except httpx.HTTPError as exc:
            raise TransientFetchError(f"provider query failed: {type(exc).__name__}") from exc
        if response.status_code == 404:
            raise OutputUnavailable("the provider does not know the job")
        if response.status_code != 200:
            raise TransientFetchError(f"provider query answered {response.status_code}")
        try:
            body: Any = response.json()
            status = body.get("status")
            output = body.get("output") if status == "succeeded" else None
        except (ValueError, AttributeError):
            raise TransientFetchError("provider query answered malformed JSON") from None
        if status in ("failed", "canceled"):
            # The provider contradicted the success the task was moved on by: no output, ever.
            raise OutputWithdrawn(f"the provider now reports the job {status}")
        if not isinstance(output, dict) or not isinstance(output.get("url"), str):
            raise OutputUnavailable("the provider job has no output")
        return OutputRef(
            url=output["url"],
            content_type=output.get("content_type"),
            expires_at=_parse_time(output.get("expires_at")),
        )


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
