"""``aivedio bench retention``: months of events, then what retention and replay cost.

A scratch database is filled with ``events`` task events over ``days`` day partitions (default 10
million over 30 days, ``projects`` streams; ``events=200000`` for CI), then it prints:

- bytes per event (the partitions of task_events with their indexes, after VACUUM ANALYZE), as
  written and once the closed days' indexes were packed (what the maintenance role does);
- the time of a replay of ``replay`` events (1,000) from a cursor, through the gateway's own
  query (``EventStore.events``): p50/p99 at the head and deep in history (the oldest tenth);
- ``EXPLAIN (ANALYZE, BUFFERS)`` of the replay, the task snapshot and the inbox and outbox claims;
- the time to drop the oldest day (a maintenance round: floors raised, DETACH ... CONCURRENTLY,
  DROP) while ``writers`` concurrent writers commit events (each its own stream, as the state
  service does: stream row + event + outbox row in one statement) and ``readers`` replay: the
  longest writer transaction during the drop against the longest before it (the same load);
- the cost of deleting one day of published outbox rows in batches (the outbox's retention),
  beside the partition drop of one day of events.

The JSON line last carries ``bytes_per_event``, ``replay_p99_ms``, ``drop_partition_ms`` and
``max_writer_block_ms`` (and the rest by name).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Mapping
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from aivedio.bench.common import (
    build_options,
    database_url,
    percentile,
    print_json_line,
    rounded,
    scratch_database,
)
from aivedio.bench.retention_drop import _drop_under_load, _outbox_purge
from aivedio.bench.retention_fill import _fill, _sizes, _streams
from aivedio.bench.retention_options import Options
from aivedio.bench.retention_replay import _explain, _replays
from aivedio.config import DatabaseConfig, Settings
from aivedio.db.pool import Database
from aivedio.retention.partitions import compact, compactable, list_partitions


def run(settings: Settings, options: Mapping[str, str]) -> int:
    opts = build_options(Options, options)
    opts.check()
    return asyncio.run(_run(settings, opts))


async def _run(settings: Settings, opts: Options) -> int:
    async with scratch_database(database_url(settings), "aivedio_bench_retention") as url:
        db = await Database.connect(
            DatabaseConfig(
                url=url,
                min_size=2,
                max_size=opts.writers + opts.readers + 4,
                command_timeout_s=600.0,
            )
        )
        try:
            figures = await _measure(db, opts)
        finally:
            await db.close()
    print_json_line({"bench": "retention", **figures})
    return 0


async def _measure(db: Database, opts: Options) -> dict[str, Any]:
    per_day = opts.events // (opts.projects * opts.days)  # events per project per day
    total = per_day * opts.projects * opts.days
    print(f"filling {total:,} events: {opts.projects} projects x {opts.days} days x {per_day}")
    began = time.perf_counter()
    first_day = await _fill(db, opts, per_day)
    fill_s = time.perf_counter() - began
    print(f"  filled in {fill_s:.1f} s ({total / fill_s:,.0f} events/s)")
    unpacked, compact_s = await _pack(db)
    heap, indexes, stored = await _sizes(db, "closed days packed")
    bytes_per_event = (heap + indexes) / stored
    head_ms, deep_ms, sql_head_ms, sql_deep_ms = await _replay_phase(db, opts)

    drop = await _drop_under_load(db, opts, first_day)
    outbox = await _outbox_purge(db, opts.outbox_rows or per_day * opts.projects)
    replay_p99 = max(percentile(head_ms, 99), percentile(deep_ms, 99))
    return {
        "events": stored,
        "days": opts.days,
        "projects": opts.projects,
        "fill_s": rounded(fill_s, 1),
        "bytes_per_event": rounded(bytes_per_event, 1),
        "bytes_per_event_unpacked": rounded(unpacked, 1),
        "heap_bytes": heap,
        "index_bytes": indexes,
        "compact_s": rounded(compact_s, 2),
        "replay_events": opts.replay,
        "replay_head_p50_ms": rounded(percentile(head_ms, 50)),
        "replay_head_p99_ms": rounded(percentile(head_ms, 99)),
        "replay_deep_p50_ms": rounded(percentile(deep_ms, 50)),
        "replay_deep_p99_ms": rounded(percentile(deep_ms, 99)),
        "replay_p99_ms": rounded(replay_p99),
        "replay_sql_head_p99_ms": rounded(percentile(sql_head_ms, 99)),
        "replay_sql_deep_p99_ms": rounded(percentile(sql_deep_ms, 99)),
        **drop,
        **outbox,
        "options": asdict(opts),
    }


async def _pack(db: Database) -> tuple[float, float]:
    """VACUUM ANALYZE, the sizes as written, then the closed days' indexes packed (what the
    maintenance role does): the bytes per event as written, and the packing's seconds."""
    async with db.connection() as conn:
        await conn.execute("VACUUM ANALYZE task_events")
        await conn.execute("VACUUM ANALYZE generation_tasks")
        await conn.execute("VACUUM ANALYZE provider_callback_inbox")
    heap, indexes, stored = await _sizes(db, "as written")
    unpacked = (heap + indexes) / stored
    began = time.perf_counter()
    conn = await db.session()
    try:
        closed = await compactable(conn, await list_partitions(conn), datetime.now(UTC))
        for partition in closed:
            await compact(conn, partition)
    finally:
        await conn.close()
    compact_s = time.perf_counter() - began
    print(f"  {len(closed)} closed days packed (REINDEX CONCURRENTLY) in {compact_s:.1f} s")
    return unpacked, compact_s


async def _replay_phase(
    db: Database, opts: Options
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Replays at the head and deep, decoded and the query alone, printed; then the EXPLAINs."""
    streams = await _streams(db)
    # As the gateway's server does at start (process/http_server.py): what exists now (the fill's
    # objects here, the app's there) is never scanned again by the cyclic GC, whose full
    # collections were the replays' p99 (60 ms against 14 ms with it, bench at 200,000).
    gc.collect()
    gc.freeze()
    head_ms, deep_ms = await _replays(db, opts, streams)
    sql_head_ms, sql_deep_ms = await _replays(db, opts, streams, raw=True)
    for where, values, sql in (("head", head_ms, sql_head_ms), ("deep", deep_ms, sql_deep_ms)):
        print(
            f"replay {opts.replay} events {where}: p50 {percentile(values, 50):.2f} ms, "
            f"p99 {percentile(values, 99):.2f} ms ({len(values)} replays, decoded into frames);"
            f" the query alone p50 {percentile(sql, 50):.2f} ms, p99 {percentile(sql, 99):.2f} ms"
        )
    await _explain(db, opts, streams)
    return head_ms, deep_ms, sql_head_ms, sql_deep_ms


__all__ = ["Options", "run"]
