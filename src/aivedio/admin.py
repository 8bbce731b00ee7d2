"""Operator commands: migrate, create a project with its API key."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from typing import Any

import asyncpg

from aivedio.config import Settings
from aivedio.db.migrate import migrate
from aivedio.db.queries import q


def resolve_database_url(settings: Settings) -> str:
    """The configured URL, else the embedded server's (started if it is not running)."""
    if settings.database_url:
        return settings.database_url
    from aivedio.services.embedded import up

    url: str = up(settings.services).database_url
    return url


def hash_api_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def new_api_key() -> str:
    return "av_" + secrets.token_urlsafe(32)


async def run_migrate(settings: Settings) -> list[int]:
    conn = await asyncpg.connect(resolve_database_url(settings))
    try:
        return await migrate(conn)
    finally:
        await conn.close()


async def create_project_in(conn: asyncpg.Connection, tenant: str, project: str) -> dict[str, Any]:
    """Create (or reuse) the tenant and project by name and issue a new API key."""
    async with conn.transaction():
        tenant_id = await conn.fetchval(q("ensure_tenant"), uuid.uuid4(), tenant)
        project_id = await conn.fetchval(q("ensure_project"), uuid.uuid4(), tenant_id, project)
        await conn.execute(q("ensure_stream"), project_id)
        key = new_api_key()
        user_id = uuid.uuid4()
        await conn.execute(
            q("insert_api_key"), uuid.uuid4(), tenant_id, user_id, key[:10], hash_api_key(key)
        )
    return {
        "tenant_id": str(tenant_id),
        "project_id": str(project_id),
        "user_id": str(user_id),
        "api_key": key,
    }


async def create_project(settings: Settings, tenant: str, project: str) -> dict[str, Any]:
    conn = await asyncpg.connect(resolve_database_url(settings))
    try:
        await migrate(conn)
        return await create_project_in(conn, tenant, project)
    finally:
        await conn.close()
