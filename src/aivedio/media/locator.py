"""The output locator port: where a provider job's output can be downloaded right now.

Provider output URLs are signed and expire (and are credentials while they last), so the media
worker never stores one: on every run it asks the provider for a fresh URL through this port,
and again when a download is refused. A query is cheap next to a download.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

__all__ = ["OutputLocator", "OutputRef", "redact_url"]


@dataclass(frozen=True, slots=True)
class OutputRef:
    url: str  # a credential while it lasts: never log it, never store it
    content_type: str | None
    expires_at: datetime | None

    def __repr__(self) -> str:
        return f"OutputRef(url={redact_url(self.url)!r}, content_type={self.content_type!r})"


class OutputLocator(Protocol):
    async def fresh_output(self, provider: str, provider_task_id: str) -> OutputRef:
        """A freshly signed output URL of a succeeded job. Raises ``OutputUnavailable`` when
        the provider has no output for it (yet), ``OutputWithdrawn`` when it now says the job
        failed or was canceled, ``TransientFetchError`` when the query failed."""
        ...


def redact_url(url: str) -> str:
    """``scheme://host/path`` without credentials, query or fragment: what logs may carry."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
    except ValueError:
        return "<unparseable url>"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
