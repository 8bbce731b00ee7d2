"""Phase (a) of ``aivedio bench propagation``: a backlog of outbox rows drained by the pipeline."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import asyncpg

from aivedio.bench.common import rounded
from aivedio.bench.propagation_options import Options
from aivedio.bench.propagation_pipeline import _cpu_line, _pipeline, _specs
from aivedio.bench.propagation_subscriber import Counted
from aivedio.bus import BusConfig

# -- (a) drain -------------------------------------------------------------------------------

FILL = """
WITH t AS MATERIALIZED (
    SELECT n, gen_random_uuid() AS id FROM generate_series(0, $1 - 1) AS n
)
INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT 'task', t.id, g.v, 'task.status.changed', jsonb_build_object(
    'event_type', 'task.status.changed', 'aggregate_id', t.id, 'aggregate_version', g.v,
    'tenant_id', $3::uuid, 'project_id', $4::uuid, 'user_id', $3::uuid,
    'attempt_id', gen_random_uuid(), 'status', 'running', 'public_status', 'generating',
    'stage', 'generating', 'progress', least(99, g.v * 5), 'terminal', false,
    'asset_id', NULL, 'error_code', NULL, 'source', 'poll', 'occurred_at', now(),
    'trace_id', 'trc_' || md5(t.id::text || g.v),
    'public', jsonb_build_object('task_id', t.id, 'task_version', g.v, 'status', 'generating',
                                 'stage', 'generating', 'progress', least(99, g.v * 5),
                                 'asset_id', NULL, 'error', NULL),
    'event_id', (g.v - 1) * $1 + t.n + 1, 'epoch', 1)
FROM generate_series(1, $2) AS g(v) CROSS JOIN t
ORDER BY g.v, t.n
"""


async def _drain(
    url: str, bus: BusConfig, redis_url: str, prefix: str, opts: Options, counted: Counted
) -> dict[str, Any]:
    if opts.events == 0:
        return {}
    per_task = max(1, opts.events // opts.tasks)
    total = per_task * opts.tasks
    conn = await asyncpg.connect(url)
    try:
        started = time.perf_counter()
        await conn.execute(FILL, opts.tasks, per_task, uuid.uuid4(), uuid.uuid4())
        await conn.execute("VACUUM ANALYZE outbox_events")
        print(f"  setup: {total} outbox rows in {time.perf_counter() - started:.1f} s", flush=True)
        before = len(counted.first)
        cpu: dict[str, float] = {}
        async with _pipeline(_specs(url, bus, redis_url, prefix, opts), cpu):
            started = time.perf_counter()
            deadline = started + opts.timeout
            while len(counted.first) - before < total and time.perf_counter() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            seconds = time.perf_counter() - started
            await asyncio.sleep(0.5)  # late duplicates would show up now
        published = await conn.fetchval(
            "SELECT count(*) FROM outbox_events WHERE publish_status = 'published'"
        )
    finally:
        await conn.close()
    got = len(counted.first) - before
    per_s = got / seconds if seconds > 0 else 0.0
    print(
        f"  drain:   {per_s:,.0f} events/s  ({got} of {total} delivered in {seconds:.2f} s; "
        f"{published} rows marked published; duplicates at the subscriber {counted.duplicates}, "
        f"out of order {counted.out_of_order})",
        flush=True,
    )
    print(f"  drain CPU: {_cpu_line(cpu, got)}", flush=True)
    return {
        "per_s": rounded(per_s, 1),
        "events": total,
        "missing": total - got,
        "duplicates_at_subscriber": counted.duplicates,
        "out_of_order": counted.out_of_order,
        "drain_seconds": rounded(seconds),
        "relays": opts.relays,
        "drain_cpu_us_per_event": {k: rounded(v / max(got, 1) * 1e6, 1) for k, v in cpu.items()},
    }
