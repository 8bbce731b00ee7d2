"""The OpenAPI 3.1 document, generated from the route table (``api.contract``) and the models
(``api.models``, through pydantic's JSON Schema, which OpenAPI 3.1 takes as it is).

Served at ``GET /openapi.json`` (``api.docs``) and committed as ``docs/reference/openapi.json``;
a test keeps the two equal. Regenerate the committed one with ``scripts/openapi`` (which runs
``python -m aivedio.api.openapi docs/reference/openapi.json``).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from aivedio import __version__
from aivedio.api import models as m
from aivedio.api.contract import OPERATIONS, SECURITY_SCHEMES, Operation, Reply

__all__ = ["STREAM_EXTENSION", "document_text", "main", "openapi_document"]

STREAM_EXTENSION = "x-aivedio-stream"  # on the SSE and WebSocket operations: they never end
REF = "#/components/schemas/{model}"
# Documented beside the operations: what the streams write (not a body of any operation).
FRAMES: tuple[type[BaseModel], ...] = (m.EventPayload, m.ResetFrame, m.CloseFrame)

INFO = {
    "title": "aivedio HTTP API",
    "version": __version__,
    "summary": "The status of long-running AI video tasks, from providers to browsers",
    "description": "Tasks (create with an Idempotency-Key, snapshot with a stream cursor, list, "
    "cancel, retry, audit), browser sessions, stream tokens, playback links, the SSE and "
    "WebSocket event streams, provider webhooks, health and metrics. Errors are "
    '`{"error": {"code", "message", ...}}` with a stable `code`; every answer carries '
    "`X-Trace-Id`. Reference: docs/reference/api.md, docs/reference/events.md.",
    "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
}
TAGS = [
    {"name": "tasks", "description": "Video generation tasks"},
    {"name": "sessions", "description": "Browser sessions: an API key exchanged for a cookie"},
    {"name": "streams", "description": "Event streams and the tokens for their URLs"},
    {"name": "media", "description": "Playback of finished videos"},
    {"name": "callbacks", "description": "Provider webhooks"},
    {"name": "operations", "description": "Health, readiness, metrics"},
    {"name": "documents", "description": "This document and its page"},
    {"name": "web", "description": "The web console served by the API"},
    {"name": "sandbox", "description": "The sandbox provider's chaos (only where it is enabled)"},
]

Mode = Literal["validation", "serialization"]
Refs = dict[tuple[Any, Mode], dict[str, Any]]  # (model, mode) -> its {"$ref": ...}


def _models() -> list[tuple[type[BaseModel], Mode]]:
    """Every model the document names: bodies as validated, answers as serialised."""
    seen: dict[tuple[type[BaseModel], Mode], None] = {}
    for op in OPERATIONS:
        if op.body is not None and op.body.model is not None:
            seen[(op.body.model, "validation")] = None
        for reply in op.replies.values():
            if reply.model is not None:
                seen[(reply.model, "serialization")] = None
    for frame in FRAMES:
        seen[(frame, "serialization")] = None
    return list(seen)


def _content(content_type: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {content_type: {"schema": schema}}


def _reply(reply: Reply, refs: Refs) -> dict[str, Any]:
    out: dict[str, Any] = {"description": reply.description}
    if reply.headers:
        out["headers"] = {
            name: {"description": text, "schema": {"type": "string"}}
            for name, text in reply.headers
        }
    if reply.content_type is not None:
        schema = refs[(reply.model, "serialization")] if reply.model else reply.schema
        out["content"] = _content(reply.content_type, schema or {})
    if reply.links:
        out["links"] = reply.links
    return out


def _operation(op: Operation, refs: Refs) -> dict[str, Any]:
    out: dict[str, Any] = {
        "operationId": op.operation_id,
        "tags": [op.tag],
        "summary": op.summary,
    }
    if op.description:
        out["description"] = op.description
    if op.params:
        out["parameters"] = [
            {
                "name": p.name,
                "in": p.location,
                "required": p.required,
                **({"description": p.description} if p.description else {}),
                "schema": p.schema,
            }
            for p in op.params
        ]
    if op.body is not None:
        body = op.body
        schema = refs[(body.model, "validation")] if body.model else body.schema
        out["requestBody"] = {
            **({"description": body.description} if body.description else {}),
            "required": body.required,
            "content": _content(body.content_type, schema or {}),
        }
    out["responses"] = {str(code): _reply(r, refs) for code, r in sorted(op.replies.items())}
    out["security"] = [{scheme: [] for scheme in alt} for alt in op.security]
    if op.stream:
        out[STREAM_EXTENSION] = True
    return out


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document (built once per process; treat it as read-only)."""
    refs, defs = models_json_schema(_models(), ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs)
    return {
        "openapi": "3.1.0",
        "info": INFO,
        "tags": TAGS,
        "paths": paths,
        "components": {
            "schemas": dict(sorted(defs.get("$defs", {}).items())),
            "securitySchemes": SECURITY_SCHEMES,
        },
    }


@functools.cache
def document_text() -> str:
    """The document as committed: indented JSON, one trailing newline."""
    return json.dumps(openapi_document(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m aivedio.api.openapi [PATH]``: write the document to PATH, or print it."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        Path(args[0]).write_text(document_text(), encoding="utf-8")
    else:
        sys.stdout.write(document_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
