"""Commands that report figures: benchmarks, a capacity plan, the live status view."""

from __future__ import annotations

import argparse
import asyncio
import sys

from aivedio.cli.common import Subcommands
from aivedio.config import Settings


def add_bench(sub: Subcommands) -> None:
    """``aivedio bench NAME key=value ...``."""
    bench = sub.add_parser("bench", help="benchmarks; the last line printed is JSON")
    bench.add_argument("name")
    bench.add_argument("options", nargs="*", help="key=value options of the benchmark")
    bench.set_defaults(func=_bench)


def _bench(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.bench import run_bench

    code: int = run_bench(settings, args.name, args.options)
    return code


def add_capacity(sub: Subcommands) -> None:
    """``aivedio capacity key=value ...``."""
    capacity = sub.add_parser(
        "capacity", help="a deployment plan from measured figures; the last line is JSON"
    )
    capacity.add_argument(
        "options", nargs="*", help="key=value: e2e=FILE or measure=1, workload (see the docs)"
    )
    capacity.set_defaults(func=_capacity)


def _capacity(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.bench.common import BenchUsageError
    from aivedio.capacity import run_capacity

    try:
        return run_capacity(args.options)
    except BenchUsageError as exc:
        print(f"capacity: {exc}", file=sys.stderr)
        return 2


def add_status(sub: Subcommands) -> None:
    """``aivedio status``: the live view."""
    status = sub.add_parser(
        "status",
        help="live view: backlogs, tasks in flight, connections, lags, dead letters, "
        "reconciliation items",
    )
    status.add_argument(
        "--once", action="store_true", help="print one frame, then its figures as JSON, and exit"
    )
    status.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    status.add_argument(
        "--metrics-url",
        action="append",
        default=None,
        help="a process's /metrics (repeat for each process; default: this host's AIVEDIO_PORT)",
    )
    status.set_defaults(func=_status)


def _status(args: argparse.Namespace, settings: Settings) -> int:
    """A live terminal view (or one frame with ``--once``) from PostgreSQL and ``/metrics``."""
    from aivedio.admin import resolve_database_url
    from aivedio.status import run_status

    urls = args.metrics_url or [f"http://127.0.0.1:{settings.port}/metrics"]
    try:
        return asyncio.run(
            run_status(
                resolve_database_url(settings), urls, once=args.once, interval_s=args.interval
            )
        )
    except KeyboardInterrupt:
        return 0
