"""``aivedio bench NAME [key=value ...]``: benchmarks that print figures, then one JSON line last.

Each benchmark is a module with ``run(settings, options) -> int``; ``BENCHMARKS`` maps its name to
that function. A new benchmark is one module and one line here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

from aivedio.bench.common import BenchUsageError, parse_options
from aivedio.bench.connections import run as run_connections
from aivedio.bench.e2e import run as run_e2e
from aivedio.bench.fanout import run as run_fanout
from aivedio.bench.ingest import run as run_ingest
from aivedio.bench.polling import run as run_polling
from aivedio.bench.propagation import run as run_propagation
from aivedio.bench.retention import run as run_retention
from aivedio.bench.transitions import run as run_transitions
from aivedio.config import Settings

Benchmark = Callable[[Settings, Mapping[str, str]], int]

BENCHMARKS: dict[str, Benchmark] = {
    "transitions": run_transitions,
    "ingest": run_ingest,
    "propagation": run_propagation,
    "connections": run_connections,
    "fanout": run_fanout,
    "polling": run_polling,
    "e2e": run_e2e,
    "retention": run_retention,
}


def run_bench(settings: Settings, name: str, options: list[str]) -> int:
    """Run the benchmark ``name`` with ``key=value`` options; 2 for a usage error."""
    bench = BENCHMARKS.get(name)
    if bench is None:
        known = ", ".join(sorted(BENCHMARKS))
        print(f"unknown benchmark {name!r}; known: {known}", file=sys.stderr)
        return 2
    try:
        return bench(settings, parse_options(options))
    except BenchUsageError as exc:
        print(f"bench {name}: {exc}", file=sys.stderr)
        return 2


__all__ = ["BENCHMARKS", "run_bench"]
