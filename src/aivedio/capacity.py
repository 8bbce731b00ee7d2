"""``aivedio capacity``: a deployment plan from measured per-unit costs (seed §12.11).

The workload follows the seed's method: tasks arrive at ``tasks_per_s`` (lambda) and stay
``duration_s`` (W) at the provider, so ``in_flight = lambda * W`` (Little's law); each makes
``events_per_task`` meaningful events, and the peak is ``peak_factor`` times the mean
(60 tasks/s, 120 s, 6 events, x3: 7,200 in flight and 1,080 events/s, the seed's example).
``events_per_s`` replaces that peak with a rate of the user's own.

The costs are measured, never assumed: CPU microseconds per event of every process group and
PostgreSQL write transactions per event from an ``aivedio bench e2e`` JSON line (``e2e=FILE``, or
``measure=1`` runs a short one), bytes per SSE connection from ``aivedio bench connections``
(``connections=FILE``) and frames per second of one gateway process from ``aivedio bench
fanout`` (``fanout=FILE``). Every figure of the plan names the measured figure it came from;
what was not measured is printed as unknown with the command that measures it. Message counts
on NATS and Redis follow from the topology (every event is published once; a status change is
delivered to each consumer group, a progress-only event to the dispatcher alone; the dispatcher
publishes it once per gateway node in broadcast fan-out), and say so. Everything here is
arithmetic on those figures; :func:`plan` does no I/O.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aivedio.bench.common import BenchUsageError, build_options, parse_options, print_json_line

GROUPS = ("dispatcher", "media", "billing")
"""The bus's consumer groups: each receives every status change (``task.status``); the
dispatcher alone receives the progress-only events (``task.progress``)."""
HEARTBEAT_BYTES = 150  # seed §12.11.3: 100-200 bytes per heartbeat with protocol overhead
MEASURE = ["rates=250,500", "duration_s=5", "scenarios=one", "naive=0"]
"""``measure=1``: the short ``bench e2e`` run (below saturation on the CI machine)."""


@dataclass(frozen=True, slots=True)
class Options:
    e2e: str = ""
    """A file holding the JSON line of ``aivedio bench e2e`` (its last line is read)."""
    measure: int = 0
    """1: run ``aivedio bench e2e`` (MEASURE) now and plan from it."""
    connections: str = ""
    fanout: str = ""
    tasks_per_s: float = 60.0
    duration_s: float = 120.0
    events_per_task: float = 6.0
    peak_factor: float = 3.0
    events_per_s: float = 0.0
    """0: tasks_per_s * events_per_task * peak_factor."""
    sse_connections: int = 100_000
    heartbeat_s: float = 25.0
    fanout_per_event: float = 1.3
    event_bytes: int = 500
    progress_share: float = 0.0
    """The share of the events that move only the progress (topic ``task.progress``, read by
    the dispatcher alone); 0 plans for every event reaching every group."""
    poll_interval_s: float = 15.0
    utilization: float = 0.6
    """Plan every process and server for at most this share of its cores."""
    node_memory_gib: float = 4.0
    """Memory of one gateway node given to connections."""
    gateway_nodes_spare: int = 1
    """Nodes beyond the computed count, for a node's failure and rolling restarts (N+1)."""


def last_json_line(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            value = json.loads(line)
            if isinstance(value, dict):
                return value
    raise BenchUsageError("no JSON line found (expected the output of aivedio bench ...)")


def _cores(us_per_event: float, events_per_s: float, utilization: float) -> float:
    return us_per_event * events_per_s / 1e6 / utilization


def plan(
    opts: Options,
    e2e: Mapping[str, Any],
    connections: Mapping[str, Any] | None = None,
    fanout: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The plan for ``opts``' workload from the measured figures (pure)."""
    workload = _workload(opts)
    peak: float = workload["events_per_s_peak"]
    source = (
        f"bench e2e at {e2e.get('rate_per_s')}/s ({e2e.get('procs')} processes "
        f"{e2e.get('layout')}, p99 {e2e.get('p99_ms')} ms, lost {e2e.get('lost')})"
    )
    cpu: Mapping[str, float] = e2e.get("cpu_us_per_event_by_process") or {}
    if not cpu:
        raise BenchUsageError("the bench e2e JSON has no cpu_us_per_event_by_process")
    warnings: list[str] = []
    if e2e.get("lost") or (e2e.get("p99_ms") or math.inf) > 100:
        warnings.append(
            "the measured step was not keeping up (p99 > 100 ms or events lost): costs per "
            "event measured under saturation are lower than below it (bigger batches)"
        )
    servers = _servers(opts, cpu, peak, source)
    roles = _roles(opts, cpu, peak, source)
    xacts = e2e.get("pg_write_xacts_per_event")
    postgres_tx = {
        "per_s": xacts * peak if xacts is not None else None,
        "per_event": xacts,
        "from": f"pg_write_xacts_per_event of {source}"
        if xacts is not None
        else "unknown: the bench e2e JSON predates pg_write_xacts_per_event",
    }
    gateway = _gateway(opts, workload["frames_per_s"], connections, fanout)
    redis = {
        "publishes_per_s": peak,
        "deliveries_per_s_broadcast": peak * gateway["nodes"] if gateway["nodes"] else None,
        "from": "topology: the dispatcher publishes each event once (AIVEDIO_FANOUT=broadcast: "
        "every gateway node receives it; node: only the nodes with the project's streams)",
    }
    saturation = e2e.get("saturation_per_s")
    if saturation is not None and not math.isnan(saturation) and peak > saturation:
        warnings.append(
            f"the peak {peak:g}/s is above the measured saturation {saturation:g}/s (the "
            f"highest rate with p99 <= 100 ms and nothing lost) of {e2e.get('procs')} "
            "processes: the plan's cores are a lower bound; measure at the planned size"
        )
    return {
        "workload": workload,
        "cores": sum(s["cores"] for s in servers.values()),
        "servers": servers,
        "roles": roles,
        "postgres_transactions": postgres_tx,
        "nats": _nats(peak, opts.progress_share),
        "redis": redis,
        "gateway": gateway,
        "warnings": warnings,
        "measured": {"e2e": source, "saturation_per_s": saturation},
        "options": asdict(opts),
    }


def _nats(peak: float, progress_share: float) -> dict[str, Any]:
    """JetStream messages and acks per second: one publish per event, one delivery per group
    of its topic (every group for a status change, the dispatcher for a progress one)."""
    groups = len(GROUPS)
    deliveries = peak * (groups - (groups - 1) * progress_share)
    return {
        "messages_per_s": peak + deliveries,
        "acks_per_s": peak + deliveries,
        "from": f"topology: one publish per event, a status change delivered to {groups} groups "
        f"{list(GROUPS)}, a progress-only event ({progress_share:.0%} of them, progress_share) "
        "to the dispatcher alone",
    }


def _workload(opts: Options) -> dict[str, Any]:
    """The workload ``opts`` describe, in tasks, events, frames and bytes per second."""
    in_flight = opts.tasks_per_s * opts.duration_s
    mean = opts.tasks_per_s * opts.events_per_task
    peak = opts.events_per_s or mean * opts.peak_factor
    heartbeats = opts.sse_connections / opts.heartbeat_s
    frames = peak * opts.fanout_per_event + heartbeats
    return {
        "tasks_per_s": opts.tasks_per_s,
        "duration_s": opts.duration_s,
        "in_flight": in_flight,
        "events_per_s_mean": mean,
        "events_per_s_peak": peak,
        "poll_qps_if_every_task_polled": in_flight / opts.poll_interval_s,
        "sse_connections": opts.sse_connections,
        "heartbeats_per_s": heartbeats,
        "frames_per_s": frames,
        "egress_bytes_per_s": peak * opts.fanout_per_event * opts.event_bytes
        + heartbeats * HEARTBEAT_BYTES,
    }


def _servers(opts: Options, cpu: Mapping[str, float], peak: float, source: str) -> dict[str, Any]:
    """Cores per server process (aivedio as a whole, postgres, nats, redis)."""
    servers: dict[str, Any] = {}
    for name in ("aivedio", "postgres", "nats", "redis"):
        if name in cpu:
            servers[name] = {
                "cpu_us_per_event": cpu[name],
                "cores": _cores(cpu[name], peak, opts.utilization),
                "from": f"cpu_us_per_event_by_process.{name} of {source}",
            }
    return servers


def _roles(opts: Options, cpu: Mapping[str, float], peak: float, source: str) -> dict[str, Any]:
    """Cores and processes per aivedio role (``aivedio-*-<role>`` figures summed)."""
    roles: dict[str, Any] = {}
    for key, us in cpu.items():
        if key.startswith("aivedio-"):
            role = key.split("-", 2)[-1]
            entry = roles.setdefault(role, {"cpu_us_per_event": 0.0})
            entry["cpu_us_per_event"] += us
    for role, entry in roles.items():
        cores = _cores(entry["cpu_us_per_event"], peak, opts.utilization)
        entry["cores"] = cores
        # One Python process runs on one core: at most `utilization` of it.
        entry["processes"] = max(1, math.ceil(cores))
        entry["from"] = f"cpu_us_per_event_by_process['aivedio-*-{role}'] of {source}"
    return roles


def _gateway(
    opts: Options,
    frames: float,
    connections: Mapping[str, Any] | None,
    fanout: Mapping[str, Any] | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes_by_memory": None, "nodes_by_frames": None}
    if connections and connections.get("rss_per_conn_kib"):
        kib = float(connections["rss_per_conn_kib"])
        budget_kib = opts.node_memory_gib * 1024 * 1024 * opts.utilization
        out["nodes_by_memory"] = math.ceil(opts.sse_connections * kib / budget_kib)
        out["memory_from"] = f"rss_per_conn_kib {kib} of bench connections"
    else:
        out["memory_from"] = "unknown: give connections=FILE (aivedio bench connections)"
    if fanout and fanout.get("frames_per_s"):
        per_node = float(fanout["frames_per_s"])
        out["nodes_by_frames"] = math.ceil(frames / (per_node * opts.utilization))
        out["frames_from"] = f"frames_per_s {per_node} of bench fanout (one gateway process)"
    else:
        out["frames_from"] = "unknown: give fanout=FILE (aivedio bench fanout)"
    known = [n for n in (out["nodes_by_memory"], out["nodes_by_frames"]) if n is not None]
    out["nodes"] = max(known) + opts.gateway_nodes_spare if known else None
    return out


def _read(path: str) -> dict[str, Any]:
    try:
        return last_json_line(Path(path).read_text())
    except OSError as exc:
        raise BenchUsageError(f"cannot read {path}: {exc.strerror}") from None


def _measure() -> dict[str, Any]:
    print(f"measuring: aivedio bench e2e {' '.join(MEASURE)}", flush=True)
    done = subprocess.run(  # noqa: S603 (our own interpreter and fixed arguments)
        [sys.executable, "-m", "aivedio", "bench", "e2e", *MEASURE],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode not in (0, 1):  # 1: something was lost; the figures still print
        raise BenchUsageError(f"bench e2e failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return last_json_line(done.stdout)


def _print(result: Mapping[str, Any]) -> None:
    w = result["workload"]
    print(
        f"workload: {w['tasks_per_s']:g} tasks/s x {w['duration_s']:g} s = "
        f"{w['in_flight']:,.0f} in flight (Little's law); {w['events_per_s_mean']:,.0f} events/s "
        f"mean, {w['events_per_s_peak']:,.0f} at the peak; {w['sse_connections']:,} SSE "
        f"connections: {w['heartbeats_per_s']:,.0f} heartbeats/s, {w['frames_per_s']:,.0f} "
        f"frames/s, {w['egress_bytes_per_s'] / 1e6:.2f} MB/s out; polling every in-flight task "
        f"would be {w['poll_qps_if_every_task_polled']:,.0f} queries/s"
    )
    print(f"measured: {result['measured']['e2e']}")
    print(f"  cores in all, at {result['options']['utilization']:.0%} use: {result['cores']:.2f}")
    for name, s in result["servers"].items():
        print(f"  {name:<9} {s['cpu_us_per_event']:8.0f} us/event -> {s['cores']:6.2f} cores")
    for role, r in result["roles"].items():
        print(f"  role {role:<14} {r['processes']:3d} process(es) ({r['cores']:.2f} cores)")
    tx = result["postgres_transactions"]
    if tx["per_s"] is not None:
        print(f"  PostgreSQL {tx['per_s']:,.0f} write transactions/s ({tx['per_event']} per event)")
    print(f"  NATS {result['nats']['messages_per_s']:,.0f} messages/s ({result['nats']['from']})")
    print(f"  Redis {result['redis']['publishes_per_s']:,.0f} publishes/s")
    g = result["gateway"]
    print(
        f"  gateway nodes: {g['nodes'] if g['nodes'] is not None else 'unknown'} (by memory "
        f"{g['nodes_by_memory']}: {g['memory_from']}; by frames {g['nodes_by_frames']}: "
        f"{g['frames_from']}; +{result['options']['gateway_nodes_spare']} spare)"
    )
    for warning in result["warnings"]:
        print(f"  warning: {warning}")


def run_capacity(args: Sequence[str]) -> int:
    opts = build_options(Options, parse_options(args))
    if bool(opts.e2e) == bool(opts.measure):
        raise BenchUsageError("give exactly one of e2e=FILE (a bench e2e output) or measure=1")
    e2e = _read(opts.e2e) if opts.e2e else _measure()
    if e2e.get("bench") != "e2e":
        raise BenchUsageError("e2e=FILE must hold the output of aivedio bench e2e")
    connections = _read(opts.connections) if opts.connections else None
    fanout = _read(opts.fanout) if opts.fanout else None
    result = plan(opts, e2e, connections, fanout)
    _print(result)
    print_json_line({"capacity": "plan", **result})
    return 0
