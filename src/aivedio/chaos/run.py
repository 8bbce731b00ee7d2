"""``aivedio chaos``: a cluster on its own embedded services, every sandbox chaos knob on, a fault
schedule, browsers that resume by cursor, and the invariant table at the end.

The run owns its services: embedded PostgreSQL, Valkey and NATS (or a three-node NATS cluster) in
a fresh data folder, because it kills and restarts them; the cluster's processes reach
PostgreSQL, Valkey and the single NATS through TCP proxies that the run cuts. Phases:

1. start services, proxies and ``aivedio cluster`` (with the sandbox provider); turn every chaos
   knob on; create the projects; connect the clients (before any task, seed 004);
2. create the tasks over the first part of the fault window (each create retried with its
   ``Idempotency-Key`` until it is accepted: the API is down during some faults) while the
   fault schedule runs;
3. after the last fault, wait for convergence (every task final, as the provider's truth says);
4. wait for the clients to read up to each stream's head; check the invariants; print the table
   and one JSON line; exit 1 on any violation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from aivedio.admin import create_project_in
from aivedio.chaos import invariants
from aivedio.chaos.clients import SlowReader, StreamWatcher
from aivedio.chaos.proxy import TcpProxy
from aivedio.chaos.schedule import Fault, FaultKind, plan
from aivedio.cluster import Cluster, ClusterConfig
from aivedio.config import ServicesConfig, Settings
from aivedio.logs import log, setup_logging
from aivedio.services import embedded

__all__ = ["ChaosConfig", "run_chaos"]

logger = logging.getLogger("aivedio.chaos")

KNOBS: dict[str, Any] = {
    "duplicate_rate": 0.3,
    "reorder": 0.3,
    "delay_ms": [0, 300],
    "drop_rate": 0.1,
    "forge_signature_rate": 0.1,
    "stale_signature_rate": 0.1,
    "callback_before_submit_response": 0.3,
    "contradictory_terminal": 0.2,
    "query_429_rate": 0.1,
    "retry_after_s": 1,
    "query_5xx_rate": 0.1,
    "query_slow_ms": [0, 300],
}

# The cluster's processes run with these, so that a chaos run of a minute or two exercises what a
# production deployment sees over hours: leases shorter than a SIGSTOP, a quick stall eviction.
CLUSTER_ENV = {
    "AIVEDIO_GATEWAY_TAILCHECK_S": "2",
    "AIVEDIO_LOG_LEVEL": "INFO",
    # every lease and the bus's ack wait shorter than a SIGSTOP (stop_s, 8 s): the frozen
    # process's work is taken over, and its late writes must be fenced off when it wakes
    "AIVEDIO_INBOX_LEASE_S": "4",
    "AIVEDIO_POLL_LEASE_S": "4",
    "AIVEDIO_SUBMIT_LEASE_S": "4",
    "AIVEDIO_CANCEL_LEASE_S": "4",
    "AIVEDIO_MEDIA_LEASE_S": "4",
    "AIVEDIO_BUS_ACK_WAIT_S": "4",
}


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    seed: int = 1
    tasks: int = 40
    projects: int = 3
    replicas: int = 2
    split: bool = False
    nats_cluster: int = 0
    window_s: float = 60.0  # faults happen within this window
    interval_s: float = 6.0  # about one fault this often
    create_share: float = 0.6  # tasks are created over this share of the window
    converge_timeout_s: float = 180.0
    catch_up_timeout_s: float = 60.0
    kinds: tuple[FaultKind, ...] = tuple(FaultKind)
    data_dir: Path | None = None  # None: a temporary folder, removed after a passing run
    keep: bool = False  # keep the data folder (logs) even after a passing run


@dataclass
class Created:
    task_id: str
    project_id: str
    key: str
    client_request_id: str | None = None


@dataclass
class Run:
    config: ChaosConfig
    rng: random.Random
    folder: Path
    services: ServicesConfig
    settings: Settings
    proxies: dict[str, TcpProxy] = field(default_factory=dict)
    cluster: Cluster | None = None
    projects: list[dict[str, Any]] = field(default_factory=list)
    created: list[Created] = field(default_factory=list)
    faults_done: list[tuple[Fault, str]] = field(default_factory=list)
    last_fault_end: float = 0.0
    real_database_url: str = ""


# -- services, proxies, cluster -------------------------------------------------------------------


async def _start(run: Run) -> None:
    urls = await asyncio.to_thread(embedded.up, run.services)
    run.real_database_url = urls.database_url
    targets = {"postgres": urls.database_url, "redis": urls.redis_url}
    if not run.config.nats_cluster:
        targets["nats"] = urls.nats_url
    proxied: dict[str, str] = {}
    for name, url in targets.items():
        parts = httpx.URL(url)
        proxy = TcpProxy(parts.host, parts.port or 0)
        await proxy.start()
        run.proxies[name] = proxy
        proxied[name] = url.replace(f":{parts.port}", f":{proxy.port}", 1)
    update: dict[str, Any] = {
        "database_url": proxied["postgres"],
        "redis_url": proxied["redis"],
        "data_dir": run.folder,
    }
    if "nats" in proxied:
        update["nats_url"] = proxied["nats"]
    run.settings = run.settings.model_copy(update=update)
    port = _free_port()
    cluster = Cluster(
        run.settings,
        ClusterConfig(
            data_dir=run.folder,
            replicas=run.config.replicas,
            split=run.config.split,
            nats_cluster=run.config.nats_cluster,
            sandbox=True,
            port=port,
            extra_env=CLUSTER_ENV,
        ),
    )
    run.cluster = cluster
    await cluster.start()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _wait_ready(http: httpx.AsyncClient, url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get(url, timeout=2)).status_code == 200:
                return
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} did not become ready within {timeout_s:.0f} s")


async def _sandbox(run: Run) -> httpx.AsyncClient:
    assert run.cluster is not None
    assert run.cluster.sandbox_url is not None
    sandbox = httpx.AsyncClient(
        base_url=run.cluster.sandbox_url,
        headers={"Authorization": f"Bearer {run.settings.sandbox_api_key}"},
        timeout=10,
    )
    await _wait_ready(sandbox, "/healthz")
    knobs = KNOBS | {"seed": run.config.seed}
    (await sandbox.put("/_sandbox/chaos", json=knobs)).raise_for_status()
    return sandbox


async def _make_projects(run: Run) -> None:
    conn = await asyncpg.connect(run.real_database_url)
    try:
        for n in range(run.config.projects):
            run.projects.append(await create_project_in(conn, f"chaos-{n}", f"p{n}"))
    finally:
        await conn.close()


# -- tasks ----------------------------------------------------------------------------------------


def _script(rng: random.Random) -> dict[str, Any]:
    outcome = rng.choices(["succeeded", "failed", "canceled"], weights=[6, 2, 2])[0]
    if rng.random() < 0.3:  # a task that finishes in under a second
        return {"outcome": outcome, "queue_s": 0.1, "duration_s": 0.4, "steps": 2}
    return {
        "outcome": outcome,
        "queue_s": round(rng.uniform(0.1, 1.0), 2),
        "duration_s": round(rng.uniform(1.0, 6.0), 2),
        "steps": rng.randint(2, 5),
    }


async def _create_tasks(run: Run, http: httpx.AsyncClient, stopping: asyncio.Event) -> None:
    cfg = run.config
    spread = cfg.window_s * cfg.create_share
    for n in range(cfg.tasks):
        project = run.projects[n % len(run.projects)]
        key = f"chaos-{cfg.seed}-{n}"
        body = {
            "provider": "sandbox",
            "model": "sbx-1",
            "prompt": f"chaos task {n}",
            "params": {"sandbox": _script(run.rng)},
        }
        while not stopping.is_set():
            try:
                response = await http.post(
                    f"/v1/projects/{project['project_id']}/tasks",
                    json=body,
                    headers={
                        "Authorization": f"Bearer {project['api_key']}",
                        "Idempotency-Key": key,
                    },
                    timeout=10,
                )
                if response.status_code == 202:
                    task = response.json()["task"]
                    run.created.append(Created(task["id"], project["project_id"], key))
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)  # 503 while PostgreSQL is away, or the process restarting
        await asyncio.sleep(spread / max(1, cfg.tasks) * run.rng.uniform(0.5, 1.5))


# -- faults ---------------------------------------------------------------------------------------


async def _faults(run: Run, schedule: list[Fault], started: float) -> None:
    for fault in schedule:
        await asyncio.sleep(max(0.0, started + fault.at_s - time.monotonic()))
        try:
            what = await _inject(run, fault)
        except Exception as exc:  # a fault that could not be injected is reported
            what = f"could not inject: {exc!r}"
        run.faults_done.append((fault, what))
        run.last_fault_end = time.monotonic()
        log(logger, logging.INFO, "fault", fault=fault.describe(), what=what)


def _role_members(run: Run) -> list[Any]:
    assert run.cluster is not None
    return [m for m in run.cluster.members if m.kind == "role" and m.pid is not None]


async def _inject(run: Run, fault: Fault) -> str:
    kind = fault.kind
    if kind is FaultKind.KILL_PROCESS:
        members = _role_members(run)
        victim = members[fault.target % len(members)]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        return f"SIGKILL {victim.name}"
    if kind is FaultKind.STOP_PROCESS:
        members = _role_members(run)
        victim = members[fault.target % len(members)]
        pid = victim.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(fault.hold_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        return f"SIGSTOP {victim.name} for {fault.hold_s:.1f} s"
    if kind is FaultKind.CUT_CONNECTIONS:
        cut = {name: proxy.cut() for name, proxy in run.proxies.items()}
        return "cut " + ", ".join(f"{n} {c}" for n, c in cut.items())
    if kind is FaultKind.RESTART_NATS and run.config.nats_cluster:
        assert run.cluster is not None
        nodes = [m for m in run.cluster.members if m.kind == "nats" and m.pid is not None]
        victim = nodes[fault.target % len(nodes)]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        return f"SIGKILL {victim.name} (the cluster restarts it)"
    name = {
        FaultKind.RESTART_POSTGRES: "postgres",
        FaultKind.RESTART_REDIS: "valkey",
        FaultKind.RESTART_NATS: "nats",
    }[kind]
    pid = embedded.pids(run.services).get(name)
    if pid is None:
        return f"{name} not running"
    os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(fault.hold_s)
    await asyncio.to_thread(embedded.up, run.services)
    return f"SIGKILL {name}, started again after {fault.hold_s:.1f} s"


# -- convergence and invariants -------------------------------------------------------------------


async def _truth(sandbox: httpx.AsyncClient, conn: asyncpg.Connection, task: Created) -> str | None:
    if task.client_request_id is None:
        task.client_request_id = await conn.fetchval(
            "SELECT client_request_id FROM task_attempts WHERE task_id = $1"
            " ORDER BY attempt_no DESC LIMIT 1",
            uuid.UUID(task.task_id),
        )
    if task.client_request_id is None:
        return None
    try:
        found = await sandbox.get(
            "/v1/generations", params={"idempotency_key": task.client_request_id}
        )
    except httpx.HTTPError:
        return None
    data = found.json().get("data") if found.status_code == 200 else None
    return str(data[0]["status"]) if data else None


async def _outcomes(
    run: Run, sandbox: httpx.AsyncClient, conn: asyncpg.Connection
) -> list[invariants.TaskOutcome]:
    rows = {
        str(r["id"]): r
        for r in await conn.fetch(
            "SELECT id, status, version, EXISTS (SELECT 1 FROM reconciliation_items i"
            " WHERE i.task_id = t.id AND i.state = 'open' AND i.kind = 'contradictory_terminal')"
            " AS flagged FROM generation_tasks t WHERE id = ANY($1::uuid[])",
            [uuid.UUID(t.task_id) for t in run.created],
        )
    }
    outcomes = []
    for task in run.created:
        row = rows[task.task_id]
        outcomes.append(
            invariants.TaskOutcome(
                task.task_id,
                task.project_id,
                await _truth(sandbox, conn, task),
                str(row["status"]),
                int(row["version"]),
                bool(row["flagged"]),
            )
        )
    return outcomes


async def _converge(
    run: Run, sandbox: httpx.AsyncClient
) -> tuple[list[invariants.TaskOutcome], float | None]:
    deadline = time.monotonic() + run.config.converge_timeout_s
    conn = await _connect_retrying(run.real_database_url)
    try:
        while True:
            outcomes = await _outcomes(run, sandbox, conn)
            if not invariants.wrong_final_states(outcomes):
                return outcomes, time.monotonic() - run.last_fault_end
            if time.monotonic() > deadline:
                return outcomes, None
            await asyncio.sleep(1.0)
    finally:
        await conn.close()


async def _connect_retrying(url: str) -> asyncpg.Connection:
    for _ in range(120):
        try:
            return await asyncpg.connect(url, timeout=5)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            await asyncio.sleep(0.5)
    return await asyncpg.connect(url, timeout=5)


async def _streams(
    conn: asyncpg.Connection, project_id: str
) -> tuple[int, dict[int, tuple[str, str, str] | None]]:
    head = await conn.fetchval(
        "SELECT head FROM event_streams WHERE project_id = $1", uuid.UUID(project_id)
    )
    keys: dict[int, tuple[str, str, str] | None] = {}
    for r in await conn.fetch(
        "SELECT seq, task_id, public_payload->>'status' AS status,"
        " public_payload->>'stage' AS stage FROM task_events WHERE project_id = $1",
        uuid.UUID(project_id),
    ):
        final = r["status"] in invariants.PROVIDER_TO_TASK.values()
        keys[r["seq"]] = None if final else (str(r["task_id"]), r["status"], r["stage"])
    return int(head or 0), keys


async def _duplicates(conn: asyncpg.Connection) -> dict[str, int]:
    media = await conn.fetchval(
        "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM media_operations"
        " GROUP BY task_id, attempt_id, operation_type HAVING count(*) > 1) d"
    )
    closing = await conn.fetchval(  # settled and refunded, or either twice
        "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM credit_ledger"
        " WHERE ledger_type IN ('settle', 'refund') GROUP BY task_id, attempt_id"
        " HAVING count(*) > 1) d"
    )
    ledger = await conn.fetchval(
        "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM credit_ledger"
        " GROUP BY task_id, attempt_id, ledger_type HAVING count(*) > 1) d"
    )
    return {
        "duplicate_media_operations": int(media),
        "duplicate_ledger_rows": int(ledger) + int(closing),
    }


# -- the run --------------------------------------------------------------------------------------


async def _main(settings: Settings, cfg: ChaosConfig, folder: Path) -> int:
    services = ServicesConfig(data_dir=folder, database_url=None, redis_url=None, nats_url=None)
    if cfg.nats_cluster:
        services = ServicesConfig(
            data_dir=folder, database_url=None, redis_url=None, nats_url="nats://unused"
        )
    run = Run(cfg, random.Random(cfg.seed), folder, services, settings)
    schedule = plan(cfg.seed, cfg.window_s, cfg.interval_s, cfg.kinds)
    print(
        f"aivedio chaos: seed {cfg.seed}, {cfg.tasks} tasks, {cfg.projects} projects, "
        f"{cfg.replicas} replicas{' (split)' if cfg.split else ''}, "
        f"{'3 NATS nodes' if cfg.nats_cluster else 'one NATS'}; data in {folder}",
        flush=True,
    )
    for fault in schedule:
        print(f"  planned {fault.describe()}", flush=True)
    stopping = asyncio.Event()
    cluster_stopping = asyncio.Event()
    watchers: list[Any] = []
    supervise: asyncio.Task[None] | None = None
    report: dict[str, Any] = {"ok": False, "error": "the run did not finish"}
    try:
        await _start(run)
        assert run.cluster is not None
        supervise = asyncio.create_task(run.cluster.run(cluster_stopping))
        http = httpx.AsyncClient(base_url=run.cluster.api_url, timeout=10)
        await _wait_ready(http, "/readyz")
        sandbox = await _sandbox(run)
        await _make_projects(run)
        watchers = await _start_clients(run)
        readers = [asyncio.create_task(w.run(stopping)) for w in watchers]
        started = time.monotonic()
        creating = asyncio.create_task(_create_tasks(run, http, stopping))
        await _faults(run, schedule, started)
        await creating
        outcomes, converged_s = await _converge(run, sandbox)
        report = await _report(run, sandbox, watchers, outcomes, converged_s)
        stopping.set()
        for reader in readers:  # a reader may be waiting for a frame that never comes
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await http.aclose()
        await sandbox.aclose()
    finally:
        stopping.set()
        cluster_stopping.set()
        if supervise is not None:
            await asyncio.gather(supervise, return_exceptions=True)
        for w in watchers:
            await w.aclose()
        for proxy in run.proxies.values():
            await proxy.close()
        await asyncio.to_thread(embedded.down, services)
    ok = bool(report["ok"])
    if ok and cfg.data_dir is None and not cfg.keep:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(report), flush=True)
    return 0 if ok else 1


async def _start_clients(run: Run) -> list[Any]:
    assert run.cluster is not None
    base = run.cluster.api_url
    watchers: list[Any] = []
    for n, project in enumerate(run.projects):
        pid, key = project["project_id"], project["api_key"]
        watchers.append(StreamWatcher(f"sse-{n}", base, key, pid, transport="sse"))
        watchers.append(StreamWatcher(f"ws-{n}", base, key, pid, transport="ws"))
        watchers.append(
            StreamWatcher(
                f"hop-{n}",
                base,
                key,
                pid,
                transport="sse" if n % 2 else "ws",
                hop_s=(1.0, 4.0),
                rng=random.Random(run.config.seed + n),
            )
        )
    for w in watchers:
        await w.start()
    first = watchers[0]
    watchers.append(
        SlowReader(
            "slow-0",
            base,
            run.projects[0]["api_key"],
            run.projects[0]["project_id"],
            cursor=str(first.client.view.cursor),
            start_seq=first.log.start_seq,
            stall_s=8.0,
        )
    )
    return watchers


async def _report(
    run: Run,
    sandbox: httpx.AsyncClient,
    watchers: list[Any],
    outcomes: list[invariants.TaskOutcome],
    converged_s: float | None,
) -> dict[str, Any]:
    conn = await _connect_retrying(run.real_database_url)
    try:
        heads: dict[str, tuple[int, dict[int, tuple[str, str, str] | None]]] = {}
        for project in run.projects:
            heads[project["project_id"]] = await _streams(conn, project["project_id"])
        deadline = time.monotonic() + run.config.catch_up_timeout_s
        behind = [w for w in watchers if w.last_seq < heads[w.log.project_id][0]]
        while behind and time.monotonic() < deadline:
            await asyncio.sleep(0.5)  # the clients reconnect and replay by themselves
            behind = [w for w in behind if w.last_seq < heads[w.log.project_id][0]]
        stats = (
            await sandbox.get("/_sandbox/stats", params={"keys": "1", "delivered": "1"})
        ).json()
        stored = {
            r["dedup_key"]
            for r in await conn.fetch(
                "SELECT dedup_key FROM provider_callback_inbox WHERE provider = 'sandbox'"
            )
        }
        attempts = {
            r["client_request_id"]
            for r in await conn.fetch("SELECT client_request_id FROM task_attempts")
        }
        duplicates = await _duplicates(conn)
    finally:
        await conn.close()
    finals = {
        project["project_id"]: {
            o.task_id: (o.status, o.version)
            for o in outcomes
            if o.project_id == project["project_id"]
        }
        for project in run.projects
    }
    keys = stats["generations"].get("create_requests_by_key", {})
    webhooks = stats["webhooks"]
    counts: dict[str, int] = {
        "wrong_final_state": len(invariants.wrong_final_states(outcomes)),
        "duplicate_generations": stats["generations"]["created"]
        - len(keys)
        + len(set(keys) - attempts),
        "forged_accepted": int(webhooks.get("forged_accepted", 0)),
        "stale_accepted": int(webhooks.get("stale_accepted", 0)),
        "acknowledged_not_stored": len(set(stats.get("webhooks_delivered_ids", [])) - stored),
        **duplicates,
    }
    clients: list[dict[str, Any]] = []
    for w in watchers:
        log_ = w.finish()
        head, coalesce = heads[log_.project_id]
        check = invariants.check_stream(log_, head, finals[log_.project_id], coalesce)
        clients.append(
            {
                "client": log_.name,
                "transport": log_.transport,
                "frames": len(log_.frames),
                "connects": log_.connects,
                "evictions": log_.evictions,
                **{
                    k: getattr(check, k)
                    for k in ("gaps", "duplicates", "misordered", "finals_missing", "resets")
                },
            }
        )
    for name in ("gaps", "duplicates", "misordered", "finals_missing"):
        counts[f"client_{name}"] = sum(int(c[name]) for c in clients)
    # A role process may exit only when the schedule killed it: an outage must pause it, never
    # end it (the cluster would restart it, which would hide the bug).
    killed = sum(
        1
        for fault, what in run.faults_done
        if fault.kind is FaultKind.KILL_PROCESS and what.startswith("SIGKILL")
    )
    members = run.cluster.members if run.cluster else []
    restarts = sum(m.restarts for m in members if m.kind == "role")
    counts["unplanned_process_exits"] = max(0, restarts - killed)
    counts["not_converged"] = 0 if converged_s is not None else 1
    ok = not any(counts.values())
    _print_table(run, counts, clients, converged_s, webhooks)
    wrong = invariants.wrong_final_states(outcomes)
    return {
        "ok": ok,
        **counts,
        "convergence_s": round(converged_s, 1) if converged_s is not None else None,
        "flagged_for_reconciliation": sum(o.flagged for o in outcomes),
        "wrong_tasks": [
            {"task_id": o.task_id, "status": o.status, "provider_status": o.provider_status}
            for o in wrong
        ],
        "seed": run.config.seed,
        "tasks": len(run.created),
        "faults": [f"{f.kind}: {what}" for f, what in run.faults_done],
        "clients": clients,
        "restarts": {m.name: m.restarts for m in (run.cluster.members if run.cluster else [])},
        "data_dir": str(run.folder),
    }


def _print_table(
    run: Run,
    counts: dict[str, int],
    clients: list[dict[str, Any]],
    converged_s: float | None,
    webhooks: dict[str, Any],
) -> None:
    print("\nfaults injected:")
    for fault, what in run.faults_done:
        print(f"  {fault.at_s:6.1f}s  {fault.kind:<18} {what}")
    print("\ninvariants (violations; every one must be 0):")
    print(invariants.table(sorted(counts.items())))
    took = f"{converged_s:.1f} s" if converged_s is not None else "NOT within the timeout"
    print(f"\nconvergence after the last fault: {took}")
    print("webhooks: " + ", ".join(f"{k} {v}" for k, v in sorted(webhooks.items())))
    print("\nclients:")
    for c in clients:
        print("  " + "  ".join(f"{k}={v}" for k, v in c.items()))
    print(flush=True)


async def _interruptible(settings: Settings, config: ChaosConfig, folder: Path) -> int:
    """``_main``, cancelled (so that it stops the cluster and the services) on SIGINT/SIGTERM."""
    main = asyncio.current_task()
    assert main is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main.cancel)
    try:
        return await _main(settings, config, folder)
    except asyncio.CancelledError:
        print(f"aivedio chaos: interrupted; data in {folder}", flush=True)
        return 130


def run_chaos(settings: Settings, config: ChaosConfig) -> int:
    setup_logging(settings.log_level)
    folder = Path(config.data_dir or tempfile.mkdtemp(prefix="aivedio-chaos-")).absolute()
    code: int = asyncio.run(_interruptible(settings, config, folder))
    return code
