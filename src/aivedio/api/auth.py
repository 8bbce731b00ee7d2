"""API-key authentication: ``Authorization: Bearer <api_key>`` -> the tenant's principal."""

from __future__ import annotations

from starlette.requests import Request

from aivedio.admin import hash_api_key
from aivedio.api.http import ApiError
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.state.tasks import Principal

_UNAUTHORIZED = ApiError(
    401,
    "unauthorized",
    "a valid API key is required",
    headers={"WWW-Authenticate": 'Bearer realm="aivedio"'},
)


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def authenticate(db: Database, request: Request) -> Principal:
    token = bearer_token(request)
    if token is None or len(token) > 200:
        raise _UNAUTHORIZED
    async with db.connection() as conn:
        row = await conn.fetchrow(q("principal_of_key"), hash_api_key(token))
    if row is None:
        raise _UNAUTHORIZED
    return Principal(tenant_id=row["tenant_id"], user_id=row["user_id"])
