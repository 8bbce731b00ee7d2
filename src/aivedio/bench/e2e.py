"""``aivedio bench e2e``: signed webhook sent -> SSE frame read, through the deployment as the
README runs it, beside the naive reference, on one schedule.

In one invocation, on a scratch database (created, migrated, dropped) and a NATS server of the
run's own (``bus=private``; ``bus=configured``: a stream of the run's own on AIVEDIO_NATS_URL;
``bus_adapter=redis-streams``: Redis Streams on AIVEDIO_REDIS_URL, see ``e2e_deploy.run_bus``):

1. The deployment: the sandbox provider in its own process, and ``aivedio run --role all
   --reuse-port`` once per core (``processes``; ``split=1``: the HTTP roles per core and one
   process per background role), with ``AIVEDIO_GATEWAY_TIMING=1`` so frames carry where the
   time went.
2. Per scenario (``one``: one hot project; ``many``: ``projects`` projects): the tasks are created
   through the API, the submitter submits them to the sandbox, which holds them still
   (``params.sandbox.hold``); SSE clients in a process of their own open one stream per project
   (``clients_per_project``); a load generator in a process of its own sends signed webhooks for
   those generations through the real callback endpoint, open loop at each rate of ``rates`` for
   ``duration_s``, on the schedule of ``e2e_schedule`` (nothing may be coalesced or superseded).
   Per rate: achieved rate, latency p50/p90/p99/max, lost events, CPU per event of every process,
   and the stages.
3. The naive reference (``naive=1``): one uvicorn process that verifies, INSERTs, PUBLISHes and
   streams Redis to SSE, measured with the same load generator, clients and schedule.

The saturation rate is the highest rate whose p99 is within ``p99_limit_ms`` with nothing lost.
Figures are printed, then one JSON line (the headline keys at ``at_rate``, one project).
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import shutil
import sys
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import asyncpg

from aivedio.admin import create_project_in
from aivedio.bench.common import (
    BenchUsageError,
    build_options,
    database_url,
    print_json_line,
    scratch_database,
)
from aivedio.bench.e2e_clients import Stream
from aivedio.bench.e2e_deploy import (
    CpuMeter,
    Deployment,
    create_tasks,
    free_port,
    listening_pid,
    run_bus,
    wait_http,
    wait_polled,
    wait_submitted,
)
from aivedio.bench.e2e_load import Generation
from aivedio.bench.e2e_report import json_figures, print_figures
from aivedio.bench.e2e_run import Knobs, ScenarioFigures, Target, run_scenario, say
from aivedio.bench.e2e_schedule import parse_rates, per_task_limit, plan_tasks
from aivedio.config import Settings
from aivedio.runtime import resolve_urls
from aivedio.services.embedded import ServiceUrls

SANDBOX_KEY = "sk-bench-e2e"


@dataclass(frozen=True)
class E2EOptions:
    rates: str = "100,250,500,1000,1500,2000,3000"
    """Webhook events per second, one step each (open loop)."""
    duration_s: float = 10.0
    """Length of each step's sending."""
    scenarios: str = "one,many"
    """``one``: every task in one project; ``many``: tasks spread over ``projects`` projects."""
    projects: int = 100
    tasks: int = 0
    """Tasks per scenario at least (0: as many as the schedule needs, see e2e_schedule)."""
    min_gap_s: float = 1.0
    """One task's webhooks at least this far apart at the highest rate (more tasks if needed)."""
    processes: int = 0
    """aivedio processes (0: one per CPU); with ``split`` the HTTP roles' processes."""
    split: int = 0
    """1: one process per background role besides the HTTP processes."""
    naive: int = 1
    """1: measure the naive reference too."""
    aivedio: int = 1
    """0: the naive reference only (a quick look at the instrument and the machine)."""
    connections: int = 64
    """Load-generator connections (one webhook in flight each)."""
    clients_per_project: int = 1
    at_rate: float = 1000.0
    """The rate of the headline figures (the nearest rate run)."""
    p99_limit_ms: float = 100.0
    stop_p99_ms: float = 5000.0
    """From ``at_rate`` on, a step with a p99 above this ends the ramp (higher rates would only
    queue more)."""
    settle_s: float = 120.0
    """Longest wait for a step's frames, and for the chain to drain before the next step."""
    quiet_s: float = 12.0
    """A step missing frames ends when nothing arrived for this long after its last send:
    longer than the gateway's tail check (AIVEDIO_GATEWAY_TAILCHECK_S, 5 s), which brings a
    frame whose Redis message was lost."""
    bus: str = "private"
    """``private``: a NATS server of the run's own (its CPU is the run's alone);
    ``configured``: AIVEDIO_NATS_URL, with a stream and subject prefix of the run's own,
    deleted afterwards."""
    bus_adapter: str = "jetstream"
    """AIVEDIO_BUS of the deployment: ``jetstream`` (on the NATS ``bus`` says) or
    ``redis-streams`` (on AIVEDIO_REDIS_URL, keys under a prefix of the run's own, deleted
    afterwards; ``bus`` is then unused)."""
    create_concurrency: int = 32
    db_pool_max: int = 0
    """AIVEDIO_DB_POOL_MAX for every aivedio process (0: as configured, 10 by default). With
    split=1 the processes' pools add up: keep them under the server's max_connections."""
    idle_s: float = 3.0
    """Before each ramp, the idle CPU of every process is measured over this long."""
    log_level: str = "INFO"
    keep_logs: int = 0
    """1: keep the run's directory (process logs) and print where it is."""


def run(settings: Settings, options: Mapping[str, str]) -> int:
    opts = build_options(E2EOptions, options)
    try:
        rates = parse_rates(opts.rates)
    except ValueError as exc:
        raise BenchUsageError(str(exc)) from None
    scenarios = [s.strip() for s in opts.scenarios.split(",") if s.strip()]
    if not scenarios or set(scenarios) - {"one", "many"}:
        raise BenchUsageError("scenarios is one, many or one,many")
    if opts.bus not in ("private", "configured"):
        raise BenchUsageError("bus is private or configured")
    if opts.bus_adapter not in ("jetstream", "redis-streams"):
        raise BenchUsageError("bus_adapter is jetstream or redis-streams")
    if min(opts.duration_s, opts.projects, opts.connections, opts.clients_per_project) <= 0:
        raise BenchUsageError("duration_s, projects, connections, clients_per_project > 0")
    if opts.processes == 0:
        opts = replace(opts, processes=os.cpu_count() or 1)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        figures = runner.run(_main(settings, opts, rates, scenarios))
    print_figures(figures)
    line = json_figures(figures)
    print_json_line(line)
    return 0 if line["lost_total"] == 0 else 1


async def _main(
    settings: Settings, opts: E2EOptions, rates: list[float], scenarios: list[str]
) -> dict[str, Any]:
    points = settings.coalesce_min_points
    tasks = plan_tasks(rates, opts.duration_s, points, opts.min_gap_s, opts.tasks)
    knobs = Knobs(opts.duration_s, points, opts.connections, opts.settle_s, opts.quiet_s,
                  opts.stop_p99_ms, opts.at_rate, opts.idle_s)  # fmt: skip
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    urls = await asyncio.to_thread(resolve_urls, settings)
    run_dir = Path(tempfile.mkdtemp(prefix="aivedio-bench-e2e-"))
    figures: dict[str, Any] = {
        "options": asdict(opts),
        "rates": rates,
        "points": points,
        "per_task": per_task_limit(points),
        "cpus": os.cpu_count(),
        "load": os.getloadavg(),
        "aivedio": {},
        "naive": {},
    }
    print(
        f"e2e bench: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; rates {rates}"
        f" x {opts.duration_s:g} s; {tasks} tasks per scenario; bus {_bus_label(opts)};"
        f" logs in {run_dir}",
        flush=True,
    )
    try:
        async with scratch_database(database_url(settings), "aivedio_bench_e2e") as db_url:
            conn = await asyncpg.connect(db_url)
            try:
                if opts.aivedio:
                    await _aivedio(settings, opts, urls, conn, db_url, secret, run_dir,
                                   rates, knobs, scenarios, tasks, figures)  # fmt: skip
                if opts.naive:
                    for scenario in scenarios:
                        figures["naive"][scenario] = await _naive(
                            conn, db_url, urls.redis_url, opts, scenario, tasks, secret,
                            rates, knobs, run_dir,
                        )  # fmt: skip
            finally:
                await conn.close()
    finally:
        if not opts.keep_logs:
            shutil.rmtree(run_dir, ignore_errors=True)
    figures["load_end"] = os.getloadavg()
    return figures


async def _aivedio(
    settings: Settings,
    opts: E2EOptions,
    urls: ServiceUrls,
    conn: asyncpg.Connection,
    db_url: str,
    secret: str,
    run_dir: Path,
    rates: list[float],
    knobs: Knobs,
    scenarios: list[str],
    tasks: int,
    figures: dict[str, Any],
) -> None:
    """The deployment up, every scenario through the ramp, the deployment down."""
    tag = uuid.uuid4().hex[:8]
    private = opts.bus == "private"
    async with run_bus(urls, run_dir / "services", private, tag, opts.bus_adapter) as bus:
        nats = bus.url if bus.adapter == "jetstream" else None
        port, sandbox_port = free_port(), free_port()
        env = _env(settings, opts, db_url, urls.redis_url, bus.url, secret, run_dir) | bus.env()
        env["AIVEDIO_SANDBOX_URL"] = f"http://127.0.0.1:{sandbox_port}"
        deployment = Deployment(port, sandbox_port, env, run_dir)
        try:
            await deployment.start_sandbox()
            await deployment.start(opts.processes, bool(opts.split))
            figures["layout"] = [name for name, _ in deployment.procs]
            say(f"deployment up: {figures['layout']}")
            meter = _meter(conn, urls.redis_url, nats, deployment)
            for scenario in scenarios:
                target = await _aivedio_target(
                    conn, deployment, meter, opts, scenario, tasks, secret
                )
                figures["aivedio"][scenario] = await _run(target, rates, knobs, "aivedio", scenario)
        finally:
            await deployment.stop()


def _env(
    settings: Settings,
    opts: E2EOptions,
    db_url: str,
    redis_url: str,
    nats_url: str,
    secret: str,
    run_dir: Path,
) -> dict[str, str]:
    return (
        os.environ
        | {
            "AIVEDIO_DATABASE_URL": db_url,
            "AIVEDIO_REDIS_URL": redis_url,
            "AIVEDIO_NATS_URL": nats_url,
            "AIVEDIO_SANDBOX_API_KEY": SANDBOX_KEY,
            "AIVEDIO_SANDBOX_WEBHOOK_SECRETS": secret,
            "AIVEDIO_SECRET_KEY": secrets.token_hex(32),
            "AIVEDIO_DATA_DIR": str(run_dir / "data"),
            "AIVEDIO_GATEWAY_TIMING": "1",
            "AIVEDIO_LOG_LEVEL": opts.log_level,
            "AIVEDIO_COALESCE_MIN_POINTS": str(settings.coalesce_min_points),
        }
        | ({"AIVEDIO_DB_POOL_MAX": str(opts.db_pool_max)} if opts.db_pool_max > 0 else {})
    )


def _bus_label(opts: E2EOptions) -> str:
    if opts.bus_adapter == "redis-streams":
        return "redis-streams (AIVEDIO_REDIS_URL)"
    return f"jetstream ({opts.bus} NATS)"


def _meter(
    conn: asyncpg.Connection, redis_url: str, nats_url: str | None, dep: Deployment
) -> CpuMeter:
    groups: dict[str, list[int]] = dict(dep.role_pids())
    groups["sandbox"] = [dep.sandbox.pid] if dep.sandbox else []
    for name, url in (("nats", nats_url), ("redis", redis_url)):
        pid = listening_pid(url) if url else None
        groups[name] = [pid] if pid else []
    return CpuMeter(groups, conn)


async def _run(
    target: Target, rates: list[float], knobs: Knobs, system: str, scenario: str
) -> ScenarioFigures:
    say(
        f"{system}, scenario {scenario}: {len(target.table)} tasks in "
        f"{len({s.project_id for s in target.streams})} project(s)"
    )
    return await run_scenario(target, rates, knobs)


async def _aivedio_target(
    conn: asyncpg.Connection,
    dep: Deployment,
    meter: CpuMeter,
    opts: E2EOptions,
    scenario: str,
    tasks: int,
    secret: str,
) -> Target:
    count = 1 if scenario == "one" else opts.projects
    made = [await create_project_in(conn, "bench-e2e", f"{scenario}-{i}") for i in range(count)]
    projects = [(str(m["project_id"]), str(m["api_key"])) for m in made]
    task_ids, resent = await create_tasks(dep.base, projects, tasks, opts.create_concurrency)
    again = f" ({resent} requests sent again)" if resent else ""
    say(f"{len(task_ids)} tasks created through the API in {count} project(s){again}")
    rows = await wait_submitted(conn, task_ids, 120 + tasks / 20)
    say("every task's generation is at the sandbox, held still")
    left, waited = await wait_polled(conn, task_ids, 60 + tasks / 40)
    say(f"the poller's first poll of each task done in {waited:.0f} s ({left} not polled yet)")
    table = []
    for t in task_ids:
        row = rows[t]
        echoed = {"client_request_id": row["client_request_id"], "attempt_id": row["attempt_id"]}
        table.append(Generation(row["provider_task_id"], echoed))  # what the sandbox echoes
    per = range(opts.clients_per_project)
    streams = [Stream(p, f"Bearer {k}") for p, k in projects for _ in per]
    sandbox = f"http://127.0.0.1:{dep.sandbox_port}"
    return Target(dep.port, table, task_ids, streams, meter, [secret], conn, sandbox, SANDBOX_KEY)


async def _naive(
    conn: asyncpg.Connection,
    db_url: str,
    redis_url: str,
    opts: E2EOptions,
    scenario: str,
    tasks: int,
    secret: str,
    rates: list[float],
    knobs: Knobs,
    run_dir: Path,
) -> ScenarioFigures:
    port = free_port()
    channel = f"aivedio-bench-naive-{uuid.uuid4().hex[:8]}"
    log = (run_dir / f"naive-{scenario}.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aivedio.bench.e2e_naive", "--port", str(port),
        "--database-url", db_url, "--redis-url", redis_url, "--channel", channel,
        "--secret", secret, stdout=log, stderr=log, stdin=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    log.close()
    try:
        await wait_http(f"http://127.0.0.1:{port}/healthz", proc, 60)
        count = 1 if scenario == "one" else opts.projects
        projects = [str(uuid.uuid4()) for _ in range(count)]
        task_ids = [str(uuid.uuid4()) for _ in range(tasks)]
        table = [
            Generation(f"gen_{uuid.uuid4().hex[:24]}", {"client_request_id": uuid.uuid4().hex,
                       "project_id": projects[i % count], "task_id": t})
            for i, t in enumerate(task_ids)
        ]  # fmt: skip
        streams = [Stream(p, None) for p in projects for _ in range(opts.clients_per_project)]
        pid = listening_pid(redis_url)
        meter = CpuMeter({"naive": [proc.pid], "redis": [pid] if pid else []}, conn)
        target = Target(port, table, task_ids, streams, meter, [secret])
        return await _run(target, rates, knobs, "naive", scenario)
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()
