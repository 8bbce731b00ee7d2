"""Who may open a stream: API keys (server-side clients), browser sessions (the HttpOnly
``aivedio_session`` cookie, ``api/sessions.py``) and short-lived stream tokens.

A stream token is ``<base64url claims>.<base64url HMAC-SHA256>``; the claims carry tenant, user,
project, the API key that minted it (so revoking the key closes the streams opened with its
tokens), the browser session that minted it if one did (revoking the session closes them too; its
expiry caps their lifetime) and the token's expiry (<= 60 s). It may travel in a URL because it
is short-lived and bound to one project; a long-lived credential never does.

A connection lives ``connection_lifetime``: the gateway's session cap, or the time left to its
credential's expiry when that is sooner, times a jitter of 80-100 %. Revocation: the gateway
groups its connections by ``Identity.credential_id`` (the session, else the API key) and asks
``revoked_credentials`` every ``recheck_s``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import random
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from aivedio.api.http import ApiError, parse_body, read_json, respond
from aivedio.api.models import StreamToken, StreamTokenBody
from aivedio.api.sessions import caller_of, key_caller, revoked_credentials, session_caller
from aivedio.db.pool import Database
from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.protocol import SseRequest
from aivedio.gateway.session import Identity
from aivedio.gateway.store import EventStore

MAX_TOKEN_TTL_S = 60

__all__ = [
    "MAX_TOKEN_TTL_S",
    "Refused",
    "StreamClaims",
    "StreamTokens",
    "authenticate",
    "connection_lifetime",
    "revoked_credentials",
    "stream_token_routes",
]


class Refused(Exception):
    """A stream request refused before it starts: HTTP status, close reason, message; the
    body's ``error.code`` is ``code``, by default the reason's name."""

    def __init__(
        self, status: int, reason: CloseReason, message: str, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.code = code or reason.label


def _no_project() -> Refused:
    """A project the credential may not use: answered like one that does not exist (404, as
    the REST API does), so a refusal never confirms that another tenant's project exists."""
    return Refused(404, CloseReason.FORBIDDEN, "project not found", code="not_found")


@dataclass(frozen=True, slots=True)
class StreamClaims:
    tenant_id: uuid.UUID
    user_id: uuid.UUID
    project_id: uuid.UUID
    key_id: uuid.UUID
    expires_at: int  # unix seconds
    session_id: uuid.UUID | None = None  # minted with a browser session
    credential_expires_at: int | None = None  # that session's expiry (unix seconds)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class StreamTokens:
    def __init__(self, secret: bytes, ttl_s: int = MAX_TOKEN_TTL_S) -> None:
        if len(secret) < 16:
            raise ValueError("the stream token secret must be at least 16 bytes")
        self.secret = secret
        self.ttl_s = min(ttl_s, MAX_TOKEN_TTL_S)

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self.secret, body.encode(), hashlib.sha256).digest())

    def mint(
        self,
        tenant_id: uuid.UUID,
        user_id: uuid.UUID,
        project_id: uuid.UUID,
        key_id: uuid.UUID,
        now: float | None = None,
        session_id: uuid.UUID | None = None,
        credential_expires_at: int | None = None,
    ) -> tuple[str, int]:
        expires = int(now if now is not None else time.time()) + self.ttl_s
        claims: dict[str, object] = {
            "t": str(tenant_id),
            "u": str(user_id),
            "p": str(project_id),
            "k": str(key_id),
            "e": expires,
        }
        if session_id is not None:
            claims["s"] = str(session_id)
        if credential_expires_at is not None:
            claims["x"] = credential_expires_at
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"{body}.{self._sign(body)}", expires

    def verify(self, token: str, now: float | None = None) -> StreamClaims:
        """The claims of a valid, unexpired token; ``Refused`` (401) otherwise."""
        body, _, signature = token.partition(".")
        if not body or not hmac.compare_digest(signature, self._sign(body)):
            raise Refused(401, CloseReason.UNAUTHORIZED, "invalid stream token")
        try:
            raw = json.loads(_unb64(body))
            claims = StreamClaims(
                uuid.UUID(raw["t"]),
                uuid.UUID(raw["u"]),
                uuid.UUID(raw["p"]),
                uuid.UUID(raw["k"]),
                int(raw["e"]),
                uuid.UUID(raw["s"]) if "s" in raw else None,
                int(raw["x"]) if "x" in raw else None,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise Refused(401, CloseReason.UNAUTHORIZED, "invalid stream token") from exc
        if claims.expires_at <= (now if now is not None else time.time()):
            raise Refused(401, CloseReason.CREDENTIAL_EXPIRED, "the stream token expired")
        return claims


async def authenticate(store: EventStore, tokens: StreamTokens | None, req: SseRequest) -> Identity:
    """Tenant and project are checked here, on connect; events then follow the subscription.
    A project of another tenant, or outside the token's or the session's project, is 404
    ``not_found``, like a project that does not exist.

    A stream token (``?token=`` or its cookie) first, then an API key (``Authorization:
    Bearer``), then the browser session cookie."""
    if req.token is not None and tokens is not None:
        claims = tokens.verify(req.token)
        if claims.project_id != req.project_id:
            raise _no_project()
        return Identity(
            claims.tenant_id,
            claims.user_id,
            claims.key_id,
            claims.session_id,
            claims.credential_expires_at,
        )
    if req.bearer is not None:
        caller = await key_caller(store.db, req.bearer)
    elif req.session is not None:
        caller = await session_caller(store.db, req.session)
    else:
        caller = None
    if caller is None:
        raise Refused(
            401, CloseReason.UNAUTHORIZED, "an API key, session or stream token is required"
        )
    if not caller.may_use(req.project_id):  # a session bound to another project
        raise _no_project()
    if await store.project_tenant(req.project_id) != caller.tenant_id:
        raise _no_project()
    expires = caller.expires_at.timestamp() if caller.expires_at is not None else None
    return Identity(caller.tenant_id, caller.user_id, caller.key_id, caller.session_id, expires)


def connection_lifetime(identity: Identity, cap_s: float, now: float | None = None) -> float:
    """Seconds a connection may live: the session cap, or the time left to the credential's
    expiry if sooner, times 80-100 % (so reconnects of many clients spread out)."""
    limit = cap_s
    if identity.expires_at is not None:
        left = identity.expires_at - (now if now is not None else time.time())
        limit = min(limit, max(left, 0.0))
    return limit * random.uniform(0.8, 1.0)


def stream_token_routes(db: Database, secret: bytes, ttl_s: int = 60) -> list[BaseRoute]:
    """``POST /v1/stream-tokens`` ``{"project_id"}`` -> ``{"token", "expires_at"}``; authorized
    by an API key or the browser session cookie (with its CSRF header)."""
    store = EventStore(db)
    tokens = StreamTokens(secret, ttl_s)

    async def create(request: Request) -> Response:
        caller = await caller_of(db, request)  # a session cookie: with its CSRF check
        project_id = parse_body(StreamTokenBody, await read_json(request, 4096)).project_id
        if not caller.may_use(project_id):  # a session bound to another project
            raise ApiError(404, "not_found", "project not found")
        if await store.project_tenant(project_id) != caller.tenant_id:
            raise ApiError(404, "not_found", "project not found")
        expires_on = caller.expires_at
        token, expires = tokens.mint(
            caller.tenant_id,
            caller.user_id,
            project_id,
            caller.key_id,
            session_id=caller.session_id,
            credential_expires_at=int(expires_on.timestamp()) if expires_on is not None else None,
        )
        expires_at = datetime.fromtimestamp(expires, UTC)
        return respond(
            StreamToken(token=token, expires_at=expires_at), headers={"Cache-Control": "no-store"}
        )

    return [Route("/v1/stream-tokens", create, methods=["POST"])]
