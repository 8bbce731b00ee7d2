"""404, not 403, for a project of another tenant, on every endpoint that names a project (in its
path or its body), the SSE and WebSocket streams included: answered exactly like a project that
does not exist, with an API key, a browser session and a stream token alike. The endpoints come
from the OpenAPI document, so a new one is checked without being listed here."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from aivedio.api.models import ErrorResponse
from aivedio.api.openapi import openapi_document
from tests.acceptance.api_server import ApiServer, Tenant, api_server, build_request

__all__ = ["api_server"]

CSRF = {"X-Aivedio-CSRF": "1"}
SAFE = {"get", "head", "options"}


def project_operations() -> list[tuple[str, str, dict[str, Any]]]:
    """Every operation that names a project: ``{project_id}`` in its path, or in its body."""
    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    found = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            ref = (
                op.get("requestBody", {})
                .get("content", {})
                .get("application/json", {})
                .get("schema", {})
                .get("$ref", "")
            )
            body = schemas.get(ref.rsplit("/", 1)[-1], {}) if ref else {}
            if "{project_id}" in path or "project_id" in body.get("properties", {}):
                found.append((method, path, op))
    return found


OPERATIONS = project_operations()
IDS = [op["operationId"] for _, _, op in OPERATIONS]


def _session(server: ApiServer, tenant: Tenant) -> str:
    made = httpx.post(server.url("/v1/sessions"), headers=tenant.auth)
    assert made.status_code == 201, made.text
    return made.cookies["aivedio_session"]


def _token(server: ApiServer, tenant: Tenant) -> str:
    made = httpx.post(
        server.url("/v1/stream-tokens"), json={"project_id": tenant.project_id}, headers=tenant.auth
    )
    assert made.status_code == 200, made.text
    return str(made.json()["token"])


def _send(request: httpx.Request) -> httpx.Response:
    with httpx.Client(timeout=10) as client:
        response = client.send(request, stream=True)  # a stream that opened would not end
        try:
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                return response  # opened: the status says enough
            response.read()
            return response
        finally:
            response.close()


def _refusal(response: httpx.Response) -> tuple[int, str]:
    assert response.headers["content-type"].startswith("application/json"), response.headers
    return response.status_code, ErrorResponse.model_validate_json(response.content).error.code


def credentials(server: ApiServer, method: str, op: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The other tenant's credentials this operation accepts, as request headers."""
    other = server.other
    schemes = {name for alternative in op["security"] for name in alternative}
    found: dict[str, dict[str, str]] = {}
    if "apiKey" in schemes:
        found["api key"] = other.auth
    if "session" in schemes:
        cookie = {"Cookie": f"aivedio_session={_session(server, other)}"}
        found["session"] = cookie if method in SAFE else cookie | CSRF
    return found


@pytest.mark.parametrize(("method", "path", "op"), OPERATIONS, ids=IDS)
def test_another_tenants_project_is_not_found(
    api_server: ApiServer, method: str, path: str, op: dict[str, Any]
) -> None:
    unknown = str(uuid.uuid4())
    for name, headers in credentials(api_server, method, op).items():
        foreign = _send(build_request(api_server, path, method, op, headers=headers))
        absent = _send(build_request(api_server, path, method, op, unknown, headers=headers))
        assert _refusal(foreign) == _refusal(absent) == (404, "not_found"), (name, foreign.text)


@pytest.mark.parametrize(
    "path", ["/v1/projects/{project_id}/events", "/v1/projects/{project_id}/ws"]
)
def test_another_tenants_stream_token_is_not_found(api_server: ApiServer, path: str) -> None:
    """A token minted for the other tenant's own project opens nothing of this project."""
    op = openapi_document()["paths"][path]["get"]
    token = _token(api_server, api_server.other)
    request = build_request(api_server, path, "get", op)
    request.url = request.url.copy_add_param("token", token)
    assert _refusal(_send(request)) == (404, "not_found")


def test_the_project_operations_are_all_checked() -> None:
    assert set(IDS) >= {
        "CreateTask",
        "ListTasks",
        "GetTask",
        "CancelTask",
        "RetryTask",
        "GetTaskAudit",
        "GetPlayback",
        "StreamEvents",
        "StreamEventsWebSocket",
        "CreateStreamToken",
        "CreateSession",
    }


def test_the_owner_is_served_where_the_other_tenant_is_not(api_server: ApiServer) -> None:
    """The control: the same requests with the owner's key reach the project."""
    owner = api_server.owner.auth
    doc = openapi_document()["paths"]
    for path, expected in [
        ("/v1/projects/{project_id}/tasks/{task_id}", 200),
        ("/v1/projects/{project_id}/assets/{asset_id}/playback", 200),
        ("/v1/projects/{project_id}/events", 200),
    ]:
        response = _send(build_request(api_server, path, "get", doc[path]["get"], headers=owner))
        assert response.status_code == expected, (path, response.text)


async def test_the_owner_opens_the_websocket(api_server: ApiServer) -> None:
    url = f"ws{api_server.base.removeprefix('http')}/v1/projects/{api_server.owner.project_id}/ws"
    async with connect(url, additional_headers=api_server.owner.auth, compression=None) as ws:
        assert "start" in str(await ws.recv())
