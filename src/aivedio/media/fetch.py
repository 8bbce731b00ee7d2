"""Download a provider output to a local file: bounded in size and time, content type checked.

The URL is a credential: it is never logged and never appears in an error's text (errors carry
the status code or the exception type only).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import httpx

from aivedio.media.errors import MediaRejected, OutputExpired, TransientFetchError

__all__ = ["FetchLimits", "Fetched", "download"]

# Refusals that mean "this URL no longer works": ask the provider for a fresh one.
_EXPIRED = frozenset({401, 403, 404, 410})


@dataclass(frozen=True, slots=True)
class FetchLimits:
    max_bytes: int = 512 * 1024 * 1024
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0  # between two chunks
    total_timeout_s: float = 300.0
    content_types: frozenset[str] = frozenset(
        {"video/mp4", "video/quicktime", "video/webm", "application/octet-stream"}
    )
    max_redirects: int = 3


@dataclass(frozen=True, slots=True)
class Fetched:
    size: int
    content_type: str


def media_type(header: str | None) -> str:
    return (header or "").split(";")[0].strip().lower()


async def download(
    client: httpx.AsyncClient, url: str, target: Path, limits: FetchLimits
) -> Fetched:
    """Stream ``url`` into ``target``. Raises ``OutputExpired``, ``TransientFetchError`` or
    ``MediaRejected`` (wrong content type, too large)."""
    timeout = httpx.Timeout(
        connect=limits.connect_timeout_s,
        read=limits.read_timeout_s,
        write=limits.read_timeout_s,
        pool=limits.connect_timeout_s,
    )
    try:
        async with asyncio.timeout(limits.total_timeout_s):
            return await _download(client, url, target, limits, timeout)
    except TimeoutError:
        raise TransientFetchError("download took longer than the total timeout") from None
    except httpx.TooManyRedirects:
        raise MediaRejected("too many redirects") from None
    except httpx.HTTPError as exc:
        raise TransientFetchError(f"download failed: {type(exc).__name__}") from None


async def _download(
    client: httpx.AsyncClient, url: str, target: Path, limits: FetchLimits, budget: httpx.Timeout
) -> Fetched:
    request = client.build_request("GET", url, timeout=budget)
    response = await client.send(request, stream=True, follow_redirects=True)
    try:
        if response.status_code in _EXPIRED:
            raise OutputExpired(f"output URL refused with {response.status_code}")
        if response.status_code != 200:
            raise TransientFetchError(f"output download answered {response.status_code}")
        content_type = media_type(response.headers.get("content-type"))
        if content_type not in limits.content_types:
            raise MediaRejected(f"unsupported content type {content_type!r}")
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
            raise MediaRejected(f"output larger than {limits.max_bytes} bytes")
        size = 0
        with target.open("wb") as handle:
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limits.max_bytes:
                    raise MediaRejected(f"output larger than {limits.max_bytes} bytes")
                await asyncio.to_thread(handle.write, chunk)
        if size == 0:
            raise MediaRejected("empty output")
        return Fetched(size, content_type)
    finally:
        await response.aclose()
