"""``aivedio bench connections``: many idle SSE connections on one gateway process.

The gateway runs in a process of its own (``gateway_server``) against a scratch database and a
private Redis channel; ``procs`` client processes open ``connections`` SSE streams to one project
with ``Authorization: Bearer <api_key>`` (raw asyncio sockets, see ``sse_load.py``). A connection
counts once its ``: start`` comment arrived (authenticated, subscribed, live).

- RSS: the gateway's VmRSS before the first connection and ``settle_s`` after the last one;
  ``rss_per_conn_kib = (after - before) / connections`` (target <= 4 KiB).
- Heartbeats: with the gateway's heartbeat at ``heartbeat_s``, every connection is held for
  ``hold_s``; a connection is on time when no gap between the start of the hold, its ``: ping``
  arrivals and the end of the hold exceeds ``heartbeat_s + slack_s``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aivedio.bench.common import BenchUsageError, build_options, print_json_line, rounded
from aivedio.bench.sse_load import FDS_PER_PROCESS, Ready, Report, fleet, gateway_under_test
from aivedio.config import Settings

__all__ = ["run"]

TARGET_KIB = 4.0


@dataclass(frozen=True, slots=True)
class Options:
    connections: int = 10_000
    procs: int = 4
    hold_s: float = 30.0
    heartbeat_s: float = 5.0
    loop: str = "asyncio"  # the gateway process's event loop: asyncio or uvloop
    slack_s: float = 1.0
    settle_s: float = 3.0

    def check(self) -> None:
        if self.loop not in ("asyncio", "uvloop"):
            raise BenchUsageError("loop is asyncio or uvloop")
        if self.connections < 1 or self.procs < 1:
            raise BenchUsageError("connections and procs must be at least 1")
        if math.ceil(self.connections / self.procs) > FDS_PER_PROCESS:
            raise BenchUsageError(
                f"at most {FDS_PER_PROCESS} connections per client process: raise procs"
            )
        if self.connections > FDS_PER_PROCESS:
            raise BenchUsageError(f"one gateway process holds at most {FDS_PER_PROCESS}")
        if self.hold_s < 0 or self.heartbeat_s < 1 or self.slack_s < 0 or self.settle_s < 0:
            raise BenchUsageError("hold_s, slack_s, settle_s >= 0 and heartbeat_s >= 1")


def run(settings: Settings, options: Mapping[str, str]) -> int:
    opts = build_options(Options, options)
    opts.check()
    return asyncio.run(_run(settings, opts))


async def _run(settings: Settings, opts: Options) -> int:
    print(
        f"connections: {opts.connections} SSE streams from {opts.procs} client processes to one "
        f"gateway process (heartbeat {opts.heartbeat_s:g} s), held {opts.hold_s:g} s",
        flush=True,
    )
    figures: dict[str, Any] = {"bench": "connections", "gateway_loop": opts.loop}
    async with gateway_under_test(settings, opts.heartbeat_s, opts.loop) as target:
        gateway = target.gateway
        print(f"  gateway: pid {target.gateway.pid}, port {target.gateway.port}", flush=True)
        await asyncio.sleep(1.0)  # the pool, the subscription and the wheel are up
        m = _Measured(rss_before=gateway.rss_kib())
        cpu_before = gateway.cpu_s()
        async with fleet(target, opts.connections, opts.procs, record_events=False) as clients:
            ready = await clients.connect()
            m.cpu_connect = gateway.cpu_s() - cpu_before
            await asyncio.sleep(opts.settle_s)
            m.rss_after = gateway.rss_kib()
            m.open_files = gateway.open_files()
            print(
                f"  connected {ready.established} of {opts.connections} in {ready.seconds:.1f} s "
                f"({ready.failed} failed{_failures(ready.failures)}); gateway CPU for the "
                f"connects {m.cpu_connect:.2f} s; open files {m.open_files}",
                flush=True,
            )
            m.hold_from = time.time()
            cpu_hold = gateway.cpu_s()
            await asyncio.sleep(opts.hold_s)
            m.hold_to = time.time()
            m.cpu_hold = gateway.cpu_s() - cpu_hold
            m.rss_held = gateway.rss_kib()
            report = await clients.stop()
    figures |= _figures(opts, ready, report, m)
    print_json_line(figures)
    return 0 if figures["ok"] else 1


@dataclass(slots=True)
class _Measured:
    """What one run measured of the gateway process."""

    rss_before: int
    cpu_connect: float = 0.0
    rss_after: int = 0
    open_files: int = 0
    hold_from: float = 0.0
    hold_to: float = 0.0
    cpu_hold: float = 0.0
    rss_held: int = 0


def _figures(opts: Options, ready: Ready, report: Report, m: _Measured) -> dict[str, Any]:
    """Print the run's figures and return them for the JSON line."""
    rss_before, rss_after, rss_held, cpu_hold = m.rss_before, m.rss_after, m.rss_held, m.cpu_hold
    established = ready.established
    per_conn = (rss_after - rss_before) / established if established else math.nan
    per_conn_held = (rss_held - rss_before) / established if established else math.nan
    beats = _heartbeats(report, m.hold_from, m.hold_to, opts)
    print(
        f"  gateway RSS: {rss_before / 1024:.1f} MiB before, {rss_after / 1024:.1f} MiB with "
        f"{established} connections, {rss_held / 1024:.1f} MiB after the hold",
        flush=True,
    )
    print(
        f"  RSS per connection: {per_conn:.2f} KiB (target <= {TARGET_KIB:g} KiB: "
        f"{'met' if per_conn <= TARGET_KIB else 'NOT met'}); after the hold "
        f"{per_conn_held:.2f} KiB",
        flush=True,
    )
    print(
        f"  heartbeats: {beats['on_time']:.4f} of the connections on time over {opts.hold_s:g} s "
        f"(max gap {beats['max_gap']:.2f} s, allowed {opts.heartbeat_s + opts.slack_s:g} s; "
        f"pings per connection {beats['min_pings']}..{beats['max_pings']}); gateway CPU during "
        f"the hold {cpu_hold / max(opts.hold_s, 1e-9) * 100:.1f} % of one core; "
        f"streams closed by the server {report.lost}",
        flush=True,
    )
    return {
        "connections": established,
        "failed": ready.failed,
        "procs": opts.procs,
        "rss_per_conn_kib": rounded(per_conn, 2),
        "rss_per_conn_after_hold_kib": rounded(per_conn_held, 2),
        "target_kib": TARGET_KIB,
        "rss_before_kib": rss_before,
        "rss_after_kib": rss_after,
        "heartbeats_on_time": rounded(beats["on_time"], 4),
        "heartbeat_max_gap_s": rounded(beats["max_gap"], 3),
        "heartbeat_s": opts.heartbeat_s,
        "hold_s": opts.hold_s,
        "pings_per_conn_min": beats["min_pings"],
        "pings_per_conn_max": beats["max_pings"],
        "connect_s": rounded(ready.seconds, 2),
        "gateway_cpu_connect_s": rounded(m.cpu_connect, 2),
        "gateway_cpu_hold_pct": rounded(cpu_hold / max(opts.hold_s, 1e-9) * 100, 1),
        "gateway_open_files": m.open_files,
        "closed_by_server": report.lost,
        "ok": established == opts.connections and report.lost == 0,
    }


def _heartbeats(report: Report, start: float, end: float, opts: Options) -> dict[str, Any]:
    allowed = opts.heartbeat_s + opts.slack_s
    on_time = 0
    max_gap = 0.0
    counts: list[int] = []
    for pings in report.pings:
        marks = [start, *(t for t in pings if start <= t <= end), end]
        gap = max(b - a for a, b in itertools.pairwise(marks))
        max_gap = max(max_gap, gap)
        on_time += gap <= allowed
        counts.append(len(marks) - 2)
    total = len(report.pings)
    return {
        "on_time": on_time / total if total else math.nan,
        "max_gap": max_gap if total else math.nan,
        "min_pings": min(counts, default=0),
        "max_pings": max(counts, default=0),
    }


def _failures(failures: Mapping[str, int]) -> str:
    if not failures:
        return ""
    top = sorted(failures.items(), key=lambda kv: -kv[1])[:3]
    return ": " + ", ".join(f"{reason} x{n}" for reason, n in top)
