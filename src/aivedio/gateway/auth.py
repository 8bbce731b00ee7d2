"""Who may open a stream: API keys (server-side clients) and short-lived stream tokens.

A stream token is ``<base64url claims>.<base64url HMAC-SHA256>``; the claims carry tenant, user,
project, the API key that minted it (so revoking the key closes the streams opened with its
tokens) and the expiry (<= 60 s). It may travel in a URL because it is short-lived and bound to one
project; a long-lived credential never does.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from aivedio.admin import hash_api_key
from aivedio.api.http import ApiError, read_json
from aivedio.db.pool import Database
from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.protocol import SseRequest
from aivedio.gateway.session import Identity
from aivedio.gateway.store import EventStore

MAX_TOKEN_TTL_S = 60


class Refused(Exception):
    """A stream request refused before it starts: HTTP status, close reason, message."""

    def __init__(self, status: int, reason: CloseReason, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class StreamClaims:
    tenant_id: uuid.UUID
    user_id: uuid.UUID
    project_id: uuid.UUID
    key_id: uuid.UUID
    expires_at: int  # unix seconds


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
    ) -> tuple[str, int]:
        expires = int(now if now is not None else time.time()) + self.ttl_s
        claims = {
            "t": str(tenant_id),
            "u": str(user_id),
            "p": str(project_id),
            "k": str(key_id),
            "e": expires,
        }
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
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise Refused(401, CloseReason.UNAUTHORIZED, "invalid stream token") from exc
        if claims.expires_at <= (now if now is not None else time.time()):
            raise Refused(401, CloseReason.CREDENTIAL_EXPIRED, "the stream token expired")
        return claims


async def authenticate(store: EventStore, tokens: StreamTokens | None, req: SseRequest) -> Identity:
    """Tenant and project are checked here, on connect; events then follow the subscription."""
    if req.token is not None and tokens is not None:
        claims = tokens.verify(req.token)
        if claims.project_id != req.project_id:
            raise Refused(403, CloseReason.FORBIDDEN, "the token is for another project")
        return Identity(claims.tenant_id, claims.user_id, claims.key_id)
    if req.bearer is None or len(req.bearer) > 200:
        raise Refused(401, CloseReason.UNAUTHORIZED, "an API key or stream token is required")
    principal = await store.key_principal(hash_api_key(req.bearer))
    if principal is None:
        raise Refused(401, CloseReason.UNAUTHORIZED, "an API key or stream token is required")
    key_id, tenant_id, user_id = principal
    if await store.project_tenant(req.project_id) != tenant_id:
        raise Refused(403, CloseReason.FORBIDDEN, "no such project for this credential")
    return Identity(tenant_id, user_id, key_id)


def stream_token_routes(db: Database, secret: bytes, ttl_s: int = 60) -> list[BaseRoute]:
    """``POST /v1/stream-tokens`` ``{"project_id"}`` -> ``{"token", "expires_at"}``."""
    store = EventStore(db)
    tokens = StreamTokens(secret, ttl_s)
    unauthorized = ApiError(
        401,
        "unauthorized",
        "a valid API key is required",
        headers={"WWW-Authenticate": 'Bearer realm="aivedio"'},
    )

    async def create(request: Request) -> Response:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip() or len(key) > 200:
            raise unauthorized
        principal = await store.key_principal(hash_api_key(key.strip()))
        if principal is None:
            raise unauthorized
        key_id, tenant_id, user_id = principal
        body = await read_json(request, 4096)
        try:
            project_id = uuid.UUID(str(body["project_id"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ApiError(
                422,
                "invalid_request",
                "project_id must be a UUID",
                fields=[{"field": "project_id", "message": "a UUID"}],
            ) from exc
        if await store.project_tenant(project_id) != tenant_id:
            raise ApiError(404, "not_found", "project not found")
        token, expires = tokens.mint(tenant_id, user_id, project_id, key_id)
        expires_at = datetime.fromtimestamp(expires, UTC).isoformat()
        return JSONResponse(
            {"token": token, "expires_at": expires_at}, headers={"Cache-Control": "no-store"}
        )

    return [Route("/v1/stream-tokens", create, methods=["POST"])]
