"""``bench e2e``: the naive reference, what a platform team would otherwise write.

One uvicorn process (Starlette, asyncpg, redis-py; uvloop and httptools as uvicorn picks them):

- ``POST /v1/callbacks/{provider}``: check the Standard Webhooks signature and timestamp window,
  parse the body, ``INSERT`` it into PostgreSQL (deduplicated by ``webhook-id``), ``PUBLISH`` it
  on the project's Redis channel, answer 204;
- ``GET /v1/projects/{id}/events``: subscribe to that channel and stream every message as an SSE
  frame.

No inbox, no state machine, no outbox, no bus, no resume: an event published while a browser is
away is gone for it. The webhooks are the load generator's, on the same schedule as aivedio's,
with the project and task ids in the provider metadata (where such a handler reads them).

Run as ``python -m aivedio.bench.e2e_naive --port N --database-url U --redis-url R --channel C
--secret whsec_...`` (the bench does).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from aivedio.sandbox.config import decode_webhook_secret

TABLE = """
CREATE TABLE IF NOT EXISTS naive_webhooks (
    id          BIGSERIAL PRIMARY KEY,
    webhook_id  TEXT NOT NULL UNIQUE,
    project_id  TEXT NOT NULL,
    task_id     TEXT NOT NULL,
    payload     JSONB NOT NULL,
    received_at TIMESTAMPTZ NOT NULL DEFAULT now()
)
"""
INSERT = """
INSERT INTO naive_webhooks (webhook_id, project_id, task_id, payload)
VALUES ($1, $2, $3, $4::jsonb)
ON CONFLICT (webhook_id) DO NOTHING
RETURNING id
"""
TOLERANCE_S = 300


def verified(key: bytes, headers: Any, body: bytes) -> bool:
    msg_id = headers.get("webhook-id", "")
    stamp = headers.get("webhook-timestamp", "")
    if not msg_id or not stamp.isdigit() or abs(time.time() - int(stamp)) > TOLERANCE_S:
        return False
    mac = hmac.new(key, f"{msg_id}.{stamp}.".encode() + body, hashlib.sha256).digest()
    expected = "v1," + base64.b64encode(mac).decode()
    return any(
        hmac.compare_digest(expected, sig) for sig in headers.get("webhook-signature", "").split()
    )


def create_app(database_url: str, redis_url: str, channel: str, secret: str) -> Starlette:
    key = decode_webhook_secret(secret)
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        pool = await asyncpg.create_pool(database_url, min_size=4, max_size=10)
        async with pool.acquire() as conn:
            await conn.execute(TABLE)
        state["db"] = pool
        state["redis"] = aioredis.Redis.from_url(redis_url)
        # Each stream holds a connection for its subscription: a pool of their own, so that
        # a hundred streams do not exhaust the publishers' (redis-py: MaxConnectionsError).
        state["subscribers"] = aioredis.Redis.from_url(redis_url, max_connections=100_000)
        try:
            yield
        finally:
            await state["subscribers"].aclose()
            await state["redis"].aclose()
            await pool.close()

    async def callback(request: Request) -> Response:
        body = await request.body()
        if not verified(key, request.headers, body):
            return Response(status_code=401)
        try:
            data = json.loads(body)["data"]
            meta = data["metadata"]
            project_id, task_id = str(meta["project_id"]), str(meta["task_id"])
        except (ValueError, KeyError, TypeError):
            return Response(status_code=422)
        db: asyncpg.Pool = state["db"]
        row_id = await db.fetchval(
            INSERT, request.headers["webhook-id"], project_id, task_id, body.decode()
        )
        if row_id is not None:
            event = {
                "event_id": row_id,
                "task_id": task_id,
                "task_version": data.get("sequence"),
                "status": data.get("status"),
                "progress": data.get("progress"),
            }
            await state["redis"].publish(f"{channel}:{project_id}", orjson.dumps(event))
        return Response(status_code=204)

    async def events(request: Request) -> Response:
        project_id = request.path_params["project_id"]
        stream = _stream(state["subscribers"], f"{channel}:{project_id}")
        return StreamingResponse(stream, media_type="text/event-stream")

    routes = [
        Route("/v1/callbacks/{provider}", callback, methods=["POST"]),
        Route("/v1/projects/{project_id}/events", events, methods=["GET"]),
        Route("/healthz", lambda request: Response(b"ok"), methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _stream(subscribers: aioredis.Redis, topic: str) -> AsyncIterator[bytes]:
    """One SSE stream: every message published on ``topic``, a ping every 15 s of silence."""
    pubsub = subscribers.pubsub()
    await pubsub.subscribe(topic)
    try:
        yield b": start 0-0\n\n"
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=15.0)
            if message is None:
                yield f": ping {int(time.time())}\n\n".encode()
                continue
            event_id = orjson.loads(message["data"])["event_id"]
            yield (b"id: 0-%d\nevent: task.status\ndata: %s\n\n" % (event_id, message["data"]))
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("--database-url", "--redis-url", "--channel", "--secret"):
        parser.add_argument(name, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = create_app(args.database_url, args.redis_url, args.channel, args.secret)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
