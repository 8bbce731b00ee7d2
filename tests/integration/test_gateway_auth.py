"""Who may stream: API keys, stream tokens, tenant/project checks, expiry and revocation."""

from __future__ import annotations

import asyncio
import time

import pytest

from aivedio.client import StreamRefused
from aivedio.gateway import StreamTokens
from tests.integration.helpers import make_project
from tests.integration.test_gateway_harness import SECRET, EnvFactory, collect, make_env, seqs

__all__ = ["make_env"]


async def refused(client_events: object) -> StreamRefused:
    with pytest.raises(StreamRefused) as info:
        async for _ in client_events:  # type: ignore[attr-defined]
            pass
    return info.value


async def test_no_credential_is_unauthorized(make_env: EnvFactory) -> None:
    env = await make_env()
    client = env.client(api_key="av_not-a-key")
    assert (await refused(client.connect_once())).status == 401
    await client.aclose()


async def test_cross_tenant_subscribe_is_refused_and_receives_nothing(
    make_env: EnvFactory,
) -> None:
    env = await make_env()
    other = await make_project(env.db, tenant="intruder", project="web")
    intruder = env.client(api_key=other.api_key)  # another tenant's key, this tenant's project
    assert (await refused(intruder.connect_once())).status == 404  # as if it did not exist
    # A token minted for the intruder's own project does not open this project's stream.
    own = env.client(api_key=other.api_key, project_id=other.project_id)
    token = await own.stream_token()
    response = await intruder.http.get(
        f"/v1/projects/{env.project.project_id}/events", params={"token": token}
    )
    assert (response.status_code, response.json()["error"]["code"]) == (404, "not_found")
    # And no token can be minted for a project of another tenant.
    response = await intruder.http.post(
        "/v1/stream-tokens",
        json={"project_id": str(env.project.project_id)},
        headers=intruder.headers,
    )
    assert response.status_code == 404
    # A malformed project id is the API's usual field error.
    response = await intruder.http.post(
        "/v1/stream-tokens", json={"project_id": "not-a-uuid"}, headers=intruder.headers
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "validation_failed"
    assert response.json()["error"]["fields"] == [{"field": "project_id", "message": "a UUID"}]
    await env.new_task()
    await intruder.aclose()
    await own.aclose()


async def test_stream_token_opens_the_stream(make_env: EnvFactory) -> None:
    env = await make_env()
    client = env.client(use_stream_token=True)
    await client.snapshot()
    stream = client.connect_once()
    reader = asyncio.ensure_future(collect(stream, lambda fs: len(seqs(fs)) >= 1))
    await env.joined(1)
    await env.new_task()
    assert seqs(await reader) == [1]
    await client.aclose()


async def test_expired_or_forged_stream_token_is_refused(make_env: EnvFactory) -> None:
    env = await make_env()
    async with env.db.connection() as conn:
        key_id = await conn.fetchval(
            "SELECT id FROM api_keys WHERE tenant_id = $1", env.project.tenant_id
        )
    p = env.project
    expired, _ = StreamTokens(SECRET).mint(
        p.tenant_id, p.principal.user_id, p.project_id, key_id, now=time.time() - 120
    )
    forged, _ = StreamTokens(b"another-secret-0123456789abcdef").mint(
        p.tenant_id, p.principal.user_id, p.project_id, key_id
    )
    client = env.client()
    for token, reason in ((expired, "credential_expired"), (forged, "unauthorized")):
        response = await client.http.get(
            f"/v1/projects/{p.project_id}/events", params={"token": token}
        )
        assert response.status_code == 401
        assert response.json()["error"]["code"] == reason
    await client.aclose()


@pytest.mark.parametrize("use_stream_token", [False, True])
async def test_revoking_the_key_closes_its_streams(
    make_env: EnvFactory, use_stream_token: bool
) -> None:
    env = await make_env()
    client = env.client(use_stream_token=use_stream_token)
    await client.snapshot()
    stream = client.connect_once()
    reader = asyncio.ensure_future(collect(stream, lambda fs: any(f.event == "close" for f in fs)))
    await env.joined(1)
    async with env.db.connection() as conn:
        await conn.execute(
            "UPDATE api_keys SET revoked_at = now() WHERE tenant_id = $1", env.project.tenant_id
        )
    got = await reader
    assert got[-1].data == {"code": 3503, "reason": "credential_revoked", "reconnect": False}
    assert (await refused(env.client().connect_once())).status == 401
    await client.aclose()
