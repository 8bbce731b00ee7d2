"""Health, readiness, metrics, this document and its page, the web page."""

from __future__ import annotations

from aivedio.api import models as m
from aivedio.api.contract.base import (
    RETRY_AFTER,
    Operation,
    Param,
    Reply,
    error,
)

OPS_OPERATIONS = [
    Operation(
        "get",
        "/healthz",
        "Health",
        "operations",
        "The process is up",
        replies={200: Reply("up", m.Health)},
    ),
    Operation(
        "get",
        "/readyz",
        "Readiness",
        "operations",
        "The process can serve (PostgreSQL answers, its roles run)",
        replies={
            200: Reply("ready", m.Readiness),
            503: Reply(
                "PostgreSQL is away or a role loop of the process is down",
                m.NotReady,
                headers=(*RETRY_AFTER, ("Cache-Control", "`no-store`")),
            ),
        },
    ),
    Operation(
        "get",
        "/metrics",
        "Metrics",
        "operations",
        "Prometheus metrics",
        replies={200: Reply("the metrics", content_type="text/plain", schema={"type": "string"})},
    ),
    Operation(
        "get",
        "/openapi.json",
        "OpenApiDocument",
        "documents",
        "This document",
        replies={200: Reply("OpenAPI 3.1", schema={"type": "object"})},
    ),
    Operation(
        "get",
        "/docs",
        "ApiReferencePage",
        "documents",
        "This document as a page",
        replies={200: Reply("HTML", content_type="text/html", schema={"type": "string"})},
    ),
    Operation(
        "get",
        "/docs/{name}",
        "ApiReferenceAsset",
        "documents",
        "The page's script and styles (served locally)",
        params=(Param("name", "path", {"type": "string"}, required=True),),
        replies={
            200: Reply("the file", content_type="*/*", schema={}),
            404: error("`not_found`: no such file"),
        },
    ),
    Operation(
        "get",
        "/",
        "WebPage",
        "web",
        "The web console",
        replies={200: Reply("HTML", content_type="text/html", schema={"type": "string"})},
    ),
    Operation(
        "get",
        "/static/{name}",
        "WebAsset",
        "web",
        "The web console's scripts and styles",
        params=(Param("name", "path", {"type": "string"}, required=True),),
        replies={
            200: Reply("the file", content_type="*/*", schema={}),
            404: error("`not_found`: no such file"),
        },
    ),
]
