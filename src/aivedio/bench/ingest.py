"""``aivedio bench ingest``: verified, durably committed callbacks per second, beside pgbench.

In one invocation, on one scratch database (created, migrated, dropped):

1. ``pgbench`` runs a single-row ``INSERT ... ON CONFLICT DO NOTHING`` of a callback-sized row
   into ``provider_callback_inbox`` (``-M prepared -j 2``, unique keys from ``:client_id`` and a
   random number) for each client count in ``pgbench_clients``; the best TPS is the ceiling: what
   PostgreSQL does with one commit per row on this machine.
2. The table is emptied; the production HTTP server runs in ``server_processes`` processes (one
   per CPU by default) sharing the port with ``SO_REUSEPORT`` (1: in this process), on uvloop
   (``loop``): ``serve_http`` with its sniffer, so ``POST /v1/callbacks/{provider}`` takes the
   lean HTTP/1.1 path (``path=lean``; ``path=asgi`` serves it through uvicorn, Starlette and the
   trace middleware instead, for comparison), Standard Webhooks verification, group-commit inbox
   writer.
3. Load generators in ``client_processes`` separate processes (uvloop protocols on raw HTTP/1.1
   keep-alive sockets, one request in flight per connection, requests signed from a template:
   the client costs little CPU) send validly signed callbacks with distinct ids, all starting at
   one instant: first closed-loop on ``connections`` connections as fast as the server answers
   (the maximum rate), then open-loop at half that rate, where latency is measured from each
   request's scheduled send time (no coordinated omission). Only 204 answers count, and the
   stored rows are counted to check that every 204 has its committed row.

Figures are printed side by side, then the JSON line
``{"bench": "ingest", "per_s", "ceiling_per_s", "ratio", "p50_ms", "p95_ms", "p99_ms", ...}``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from aivedio.bench.common import BenchUsageError, build_options, print_json_line, rounded
from aivedio.bench.ingest_load import client_main
from aivedio.bench.ingest_options import IngestOptions
from aivedio.bench.ingest_run import Phase, _main
from aivedio.bench.ingest_server import server_main
from aivedio.config import Settings


def _http_impl(choice: str) -> str:
    if choice != "auto":
        return choice
    return "httptools" if importlib.util.find_spec("httptools") else "h11"


def _checked(options: Mapping[str, str]) -> IngestOptions:
    """The options, ``server_processes`` 0 made one per CPU; a usage error for impossible ones."""
    opts = build_options(IngestOptions, options)
    if opts.server_processes == 0:
        opts = replace(opts, server_processes=os.cpu_count() or 1)
    if min(opts.seconds, opts.connections, opts.client_processes, opts.repeats) <= 0:
        raise BenchUsageError("seconds, connections, client_processes and repeats must be positive")
    if opts.server_processes <= 0:
        raise BenchUsageError("server_processes must be positive (0: one per CPU)")
    if opts.connections < opts.client_processes:
        raise BenchUsageError("at least one connection per client process")
    if opts.path not in ("lean", "asgi") or opts.loop not in ("uvloop", "asyncio"):
        raise BenchUsageError("path is lean or asgi; loop is uvloop or asyncio")
    return opts


def _measured(settings: Settings, opts: IngestOptions) -> dict[str, Any]:
    """The run (``_main``) on the event loop of ``loop``."""
    if opts.loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_main(settings, opts))
    else:
        return asyncio.run(_main(settings, opts))


def _print_figures(opts: IngestOptions, r: Mapping[str, Any]) -> None:
    top: Phase = r["top"]
    half: Phase = r["half"]
    ceiling: float = r["ceiling"]
    print(
        f"ingest bench: {os.cpu_count()} CPUs, {opts.seconds:g} s per phase, options {asdict(opts)}"
    )
    for c, tps in r["pgbench"].items():
        runs = ", ".join(f"{x:.0f}" for x in r["pgbench_runs"][c])
        print(
            f"  pgbench single-row INSERT  -c {c:<3} -j 2 -M prepared : {tps:10.1f} /s"
            f"   (best of {runs})"
        )
    for title, phase in (
        (f"gateway ({opts.path}), {opts.connections} connections, max rate", top),
        (f"gateway at half that rate ({top.per_s / 2:.0f}/s)", half),
    ):
        print(
            f"  {title:<44}: {phase.per_s:10.1f} /s   p50 {phase.p50_ms:.2f} ms"
            f"  p95 {phase.p95_ms:.2f} ms  p99 {phase.p99_ms:.2f} ms"
        )
    runs = ", ".join(f"{x:.0f}" for x in r["top_runs"])
    print(f"  max-rate runs: {runs}; ratio gateway / pgbench best: {top.per_s / ceiling:.2f}")
    cpu = ", ".join(
        f"{side} {'n/a' if us is None else f'{us:.0f} us'}" for side, us in top.cpu_us.items()
    )
    print(
        f"  CPU per callback, best max-rate run (warm-up included): {cpu}; "
        f"pgbench's own client {r['pgbench_client_cpu_us']:.0f} us per transaction"
    )
    print(f"  answers: max-rate {top.statuses}, half-rate {half.statuses}")
    print(f"  rows stored {r['stored']} for {r['accepted']} answers 204 (every 204 has its row)")


def _print_json(opts: IngestOptions, r: Mapping[str, Any]) -> None:
    top: Phase = r["top"]
    half: Phase = r["half"]
    ceiling: float = r["ceiling"]
    print_json_line(
        {
            "bench": "ingest",
            "per_s": rounded(top.per_s, 1),
            "ceiling_per_s": rounded(ceiling, 1),
            "ratio": rounded(top.per_s / ceiling),
            "p50_ms": rounded(top.p50_ms),
            "p95_ms": rounded(top.p95_ms),
            "p99_ms": rounded(top.p99_ms),
            "half_rate_per_s": rounded(half.per_s, 1),
            "half_rate_p50_ms": rounded(half.p50_ms),
            "half_rate_p95_ms": rounded(half.p95_ms),
            "half_rate_p99_ms": rounded(half.p99_ms),
            "pgbench_tps": {str(c): rounded(t, 1) for c, t in r["pgbench"].items()},
            "pgbench_runs": {
                str(c): [rounded(t, 1) for t in v] for c, v in r["pgbench_runs"].items()
            },
            "max_rate_runs": [rounded(x, 1) for x in r["top_runs"]],
            "cpu_us_per_callback": {
                side: None if us is None else rounded(us, 1) for side, us in top.cpu_us.items()
            },
            "pgbench_client_cpu_us_per_tx": rounded(r["pgbench_client_cpu_us"], 1),
            "repeats": opts.repeats,
            "connections": opts.connections,
            "path": opts.path,
            "http": _http_impl(opts.http) if opts.path == "asgi" else "httptools (lean)",
            "loop": opts.loop,
            "client_processes": opts.client_processes,
            "server_processes": opts.server_processes,
            "stored_rows": r["stored"],
            "answered_204": r["accepted"],
        }
    )


def run(settings: Settings, options: Mapping[str, str]) -> int:
    opts = _checked(options)
    r = _measured(settings, opts)
    _print_figures(opts, r)
    _print_json(opts, r)
    return 0 if r["stored"] == r["accepted"] else 1


__all__ = ["IngestOptions", "Phase", "client_main", "run", "server_main"]
