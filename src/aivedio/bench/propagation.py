"""``aivedio bench propagation``: outbox -> relay -> JetStream -> dispatcher -> Redis Pub/Sub.

In a scratch database and a private JetStream stream (both removed at the end), with a Redis
subscriber in this process counting every event on a private channel:

(a) **drain**: ``events`` outbox rows (``tasks`` tasks, their versions interleaved, payloads shaped
    like the state service's) are inserted with SQL, then ``relays`` relays and one dispatcher
    start (in child processes, as separate roles would run) and the clock runs until the
    subscriber has every (task, version); ``per_s`` = events / seconds. Every event is accounted
    for: missing, duplicate and out-of-order counts are printed and must be 0.
(b) **latency**: ``rate`` observations/s for ``seconds`` through ``StateService.apply_in`` (or
    ``apply_many_in`` of ``writer_batch`` observations per commit) on ``latency_tasks`` tasks in
    ``projects`` projects, from ``writers`` processes, each writer owning the transaction so it
    can stamp both ends of its ``COMMIT``. Latency = the subscriber's receive time (after the
    Redis publish) minus the moment ``COMMIT`` returned in the writer (``p50_ms``, ``p99_ms``):
    the commit happened just before that reply, so this is the issue's "commit -> publish" up to
    the reply's trip and the writer's wake-up. The same from the moment ``COMMIT`` was sent
    (``p50_ms_upper``, ``p99_ms_upper``) is an upper bound: it adds the writer's WAL flush and
    wait for its turn in the group commit, which no part of the propagation path can shorten.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from aivedio.bench.common import build_options, database_url, print_json_line, scratch_database
from aivedio.bench.propagation_drain import _drain
from aivedio.bench.propagation_latency import _latency
from aivedio.bench.propagation_options import Options
from aivedio.bench.propagation_subscriber import Counted, _subscribe
from aivedio.bus import BusConfig
from aivedio.config import Settings
from aivedio.propagation.dispatcher import broadcast_channel
from aivedio.runtime import resolve_urls

__all__ = ["run"]


def run(settings: Settings, options: Mapping[str, str]) -> int:
    opts = build_options(Options, options)
    opts.check()
    return asyncio.run(_run(settings, opts))


async def _run(settings: Settings, opts: Options) -> int:
    urls = resolve_urls(settings)
    tag = uuid.uuid4().hex[:10]
    bus_cfg = BusConfig(
        url=urls.redis_url if settings.bus == "redis-streams" else urls.nats_url,
        adapter=settings.bus,
        stream=f"BENCH_{tag}",
        subject_prefix=f"bench{tag}",
        max_in_flight=opts.in_flight,
        max_ack_pending=20_000,
    )
    prefix = f"bench{tag}"
    print(
        f"propagation: drain {opts.events} outbox rows ({opts.tasks} tasks), {opts.relays} "
        f"relay(s) + 1 dispatcher in child processes; then {opts.rate} events/s for "
        f"{opts.seconds:g} s through StateService."
        + (
            "apply_in"
            if opts.writer_batch == 1
            else f"apply_many_in ({opts.writer_batch} per commit)"
        ),
        flush=True,
    )
    figures: dict[str, Any] = {"bench": "propagation"}
    async with scratch_database(database_url(settings)) as url:
        counted = Counted()
        reader = await _subscribe(urls.redis_url, broadcast_channel(prefix), counted)
        try:
            figures |= await _drain(url, bus_cfg, urls.redis_url, prefix, opts, counted)
            figures |= await _latency(settings, url, bus_cfg, urls.redis_url, prefix, opts, counted)
        finally:
            reader.close()
            await _delete_streams(bus_cfg)
    figures["ok"] = all(
        figures.get(k, 0) == 0 for k in ("missing", "duplicates_at_subscriber", "latency_missing")
    )
    print_json_line(figures)
    return 0 if figures["ok"] else 1


async def _delete_streams(cfg: BusConfig) -> None:
    if cfg.adapter == "redis-streams":
        client = aioredis.Redis.from_url(cfg.url, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            keys = [k async for k in client.scan_iter(match=f"{cfg.subject_prefix}:*", count=500)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
        return
    import nats
    import nats.js.errors

    nc = await nats.connect(cfg.url)
    try:
        js = nc.jetstream()
        for name in (cfg.stream, f"{cfg.stream}_DLQ"):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(name)
    finally:
        await nc.close()
