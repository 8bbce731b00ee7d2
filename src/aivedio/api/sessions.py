"""Browser sessions: an API key exchanged once for an HttpOnly, SameSite=Strict cookie.

``POST /v1/sessions`` (``Authorization: Bearer <api_key>``, body optional ``{"project_id"}``)
answers 201 and sets ``aivedio_session=<secret>``; ``GET /v1/sessions/current`` describes it;
``DELETE /v1/sessions/current`` revokes it and clears the cookie. Only the SHA-256 digest of the
secret is stored (``browser_sessions``). A session is valid while it is unexpired, unrevoked and
its API key is unrevoked, so revoking the key revokes its sessions.

The cookie authorizes the REST calls (``api/auth.py``), ``POST /v1/stream-tokens`` and the SSE and
WebSocket endpoints (``gateway/auth.py``). Because a browser sends a cookie by itself, every
cookie-authorized request with an unsafe method must carry the header ``X-Aivedio-CSRF`` (any
value), and when the browser says where it comes from (``Sec-Fetch-Site``) it must be
``same-origin``: a page of another origin cannot set a custom header without a CORS preflight,
which this API never grants, and SameSite=Strict keeps the cookie off cross-site requests in the
first place. The WebSocket has no custom headers: its Origin allow-list decides (``protocol.py``).
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from aivedio.admin import hash_api_key
from aivedio.api.http import ApiError, parse_body, read_json, respond
from aivedio.api.models import CreateSessionBody, Session, SessionResponse
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.state.tasks import Principal

SESSION_COOKIE = "aivedio_session"
CSRF_HEADER = "x-aivedio-csrf"
DEFAULT_TTL_S = 8 * 3600
MAX_CREDENTIAL_LEN = 200
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

UNAUTHORIZED = ApiError(
    401,
    "unauthorized",
    "a valid API key or browser session is required",
    headers={"WWW-Authenticate": 'Bearer realm="aivedio"'},
)
CSRF_REFUSED = ApiError(
    403,
    "csrf_refused",
    f"a request authorized by the session cookie must come from this origin and carry "
    f"the {CSRF_HEADER} header",
)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling, and with which credential: an API key, or a browser session (which
    carries the key that created it, its project scope and its expiry)."""

    tenant_id: uuid.UUID
    user_id: uuid.UUID
    key_id: uuid.UUID
    session_id: uuid.UUID | None = None
    project_id: uuid.UUID | None = None  # a session bound to one project; None: any of the tenant
    expires_at: datetime | None = None  # the session's expiry (an API key has none)
    created_at: datetime | None = None  # the session's creation

    @property
    def principal(self) -> Principal:
        return Principal(tenant_id=self.tenant_id, user_id=self.user_id)

    def may_use(self, project_id: uuid.UUID) -> bool:
        """The session's project scope (the tenant is checked by the store)."""
        return self.project_id is None or self.project_id == project_id


def new_secret() -> str:
    return "as_" + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def key_caller(db: Database, key: str) -> Caller | None:
    if len(key) > MAX_CREDENTIAL_LEN:
        return None
    async with db.connection() as conn:
        row = await conn.fetchrow(q("key_caller"), hash_api_key(key))
    return Caller(row["tenant_id"], row["user_id"], row["id"]) if row is not None else None


async def session_caller(db: Database, secret: str) -> Caller | None:
    """The caller of a live session (unexpired, unrevoked, its key unrevoked)."""
    if not secret or len(secret) > MAX_CREDENTIAL_LEN:
        return None
    async with db.connection() as conn:
        row = await conn.fetchrow(q("live_browser_session"), hash_secret(secret))
    if row is None:
        return None
    return Caller(
        row["tenant_id"],
        row["user_id"],
        row["key_id"],
        session_id=row["id"],
        project_id=row["project_id"],
        expires_at=row["expires_at"],
        created_at=row["created_at"],
    )


async def revoked_credentials(db: Database, ids: list[uuid.UUID]) -> set[uuid.UUID]:
    """Of these API key and session ids, the revoked ones (a session whose key is revoked too)."""
    async with db.connection() as conn:
        rows = await conn.fetch(q("revoked_credentials"), ids)
    return {r["id"] for r in rows}


def check_csrf(request: Request) -> None:
    """Unsafe methods authorized by the cookie: the custom header, and same-origin when the
    browser says (``Sec-Fetch-Site``); 403 ``csrf_refused`` otherwise."""
    if request.method in SAFE_METHODS:
        return
    site = request.headers.get("sec-fetch-site")
    if not request.headers.get(CSRF_HEADER) or site not in (None, "same-origin"):
        raise CSRF_REFUSED


def _path_project(request: Request) -> uuid.UUID | None:
    raw = request.path_params.get("project_id")
    if raw is None:
        return None
    try:
        return uuid.UUID(str(raw))
    except ValueError:
        raise ApiError(404, "not_found", "project not found") from None


async def caller_of(db: Database, request: Request, project_id: uuid.UUID | None = None) -> Caller:
    """The API key (``Authorization: Bearer``) wins; else the session cookie, with the CSRF
    check for unsafe methods and its project scope checked against ``project_id`` (default: the
    path's ``{project_id}``; another project is answered 404 like one of another tenant)."""
    key = bearer(request)
    if key is not None:
        caller = await key_caller(db, key)
        if caller is None:
            raise UNAUTHORIZED
        return caller
    secret = request.cookies.get(SESSION_COOKIE)
    if not secret:
        raise UNAUTHORIZED
    check_csrf(request)
    caller = await session_caller(db, secret)
    if caller is None:
        raise UNAUTHORIZED
    project = project_id if project_id is not None else _path_project(request)
    if project is not None and not caller.may_use(project):
        raise ApiError(404, "not_found", "project not found")
    return caller


def _cookie(secret: str, max_age: int, secure: bool) -> str:
    value = f"{SESSION_COOKIE}={secret}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}"
    return value + "; Secure" if secure else value


def _describe(
    session_id: uuid.UUID, project_id: uuid.UUID | None, created: datetime, expires: datetime
) -> SessionResponse:
    return SessionResponse(
        session=Session(
            id=session_id, project_id=project_id, created_at=created, expires_at=expires
        )
    )


def session_routes(db: Database, public_url: str, ttl_s: int = DEFAULT_TTL_S) -> list[BaseRoute]:
    """``POST /v1/sessions``, ``GET`` and ``DELETE /v1/sessions/current``."""
    secure = public_url.lower().startswith("https://")
    no_store = {"Cache-Control": "no-store"}

    async def create(request: Request) -> Response:
        key = bearer(request)
        caller = await key_caller(db, key) if key is not None else None
        if caller is None:
            raise UNAUTHORIZED
        project_id = await _body_project(request)
        async with db.connection() as conn:
            if project_id is not None and (
                await conn.fetchval(q("project_of_tenant"), project_id, caller.tenant_id) is None
            ):
                raise ApiError(404, "not_found", "project not found")
            secret = new_secret()
            session_id = uuid.uuid4()
            row = await conn.fetchrow(
                q("insert_browser_session"),
                session_id,
                hash_secret(secret),
                caller.tenant_id,
                caller.user_id,
                project_id,
                caller.key_id,
                float(ttl_s),
            )
        assert row is not None  # INSERT ... RETURNING
        body = _describe(session_id, project_id, row["created_at"], row["expires_at"])
        headers = no_store | {"Set-Cookie": _cookie(secret, ttl_s, secure)}
        return respond(body, 201, headers)

    async def current(request: Request) -> Response:
        secret = request.cookies.get(SESSION_COOKIE)
        caller = await session_caller(db, secret) if secret else None
        if caller is None or caller.session_id is None or caller.expires_at is None:
            raise UNAUTHORIZED
        assert caller.created_at is not None
        described = _describe(
            caller.session_id, caller.project_id, caller.created_at, caller.expires_at
        )
        return respond(described, headers=no_store)

    async def delete(request: Request) -> Response:
        secret = request.cookies.get(SESSION_COOKIE)
        if secret:
            check_csrf(request)
            caller = await session_caller(db, secret)
            if caller is not None and caller.session_id is not None:
                async with db.connection() as conn:
                    await conn.execute(q("revoke_browser_session"), caller.session_id)
        # idempotent: without a live session there is nothing to revoke; the cookie goes anyway
        return Response(status_code=204, headers=no_store | {"Set-Cookie": _cookie("", 0, secure)})

    return [
        Route("/v1/sessions", create, methods=["POST"]),
        Route("/v1/sessions/current", current, methods=["GET"]),
        Route("/v1/sessions/current", delete, methods=["DELETE"]),
    ]


async def _body_project(request: Request) -> uuid.UUID | None:
    """The optional ``{"project_id"}`` body (no body at all: a session for every project)."""
    if request.headers.get("content-length", "0") == "0" and not request.headers.get(
        "transfer-encoding"
    ):
        return None
    return parse_body(CreateSessionBody, await read_json(request, 4096)).project_id
