"""Browser sessions end to end: the cookie (flags, hash-only storage, expiry), the REST calls and
stream tokens it authorizes (CSRF refusal, project scope, foreign tenant), the SSE and WebSocket
streams it opens, and revocation (of the session or of its API key) closing them within 5 s."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Origin

from aivedio.api.app import create_app
from aivedio.api.sessions import CSRF_HEADER, SESSION_COOKIE, session_routes
from aivedio.client import Frame, parse_sse
from aivedio.config import ApiConfig
from aivedio.db.pool import Database
from aivedio.gateway import Gateway, stream_token_routes
from aivedio.gateway.auth import connection_lifetime
from aivedio.gateway.protocol import origin_allowed, parse_head
from aivedio.gateway.session import Identity
from aivedio.state.service import StateService
from tests.integration.helpers import Project, make_project, make_task, store
from tests.integration.test_gateway_harness import (
    SECRET,
    Publisher,
    gateway_config,
    serve_gateway,
)
from tests.waiting import eventually

CSRF = {CSRF_HEADER: "1"}
WITHIN_S = 5.0  # revocation closes a connection within this (the contract), plus slack below


@dataclass
class SessionEnv:
    db: Database
    project: Project
    base_url: str
    http: httpx.AsyncClient
    state: StateService
    gateway: Gateway

    def tasks_url(self, project_id: uuid.UUID | None = None) -> str:
        return f"/v1/projects/{project_id or self.project.project_id}/tasks"

    async def new_session(self, project_id: uuid.UUID | None = None) -> str:
        """``POST /v1/sessions`` with the key; the cookie's secret."""
        response = await self.http.post(
            "/v1/sessions",
            headers={"Authorization": f"Bearer {self.project.api_key}"},
            json={"project_id": str(project_id)} if project_id else None,
        )
        assert response.status_code == 201, response.text
        secret = response.cookies.get(SESSION_COOKIE)
        assert secret
        return str(secret)

    async def new_task(self) -> None:
        await make_task(store(self.db, self.state), self.project)

    async def joined(self, n: int) -> None:
        """Wait until ``n`` connections are in the gateway's hub (they see what comes next)."""
        await eventually(lambda: self.gateway.connections >= n, f"{n} connections joined", 10)


SessionEnvFactory = Callable[..., Awaitable[SessionEnv]]


@pytest.fixture
async def make_session_env(db: Database, redis_url: str) -> AsyncIterator[SessionEnvFactory]:
    """A real server (API with the session routes + the gateway on one port), real PostgreSQL
    and Redis, and the stand-in dispatcher of the gateway tests."""
    started: list[tuple[asyncio.Event, asyncio.Task[None], asyncio.Task[None], Redis]] = []
    clients: list[httpx.AsyncClient] = []

    async def factory(
        session_ttl_s: int = 3600, public_url: str = "http://127.0.0.1", **overrides: Any
    ) -> SessionEnv:
        tag = uuid.uuid4().hex[:12]
        config = gateway_config(redis_url, tag, **overrides)
        state = StateService(db)
        project = await make_project(db, tenant=f"t-{tag}", project="web")
        routes = [
            *stream_token_routes(db, SECRET),
            *session_routes(db, public_url, session_ttl_s),
        ]
        app = create_app(db, store(db, state), ApiConfig(), extra_routes=routes)
        gateway = Gateway(db, config)
        port, stopping, server = await serve_gateway(app, gateway)
        base = f"http://127.0.0.1:{port}"
        redis = Redis.from_url(redis_url)
        publisher = Publisher(db, redis, config.channel, project.project_id)
        started.append((stopping, server, asyncio.create_task(publisher.run()), redis))
        # no cookie jar: each request says which cookie it sends
        no_jar = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
        http = httpx.AsyncClient(base_url=base, timeout=15, cookies=no_jar)
        clients.append(http)
        return SessionEnv(db, project, base, http, state, gateway)

    yield factory
    for client in clients:
        await client.aclose()
    for stopping, server, pub_task, redis in started:
        pub_task.cancel()
        stopping.set()
        await asyncio.wait_for(server, 20)
        await redis.aclose()


def cookie(secret: str) -> dict[str, str]:
    return {"Cookie": f"{SESSION_COOKIE}={secret}"}


async def sse_frames(
    env: SessionEnv, headers: dict[str, str], until: Callable[[list[Frame]], bool], timeout: float
) -> tuple[int, list[Frame]]:
    """Open the SSE stream with ``headers``; frames until ``until`` holds or the stream ends."""
    got: list[Frame] = []
    url = f"/v1/projects/{env.project.project_id}/events"
    async with httpx.AsyncClient(base_url=env.base_url, timeout=None) as http:  # noqa: SIM117
        async with http.stream("GET", url, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                return response.status_code, [Frame("error", None, response.json())]

            async def read() -> None:
                async for frame in parse_sse(response.aiter_lines()):
                    got.append(frame)
                    if until(got):
                        return

            await asyncio.wait_for(read(), timeout)
            return 200, got


async def sse_status(env: SessionEnv, headers: dict[str, str]) -> int:
    """The status the SSE request is answered with (the stream is closed at once)."""
    url = f"/v1/projects/{env.project.project_id}/events"
    async with env.http.stream("GET", url, headers=headers) as response:
        return response.status_code


async def open_ws(env: SessionEnv, headers: dict[str, str], origin: str | None) -> ClientConnection:
    url = f"{env.base_url.replace('http://', 'ws://')}/v1/projects/{env.project.project_id}/ws"
    return await connect(
        url,
        additional_headers=headers,
        origin=Origin(origin) if origin else None,
        compression=None,
        proxy=None,
    )


async def ws_close(ws: ClientConnection, timeout: float) -> tuple[int, str]:
    """Read until the server closes; its close code and reason."""
    received = None
    try:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except ConnectionClosed as closed:
        received = closed.rcvd
    assert received is not None
    return received.code, received.reason


# -- the cookie ------------------------------------------------------------------------------


async def test_a_key_is_exchanged_for_an_httponly_strict_cookie(
    make_session_env: SessionEnvFactory,
) -> None:
    env = await make_session_env(session_ttl_s=600)
    response = await env.http.post(
        "/v1/sessions",
        headers={"Authorization": f"Bearer {env.project.api_key}"},
        json={"project_id": str(env.project.project_id)},
    )
    assert response.status_code == 201
    assert response.headers["cache-control"] == "no-store"
    set_cookie = response.headers["set-cookie"]
    attributes = [part.strip() for part in set_cookie.split(";")]
    name, _, secret = attributes[0].partition("=")
    assert name == SESSION_COOKIE and len(secret) > 40
    assert {"HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=600"} <= set(attributes)
    assert "Secure" not in attributes  # the public URL is http
    session = response.json()["session"]
    assert session["project_id"] == str(env.project.project_id)
    assert secret not in response.text  # the secret is in the cookie only
    async with env.db.connection() as conn:
        row = await conn.fetchrow(
            "SELECT * FROM browser_sessions WHERE id = $1", uuid.UUID(session["id"])
        )
    assert row is not None
    assert row["secret_hash"] == hashlib.sha256(secret.encode()).digest()
    assert secret.encode() not in b"".join(str(v).encode() for v in row.values())
    assert row["tenant_id"] == env.project.tenant_id
    assert 590 <= (row["expires_at"] - row["created_at"]).total_seconds() <= 600
    # GET /v1/sessions/current describes it (and never shows the secret)
    current = await env.http.get("/v1/sessions/current", headers=cookie(secret))
    assert current.status_code == 200
    assert current.json()["session"]["id"] == session["id"]


async def test_the_cookie_is_secure_behind_an_https_public_url(
    make_session_env: SessionEnvFactory,
) -> None:
    env = await make_session_env(public_url="https://app.example")
    response = await env.http.post(
        "/v1/sessions", headers={"Authorization": f"Bearer {env.project.api_key}"}
    )
    assert response.status_code == 201
    assert "Secure" in [p.strip() for p in response.headers["set-cookie"].split(";")]
    assert response.json()["session"]["project_id"] is None  # no body: every project


async def test_only_a_valid_key_creates_a_session(make_session_env: SessionEnvFactory) -> None:
    env = await make_session_env()
    secret = await env.new_session()
    for headers in ({}, {"Authorization": "Bearer av_not-a-key"}, cookie(secret)):
        response = await env.http.post("/v1/sessions", headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "unauthorized"
    other = await make_project(env.db, tenant=f"other-{uuid.uuid4().hex[:6]}")
    response = await env.http.post(
        "/v1/sessions",
        headers={"Authorization": f"Bearer {env.project.api_key}"},
        json={"project_id": str(other.project_id)},
    )
    assert response.status_code == 404  # a project of another tenant


async def test_a_bad_session_body_is_a_field_error(make_session_env: SessionEnvFactory) -> None:
    env = await make_session_env()
    key = {"Authorization": f"Bearer {env.project.api_key}"}
    body_error = {"field": "body", "message": 'an object {"project_id"?: UUID}'}
    for body, fields in [
        ({"project_id": "not-a-uuid"}, [{"field": "project_id", "message": "a UUID"}]),
        ({"project_id": 7}, [{"field": "project_id", "message": "a UUID"}]),
        ([], [body_error]),
        ({"project_id": None, "extra": 1}, [body_error]),
    ]:
        response = await env.http.post("/v1/sessions", headers=key, json=body)
        assert response.status_code == 422, body
        assert response.json()["error"]["code"] == "validation_failed"
        assert response.json()["error"]["fields"] == fields, body
    for body in ({}, {"project_id": None}):
        made = await env.http.post("/v1/sessions", headers=key, json=body)
        assert made.status_code == 201 and made.json()["session"]["project_id"] is None


# -- REST with the cookie --------------------------------------------------------------------


async def test_the_cookie_authorizes_rest_with_csrf_protection(
    make_session_env: SessionEnvFactory,
) -> None:
    env = await make_session_env()
    secret = await env.new_session(env.project.project_id)
    listed = await env.http.get(env.tasks_url(), headers=cookie(secret))
    assert listed.status_code == 200  # a safe method: no CSRF header needed
    body = {"provider": "sandbox", "model": "m", "prompt": "a cat", "params": {}}
    refused = [
        cookie(secret),  # no CSRF header (what a cross-site form post looks like)
        cookie(secret) | CSRF | {"Sec-Fetch-Site": "cross-site"},
        cookie(secret) | CSRF | {"Sec-Fetch-Site": "same-site"},
    ]
    for headers in refused:
        response = await env.http.post(
            env.tasks_url(), headers=headers | {"Idempotency-Key": "k1"}, json=body
        )
        assert response.status_code == 403, headers
        assert response.json()["error"]["code"] == "csrf_refused"
    async with env.db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM generation_tasks") == 0
    created = await env.http.post(
        env.tasks_url(),
        headers=cookie(secret) | CSRF | {"Sec-Fetch-Site": "same-origin", "Idempotency-Key": "k1"},
        json=body,
    )
    assert created.status_code == 202, created.text
    task_id = created.json()["task"]["id"]
    got = await env.http.get(f"{env.tasks_url()}/{task_id}", headers=cookie(secret))
    assert got.status_code == 200
    # the API key still wins over the cookie, and needs no CSRF header
    keyed = await env.http.post(
        env.tasks_url(),
        headers={"Authorization": f"Bearer {env.project.api_key}", "Idempotency-Key": "k2"},
        json=body,
    )
    assert keyed.status_code == 202
    for headers in ({"Cookie": f"{SESSION_COOKIE}=as_forged"}, {}):
        response = await env.http.get(env.tasks_url(), headers=headers)
        assert response.status_code == 401


async def test_a_session_is_bound_to_its_project_and_tenant(
    make_session_env: SessionEnvFactory,
) -> None:
    env = await make_session_env()
    async with env.db.connection() as conn:
        tenant = await conn.fetchval(
            "SELECT name FROM tenants WHERE id = $1", env.project.tenant_id
        )
    sibling = await make_project(env.db, tenant=tenant, project="other")  # the same tenant
    assert sibling.tenant_id == env.project.tenant_id
    scoped = await env.new_session(env.project.project_id)
    stranger = await make_project(env.db, tenant=f"stranger-{uuid.uuid4().hex[:6]}")
    unscoped = await env.new_session()
    assert (
        await env.http.get(env.tasks_url(sibling.project_id), headers=cookie(unscoped))
    ).status_code == 200
    foreign = [
        (scoped, sibling.project_id),
        (scoped, stranger.project_id),
        (unscoped, stranger.project_id),
    ]
    for secret, project_id in foreign:
        response = await env.http.get(env.tasks_url(project_id), headers=cookie(secret))
        assert response.status_code == 404, project_id
        token = await env.http.post(
            "/v1/stream-tokens", headers=cookie(secret) | CSRF, json={"project_id": str(project_id)}
        )
        assert token.status_code == 404
        url = f"/v1/projects/{project_id}/events"
        async with env.http.stream("GET", url, headers=cookie(secret)) as stream:
            assert stream.status_code == 404  # as on REST: it does not confirm the project
            await stream.aread()
            assert stream.json()["error"]["code"] == "not_found"


# -- streams with the cookie -----------------------------------------------------------------


async def test_the_cookie_opens_sse_and_websocket(make_session_env: SessionEnvFactory) -> None:
    env = await make_session_env()
    secret = await env.new_session(env.project.project_id)
    reader = asyncio.ensure_future(
        sse_frames(env, cookie(secret), lambda fs: any(f.event == "task.status" for f in fs), 15)
    )
    ws = await open_ws(env, cookie(secret), origin=env.base_url)
    assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "start"
    await env.joined(2)  # the SSE reader and the WebSocket
    await env.new_task()
    status, frames = await reader
    assert status == 200 and frames[-1].data["status"] == "queued"
    message = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert message["type"] == "task.status" and message["event_id"] == 1
    await ws.close()


async def test_a_websocket_with_the_cookie_needs_an_allowed_origin(
    make_session_env: SessionEnvFactory,
) -> None:
    env = await make_session_env()
    secret = await env.new_session()
    for origin in (None, "http://evil.example"):
        with pytest.raises(InvalidStatus) as info:
            await open_ws(env, cookie(secret), origin=origin)
        assert info.value.response.status_code == 403
        assert json.loads(info.value.response.body)["error"]["code"] == "origin_not_allowed"


async def test_a_stream_token_is_minted_with_the_cookie(
    make_session_env: SessionEnvFactory,
) -> None:
    env = await make_session_env()
    secret = await env.new_session(env.project.project_id)
    body = {"project_id": str(env.project.project_id)}
    refused = await env.http.post("/v1/stream-tokens", headers=cookie(secret), json=body)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "csrf_refused"
    minted = await env.http.post("/v1/stream-tokens", headers=cookie(secret) | CSRF, json=body)
    assert minted.status_code == 200, minted.text
    token = minted.json()["token"]
    assert minted.headers["cache-control"] == "no-store"
    # the token opens the stream; revoking the session that minted it closes that stream
    url_headers: dict[str, str] = {}
    reader = asyncio.ensure_future(
        sse_frames_token(env, token, url_headers, lambda fs: any(f.event == "close" for f in fs))
    )
    await env.joined(1)  # the token's stream is open
    revoked = await env.http.delete("/v1/sessions/current", headers=cookie(secret) | CSRF)
    assert revoked.status_code == 204
    status, frames = await reader
    assert status == 200
    assert frames[-1].data == {"code": 3503, "reason": "credential_revoked", "reconnect": False}


async def sse_frames_token(
    env: SessionEnv,
    token: str,
    headers: dict[str, str],
    until: Callable[[list[Frame]], bool],
) -> tuple[int, list[Frame]]:
    got: list[Frame] = []
    url = f"/v1/projects/{env.project.project_id}/events"
    async with httpx.AsyncClient(base_url=env.base_url, timeout=None) as http:  # noqa: SIM117
        async with http.stream("GET", url, params={"token": token}, headers=headers) as response:
            assert response.status_code == 200

            async def read() -> None:
                async for frame in parse_sse(response.aiter_lines()):
                    got.append(frame)
                    if until(got):
                        return

            await asyncio.wait_for(read(), 15)
            return 200, got


# -- revocation and expiry -------------------------------------------------------------------


async def test_deleting_the_session_closes_its_sse_and_websocket_within_5_s(
    make_session_env: SessionEnvFactory,
) -> None:
    env = await make_session_env()
    secret = await env.new_session(env.project.project_id)
    sse = asyncio.ensure_future(
        sse_frames(env, cookie(secret), lambda fs: any(f.event == "close" for f in fs), 30)
    )
    ws = await open_ws(env, cookie(secret), origin=env.base_url)
    assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "start"
    await env.joined(2)  # the SSE reader and the WebSocket
    # a foreign page's logout attempt (no CSRF header) is refused and changes nothing
    assert (
        await env.http.delete("/v1/sessions/current", headers=cookie(secret))
    ).status_code == 403
    response = await env.http.delete("/v1/sessions/current", headers=cookie(secret) | CSRF)
    assert response.status_code == 204
    cleared = [p.strip() for p in response.headers["set-cookie"].split(";")]
    assert cleared[0] == f"{SESSION_COOKIE}=" and "Max-Age=0" in cleared
    code, reason = await ws_close(ws, WITHIN_S + 5)
    status, frames = await sse
    assert (code, reason) == (4503, "credential_revoked")
    assert status == 200
    assert frames[-1].data == {"code": 3503, "reason": "credential_revoked", "reconnect": False}
    # the cookie opens nothing any more
    assert (await env.http.get(env.tasks_url(), headers=cookie(secret))).status_code == 401
    assert await sse_status(env, cookie(secret)) == 401
    # deleting again is harmless
    again = await env.http.delete("/v1/sessions/current", headers=cookie(secret) | CSRF)
    assert again.status_code == 204


async def test_revoking_the_key_revokes_its_sessions_and_closes_their_streams(
    make_session_env: SessionEnvFactory,
) -> None:
    env = await make_session_env()
    secret = await env.new_session()
    sse = asyncio.ensure_future(
        sse_frames(env, cookie(secret), lambda fs: any(f.event == "close" for f in fs), 30)
    )
    ws = await open_ws(env, cookie(secret), origin=env.base_url)
    assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "start"
    await env.joined(2)  # the SSE reader and the WebSocket
    async with env.db.connection() as conn:
        await conn.execute(
            "UPDATE api_keys SET revoked_at = now() WHERE tenant_id = $1", env.project.tenant_id
        )
    assert await ws_close(ws, WITHIN_S + 5) == (4503, "credential_revoked")
    status, frames = await sse
    assert status == 200 and frames[-1].data["reason"] == "credential_revoked"
    assert (await env.http.get(env.tasks_url(), headers=cookie(secret))).status_code == 401
    assert (await env.http.get("/v1/sessions/current", headers=cookie(secret))).status_code == 401


async def test_an_expired_session_ends_its_stream_and_opens_nothing(
    make_session_env: SessionEnvFactory,
) -> None:
    env = await make_session_env(session_ttl_s=3)
    secret = await env.new_session()
    status, frames = await sse_frames(
        env, cookie(secret), lambda fs: any(f.event == "close" for f in fs), 20
    )
    assert status == 200
    # capped at the session's expiry (80-100 % of what was left), a reconnectable close
    assert frames[-1].data == {"code": 3002, "reason": "session_expired", "reconnect": True}

    async def refused() -> bool:  # once the session's 3 s have passed
        return (await env.http.get(env.tasks_url(), headers=cookie(secret))).status_code == 401

    await eventually(refused, "the expired session to be refused", interval=0.1)
    assert await sse_status(env, cookie(secret)) == 401


def test_a_connection_lives_80_to_100_percent_of_its_credential_s_time_left() -> None:
    ids = (uuid.uuid4(), uuid.uuid4(), uuid.uuid4())
    now = 1_000_000.0
    with_session = Identity(*ids, session_id=uuid.uuid4(), expires_at=now + 100)
    for _ in range(200):
        assert 80 <= connection_lifetime(with_session, 1800, now) <= 100
        assert 1440 <= connection_lifetime(Identity(*ids), 1800, now) <= 1800  # an API key
        assert 72 <= connection_lifetime(with_session, 90, now) <= 90  # the cap is sooner
    assert connection_lifetime(with_session, 1800, now + 200) == 0
    assert with_session.credential_id == with_session.session_id
    assert Identity(*ids).credential_id == ids[2]


async def test_which_credential_decides_when_a_request_carries_several(
    make_session_env: SessionEnvFactory,
) -> None:
    """A stream token first, then the API key, then the cookie (a stale cookie beside a valid
    key is harmless; a token for another project is refused even beside a valid cookie)."""
    env = await make_session_env()
    forged = cookie("as_forged")
    keyed = {"Authorization": f"Bearer {env.project.api_key}"}
    assert (await env.http.get(env.tasks_url(), headers=forged | keyed)).status_code == 200
    assert await sse_status(env, forged | keyed) == 200
    secret = await env.new_session(env.project.project_id)
    other = await make_project(env.db, tenant=f"other-{uuid.uuid4().hex[:6]}")
    token = await env.http.post(
        "/v1/stream-tokens",
        headers={"Authorization": f"Bearer {other.api_key}"},
        json={"project_id": str(other.project_id)},
    )
    url = f"/v1/projects/{env.project.project_id}/events"
    async with env.http.stream(
        "GET", url, params={"token": token.json()["token"]}, headers=cookie(secret)
    ) as stream:
        assert stream.status_code == 404
        await stream.aread()


def test_the_stream_request_carries_the_session_cookie_and_needs_an_origin() -> None:
    project = uuid.uuid4()
    head = (
        f"GET /v1/projects/{project}/events HTTP/1.1\r\nHost: gw.example:8000\r\n"
        f"Cookie: theme=dark; {SESSION_COOKIE}=as_secret\r\n\r\n"
    ).encode()
    req = parse_head(head)
    assert req.session == "as_secret" and req.token is None and req.bearer is None
    same = replace(req, origin="http://gw.example:8000")
    assert origin_allowed(same, ())
    assert not origin_allowed(req, ())  # a cookie without Origin: never (not a browser's)
    assert not origin_allowed(replace(req, origin="http://evil.example"), ())
    assert origin_allowed(replace(req, origin="http://app.example"), ("http://app.example",))
