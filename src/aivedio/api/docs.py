"""``GET /openapi.json`` (the OpenAPI document) and ``GET /docs`` (a page that renders it).

The page is three small files of this package (``api/reference/``), served from here: nothing
from a CDN, no build step. It reads ``/openapi.json`` and lists every operation with its
parameters, body, answers and credentials, then every schema.
"""

from __future__ import annotations

import hashlib
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from aivedio.api.http import ApiError
from aivedio.api.openapi import document_text

__all__ = ["ASSETS", "docs_routes"]

# file name -> content type
ASSETS: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "reference.js": "text/javascript; charset=utf-8",
    "reference.css": "text/css; charset=utf-8",
}
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)


def _file(name: str) -> bytes:
    return resources.files("aivedio.api").joinpath("reference", name).read_bytes()


def _answer(
    request: Request, body: bytes, content_type: str, extra: dict[str, str] | None = None
) -> Response:
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    headers = {"Cache-Control": "no-cache", "ETag": etag, "X-Content-Type-Options": "nosniff"}
    headers |= extra or {}
    if etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(body, media_type=content_type, headers=headers)


def docs_routes() -> list[BaseRoute]:
    document = document_text().encode()
    files = {name: _file(name) for name in ASSETS}

    async def openapi(request: Request) -> Response:
        return _answer(request, document, "application/json")

    async def page(request: Request) -> Response:
        csp = {"Content-Security-Policy": _CSP, "Referrer-Policy": "no-referrer"}
        return _answer(request, files["index.html"], ASSETS["index.html"], csp)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in files or name == "index.html":
            raise ApiError(404, "not_found", "no such file")
        return _answer(request, files[name], ASSETS[name])

    return [
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/docs", page, methods=["GET"]),
        Route("/docs/{name}", asset, methods=["GET"]),
    ]
