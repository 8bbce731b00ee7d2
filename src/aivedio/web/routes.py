"""The web UI routes for the ``api`` role: ``/`` (the console) and ``/static/<file>``.

Only the files listed in ``FILES`` are served (no path from the request ever reaches the file
system); they are read from the package once, when the routes are built. Every answer carries
``Cache-Control: no-cache`` (the browser revalidates with the ETag, so a new release is picked up
at once) and ``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

__all__ = ["FILES", "web_routes"]

# file name -> content type
FILES: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "aivedio-client.js": "text/javascript; charset=utf-8",
    "console-view.js": "text/javascript; charset=utf-8",
    "console-detail.js": "text/javascript; charset=utf-8",
    "console-panels.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}

# The page loads only its own scripts and styles and talks only to its own origin.
_PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; media-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'"
)


@dataclass(frozen=True, slots=True)
class _Asset:
    body: bytes
    content_type: str
    etag: str


def _load(name: str, *, sandbox: bool = False) -> _Asset:
    body = resources.files("aivedio.web").joinpath(name).read_bytes()
    if name == "index.html" and sandbox:
        # The console probes the sandbox's chaos knobs only where they exist: a probe answered
        # 404 would be an error in the browser's console on every other deployment.
        body = body.replace(b"<body>", b'<body data-sandbox="on">', 1)
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    return _Asset(body, FILES[name], etag)


def _respond(request: Request, asset: _Asset, extra: dict[str, str] | None = None) -> Response:
    headers = {
        "Cache-Control": "no-cache",
        "ETag": asset.etag,
        "X-Content-Type-Options": "nosniff",
        **(extra or {}),
    }
    if asset.etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.content_type, headers=headers)


def web_routes(*, sandbox: bool = False) -> list[BaseRoute]:
    """``GET /`` -> the page; ``GET /static/{name}`` -> one of ``FILES`` (404 otherwise).
    ``sandbox``: the sandbox provider is enabled (the page then shows the chaos panel)."""
    assets = {name: _load(name, sandbox=sandbox) for name in FILES}
    page = assets["index.html"]

    async def index(request: Request) -> Response:
        return _respond(
            request,
            page,
            {"Content-Security-Policy": _PAGE_CSP, "Referrer-Policy": "no-referrer"},
        )

    async def static(request: Request) -> Response:
        asset = assets.get(request.path_params["name"])
        if asset is None or asset is page:
            return Response(
                b'{"error":{"code":"not_found","message":"no such file"}}',
                status_code=404,
                media_type="application/json",
                headers={"Cache-Control": "no-cache"},
            )
        return _respond(request, asset)

    return [
        Route("/", index, methods=["GET", "HEAD"]),
        Route("/static/{name}", static, methods=["GET", "HEAD"]),
    ]
