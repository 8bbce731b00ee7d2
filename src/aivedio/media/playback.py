"""Short-lived signed playback links (the asset's ``playback_url`` needs re-authorisation).

``GET /v1/projects/{project_id}/assets/{asset_id}/playback`` (API key) checks that the caller's
tenant owns the project and the asset, then answers ``{"url", "expires_at"}`` with a signed
``/v1/media/{asset_id}?exp=<unix>&sig=<sig>`` (or a 302 to it with ``?redirect=1``, what a
``<video src>`` can follow). The media URL needs no API key: the signature is the credential,
and it stops working at ``exp`` (403). ``sig`` is base64url(HMAC-SHA256(secret,
``"playback:{asset_id}:{exp}"``)). The file streams from the object store with ``Range``
support (browsers seek with it). In production a CDN would sign its own URLs here instead.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from aivedio.api.auth import authenticate
from aivedio.api.http import ApiError, respond
from aivedio.api.models import PlaybackLink
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.storage.port import ObjectNotFound, ObjectStore

__all__ = ["PlaybackConfig", "playback_routes", "sign_playback", "verify_playback"]

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@dataclass(frozen=True, slots=True)
class PlaybackConfig:
    secret: bytes
    ttl_s: int = 300  # how long one signed media URL works
    chunk_size: int = 256 * 1024

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("the playback secret must be at least 16 bytes")
        if self.ttl_s <= 0:
            raise ValueError("ttl_s must be positive")


def _sig(asset_id: uuid.UUID | str, expires: int, secret: bytes) -> str:
    mac = hmac.new(secret, f"playback:{asset_id}:{expires}".encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")


def sign_playback(
    asset_id: uuid.UUID, expires_in: float, secret: bytes, now: float | None = None
) -> str:
    """The signed media path ``/v1/media/{asset_id}?exp=..&sig=..`` valid for ``expires_in`` s."""
    expires = math.ceil((time.time() if now is None else now) + expires_in)
    query = urlencode({"exp": expires, "sig": _sig(asset_id, expires, secret)})
    return f"/v1/media/{asset_id}?{query}"


def verify_playback(
    asset_id: uuid.UUID | str,
    exp: str | None,
    sig: str | None,
    secret: bytes,
    now: float | None = None,
) -> bool:
    """True while the link is unexpired and its signature matches."""
    if exp is None or sig is None or not exp.isdigit() or len(exp) > 12:
        return False
    expires = int(exp)
    if expires <= (time.time() if now is None else now):
        return False
    return hmac.compare_digest(_sig(asset_id, expires, secret), sig)


def _forbidden() -> ApiError:
    return ApiError(403, "forbidden", "the playback link is invalid or has expired")


def _not_found() -> ApiError:
    return ApiError(404, "not_found", "asset not found")


def _parse_uuid(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise _not_found() from None


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end_inclusive)`` of a single satisfiable ``bytes=`` range, ``None`` for the
    whole file; raises 416 for an unsatisfiable one."""
    if not header:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        return None  # multi-range or malformed: serve the whole file (RFC 9110 allows it)
    first, last = match.group(1), match.group(2)
    if first == "":  # suffix: the last N bytes
        start, end = max(size - int(last), 0), size - 1
    else:
        start = int(first)
        end = min(int(last), size - 1) if last else size - 1
    if start >= size or start > end:
        raise ApiError(416, "range_not_satisfiable", "the requested range is outside the file",
                       headers={"Content-Range": f"bytes */{size}"})  # fmt: skip
    return start, end


def playback_routes(
    db: Database,
    store: ObjectStore,
    config: PlaybackConfig,
    clock: Callable[[], float] = time.time,
) -> list[BaseRoute]:
    """The two routes; the lead mounts them on the API app (``create_app(extra_routes=...)``)."""
    return [
        Route(
            "/v1/projects/{project_id}/assets/{asset_id}/playback",
            _issue_endpoint(db, config, clock),
            methods=["GET"],
        ),
        Route(
            "/v1/media/{asset_id}",
            _media_endpoint(db, store, config, clock),
            methods=["GET", "HEAD"],
        ),
    ]


def _issue_endpoint(
    db: Database, config: PlaybackConfig, clock: Callable[[], float]
) -> Callable[[Request], Awaitable[Response]]:
    """``GET .../assets/{asset_id}/playback``: a signed, expiring link (or a redirect to it)."""

    async def issue(request: Request) -> Response:
        principal = await authenticate(db, request)
        project_id = _parse_uuid(request.path_params["project_id"])
        asset_id = _parse_uuid(request.path_params["asset_id"])
        async with db.connection() as conn:
            row = await conn.fetchrow(
                q("asset_of_project"), asset_id, project_id, principal.tenant_id
            )
        if row is None:
            raise _not_found()
        now = clock()
        path = sign_playback(asset_id, config.ttl_s, config.secret, now)
        expires = datetime.fromtimestamp(math.ceil(now + config.ttl_s), UTC)
        url = str(request.base_url).rstrip("/") + path
        if request.query_params.get("redirect") in ("1", "true"):
            return RedirectResponse(url, status_code=302, headers={"Cache-Control": "no-store"})
        return respond(
            PlaybackLink(url=url, expires_at=expires.isoformat().replace("+00:00", "Z")),
            headers={"Cache-Control": "no-store"},
        )

    return issue


def _media_endpoint(
    db: Database, store: ObjectStore, config: PlaybackConfig, clock: Callable[[], float]
) -> Callable[[Request], Awaitable[Response]]:
    """``GET|HEAD /v1/media/{asset_id}``: the asset's bytes for a valid signature, ranges too."""

    async def media(request: Request) -> Response:
        raw_id = request.path_params["asset_id"]
        params = request.query_params
        if not verify_playback(
            raw_id, params.get("exp"), params.get("sig"), config.secret, clock()
        ):
            raise _forbidden()
        asset_id = _parse_uuid(raw_id)
        async with db.connection() as conn:
            row = await conn.fetchrow(q("asset_storage"), asset_id)
        if row is None:
            raise _not_found()
        info = await store.stat(row["storage_key"])
        if info is None:
            raise _not_found()
        remaining = max(int(params["exp"]) - int(clock()), 0)
        headers = {
            "Accept-Ranges": "bytes",
            "Cache-Control": f"private, max-age={remaining}",
        }
        span = _byte_range(request.headers.get("range"), info.size)
        start, end = span if span is not None else (0, info.size - 1)
        length = end - start + 1 if info.size else 0
        headers["Content-Length"] = str(length)
        if span is not None:
            headers["Content-Range"] = f"bytes {start}-{end}/{info.size}"
        body = _stream(store, row["storage_key"], start, length, config.chunk_size)
        return StreamingResponse(
            body,
            status_code=206 if span is not None else 200,
            media_type=row["content_type"],
            headers=headers,
        )

    return media


async def _stream(
    store: ObjectStore, key: str, offset: int, length: int, chunk_size: int
) -> AsyncIterator[bytes]:
    if length <= 0:
        return
    try:
        async for chunk in store.read(key, offset=offset, length=length, chunk_size=chunk_size):
            yield chunk
    except ObjectNotFound:  # deleted after the stat: the response is cut short
        return
