"""Download limits and failure classes, against an in-process HTTP transport."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from aivedio.media.errors import MediaRejected, OutputExpired, TransientFetchError
from aivedio.media.fetch import FetchLimits, download
from aivedio.media.locator import OutputRef, redact_url

URL = "https://cdn.example/files/gen_1.mp4?exp=1&sig=SECRET"


def client(status: int, body: bytes = b"x" * 100, **headers: str) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            status, content=body, headers={"content-type": "video/mp4", **headers}
        )

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def test_downloads_within_limits(tmp_path: Path) -> None:
    async with client(200, b"video bytes") as http:
        got = await download(http, URL, tmp_path / "f", FetchLimits())
    assert (got.size, got.content_type) == (11, "video/mp4")
    assert (tmp_path / "f").read_bytes() == b"video bytes"


@pytest.mark.parametrize("status", [401, 403, 404, 410])
async def test_refused_url_is_expired(tmp_path: Path, status: int) -> None:
    async with client(status) as http:
        with pytest.raises(OutputExpired) as info:
            await download(http, URL, tmp_path / "f", FetchLimits())
    assert "SECRET" not in str(info.value) and info.value.__cause__ is None


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503])
async def test_server_trouble_is_transient(tmp_path: Path, status: int) -> None:
    async with client(status) as http:
        with pytest.raises(TransientFetchError):
            await download(http, URL, tmp_path / "f", FetchLimits())


async def test_network_error_is_transient_and_hides_the_url(tmp_path: Path) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot connect to {request.url}")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        with pytest.raises(TransientFetchError) as info:
            await download(http, URL, tmp_path / "f", FetchLimits())
    assert "SECRET" not in str(info.value) and info.value.__cause__ is None


async def test_wrong_content_type_and_size_are_rejected(tmp_path: Path) -> None:
    async with client(200, b"<html>", **{"content-type": "text/html"}) as http:
        with pytest.raises(MediaRejected, match="content type"):
            await download(http, URL, tmp_path / "f", FetchLimits())
    async with client(200, b"x" * 2000) as http:
        with pytest.raises(MediaRejected, match="larger"):
            await download(http, URL, tmp_path / "f", FetchLimits(max_bytes=1000))
    async with client(200, b"") as http:
        with pytest.raises(MediaRejected, match="empty"):
            await download(http, URL, tmp_path / "f", FetchLimits())


def test_redaction() -> None:
    assert redact_url(URL) == "https://cdn.example/files/gen_1.mp4"
    assert redact_url("https://user:pw@h.example:8443/p?q=1#f") == "https://h.example:8443/p"
    assert "SECRET" not in repr(OutputRef(URL, "video/mp4", None))
