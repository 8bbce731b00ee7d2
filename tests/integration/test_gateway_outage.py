"""The sandbox's stream outage at the gateway: the project's streams are cut with no goodbye
frame, its new streams are refused with 503 ``stream_outage`` until the outage ends, and other
projects' streams go on."""

from __future__ import annotations

import asyncio
import uuid

from tests.integration.test_gateway_harness import EnvFactory, make_env
from tests.waiting import eventually

__all__ = ["make_env"]


async def _open(
    env_base: str, project_id: str, api_key: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    host, port = env_base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"GET /v1/projects/{project_id}/events HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {api_key}\r\n\r\n".encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return reader, writer, head


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    seen = b""
    while chunk := await asyncio.wait_for(reader.read(4096), 10):
        seen += chunk
    return seen


async def test_a_killed_stream_ends_without_goodbye_and_reconnects_are_refused(
    make_env: EnvFactory,
) -> None:
    env = await make_env()
    project = env.project
    reader, writer, head = await _open(env.base_url, str(project.project_id), project.api_key)
    assert head.startswith(b"HTTP/1.1 200")
    # joined once the gateway counts it
    await eventually(lambda: env.gateway.connections, "the gateway to count the connection", 4)
    assert env.gateway.kill(uuid.UUID(str(project.project_id)), 30) == 1
    rest = await _read_to_eof(reader)
    assert b"event: close" not in rest  # cut, as a lost network would
    writer.close()
    reader, writer, head = await _open(env.base_url, str(project.project_id), project.api_key)
    assert head.startswith(b"HTTP/1.1 503")
    assert b"Retry-After:" in head
    body = await _read_to_eof(reader)
    assert b"stream_outage" in body
    writer.close()
    # the outage over (a new one of 0 s replaces it): the project's streams open again
    env.gateway.kill(uuid.UUID(str(project.project_id)), 0)
    reader, writer, head = await _open(env.base_url, str(project.project_id), project.api_key)
    assert head.startswith(b"HTTP/1.1 200")
    writer.close()
