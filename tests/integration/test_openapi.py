"""The OpenAPI document: committed as generated, valid OpenAPI 3.1, one operation for every
route the HTTP roles mount (and none that nobody mounts), served with its page."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from openapi_spec_validator import validate
from starlette.applications import Starlette
from starlette.routing import Route

from aivedio.api.app import create_app
from aivedio.api.docs import ASSETS
from aivedio.api.models import ErrorResponse, PublicStatus
from aivedio.api.openapi import STREAM_EXTENSION, document_text, openapi_document
from aivedio.config import Settings
from aivedio.domain.statuses import PUBLIC_STATUSES
from aivedio.roles import AVAILABLE, RoleParts
from aivedio.runtime import Runtime
from aivedio.services.embedded import ServiceUrls

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "reference" / "openapi.json"
HTTP_ROLES = ("api", "callbacks", "gateway")


def test_the_committed_document_is_the_generated_one() -> None:
    assert COMMITTED.read_text(encoding="utf-8") == document_text(), (
        "docs/reference/openapi.json is stale: run scripts/openapi"
    )


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = openapi_document()
    assert doc["openapi"].startswith("3.1")
    validate(json.loads(document_text()))


def test_every_operation_names_its_answers_and_credentials() -> None:
    ids = []
    for path, item in openapi_document()["paths"].items():
        for method, op in item.items():
            ids.append(op["operationId"])
            assert op["summary"] and op["responses"], (method, path)
            assert "security" in op, (method, path)  # [] says "none" out loud
            for status, reply in op["responses"].items():
                # every error is the one error shape (/readyz's 503 names what is down)
                if int(status) >= 400 and op["operationId"] != "Readiness":
                    schema = reply["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (path, status)
            if "{project_id}" in path and op["security"]:
                assert "404" in op["responses"], (method, path)
    assert len(ids) == len(set(ids))


def test_the_public_statuses_are_the_status_tables() -> None:
    assert set(get_args(PublicStatus)) == PUBLIC_STATUSES


@pytest.fixture
async def role_app(
    database_url: str, redis_url: str, nats_url: str, tmp_path: Path
) -> AsyncIterator[tuple[Starlette, list[RoleParts]]]:
    """The app ``aivedio run --role api --role callbacks --role gateway`` serves."""
    settings = Settings(
        database_url=database_url, redis_url=redis_url, nats_url=nats_url, data_dir=tmp_path
    )
    rt = await Runtime.open(settings, ServiceUrls(database_url, redis_url, nats_url))
    parts = [await AVAILABLE[name](rt) for name in HTTP_ROLES]
    app = create_app(
        rt.db, rt.tasks, settings.api, extra_routes=[r for p in parts for r in p.routes]
    )
    try:
        yield app, parts
    finally:
        for part in parts:
            for hook in part.on_stop:
                await hook()
        for part in parts:
            if part.gateway is not None:
                await part.gateway.close()
        await rt.close()


def _mounted(app: Starlette) -> set[tuple[str, str]]:
    found = set()
    for route in app.routes:
        assert isinstance(route, Route)
        methods = route.methods or {"POST"}  # the callback endpoint answers 405 to the others
        found |= {(m.lower(), route.path) for m in methods if m != "HEAD"}
    return found


async def test_every_mounted_route_is_documented_and_nothing_else(
    role_app: tuple[Starlette, list[RoleParts]],
) -> None:
    app, parts = role_app
    assert any(p.gateway is not None for p in parts)  # the streams are served on the port too
    documented: dict[tuple[str, str], dict[str, Any]] = {
        (method, path): op
        for path, item in openapi_document()["paths"].items()
        for method, op in item.items()
    }
    streams = {key for key, op in documented.items() if op.get(STREAM_EXTENSION)}
    assert streams == {
        ("get", "/v1/projects/{project_id}/events"),
        ("get", "/v1/projects/{project_id}/ws"),
    }
    assert _mounted(app) == set(documented) - streams


@pytest.fixture
async def client(role_app: tuple[Starlette, list[RoleParts]]) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=role_app[0])
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


async def test_the_document_and_its_page_are_served_from_here(client: httpx.AsyncClient) -> None:
    served = await client.get("/openapi.json")
    assert served.status_code == 200 and served.text == document_text()
    page = await client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp  # nothing from a CDN
    assert "http" not in page.text.replace('href="/openapi.json"', "")
    for name in ASSETS:
        if name != "index.html":
            asset = await client.get(f"/docs/{name}")
            assert asset.status_code == 200, name
            assert asset.headers["content-type"] == ASSETS[name]
            assert "http://" not in asset.text and "https://" not in asset.text
            again = await client.get(
                f"/docs/{name}", headers={"If-None-Match": asset.headers["etag"]}
            )
            assert again.status_code == 304
    missing = await client.get("/docs/index.html")
    assert missing.status_code == 404
    assert ErrorResponse.model_validate_json(missing.content).error.code == "not_found"


async def test_starlettes_own_answers_have_the_error_shape(client: httpx.AsyncClient) -> None:
    nowhere = await client.get("/v1/nowhere")
    assert nowhere.status_code == 404
    assert ErrorResponse.model_validate_json(nowhere.content).error.code == "not_found"
    wrong = await client.put("/healthz")
    assert wrong.status_code == 405 and "GET" in wrong.headers["allow"]
    assert ErrorResponse.model_validate_json(wrong.content).error.code == "method_not_allowed"
