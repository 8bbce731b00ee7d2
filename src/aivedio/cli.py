"""The ``aivedio`` command (operator contract in DESIGN.md).

The CLI is the edge: it reads ``Settings`` from the environment once and hands each command the
config objects it needs. Commands that print a result print one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic

from aivedio.bus.port import BusConfig
from aivedio.config import Settings
from aivedio.errors import ConfigError
from aivedio.process.eventloop import run_loop

if TYPE_CHECKING:
    from aivedio.db.pool import Database

ROLES = (
    "all",
    "api",
    "callbacks",
    "inbox",
    "submitter",
    "poller",
    "relay",
    "dispatcher",
    "gateway",
    "media",
    "billing",
    "reconciler",
    "maintenance",
)


def _print_json(value: Any) -> None:
    print(json.dumps(value, default=str), flush=True)


def _cmd_services(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.services import embedded

    if args.action == "up":
        cfg = settings.services
        if args.data_dir:
            cfg = embedded.with_data_dir(cfg, args.data_dir)
        _print_json(embedded.up(cfg).as_dict())
    else:
        cfg = settings.services
        if args.data_dir:
            cfg = embedded.with_data_dir(cfg, args.data_dir)
        embedded.down(cfg)
    return 0


def _cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.admin import run_migrate

    applied = asyncio.run(run_migrate(settings))
    _print_json({"applied": applied})
    return 0


def _cmd_admin(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.admin import create_project

    result = asyncio.run(create_project(settings, tenant=args.tenant, project=args.project))
    _print_json(result)
    return 0


def _cmd_bump_epoch(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.retention.epochs import bump_epoch

    if args.all == (args.project is not None):
        print("bump-epoch takes --project ID or --all", file=sys.stderr)
        return 2

    async def go() -> int:
        db = await _database(settings)
        try:
            async with db.connection() as conn:
                streams = await bump_epoch(conn, None if args.all else [args.project])
        finally:
            await db.close()
        for stream in streams:
            _print_json(stream)
        _print_json({"bumped": len(streams)})
        return 0 if streams else 1

    return asyncio.run(go())


def _cmd_maintenance(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.retention.config import RetentionConfig
    from aivedio.retention.maintenance import Maintenance

    async def go() -> int:
        db = await _database(settings)
        try:
            result = await Maintenance(db, RetentionConfig.from_settings(settings)).run_once()
        finally:
            await db.close()
        _print_json(result.as_dict())
        return 0

    return asyncio.run(go())


def _check_providers(settings: Settings) -> None:
    """Fail before anything starts when a provider section is half set (``ConfigError``)."""
    from aivedio.providers.registry import providers_config

    providers_config(settings)


def _cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.roles import run_roles

    roles = [r for part in args.role for r in part.split(",") if r]
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        print(f"unknown role(s): {', '.join(unknown)}; known: {', '.join(ROLES)}", file=sys.stderr)
        return 2
    _check_providers(settings)
    if args.reuse_port:
        settings = settings.model_copy(update={"reuse_port": True})
    code: int = run_loop(run_roles(settings, roles, port=args.port))
    return code


def _cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.demo import run_demo

    _check_providers(settings)
    code: int = run_demo(settings, port=args.port)
    return code


def _cmd_cluster(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.cluster import ClusterConfig, run_cluster

    _check_providers(settings)
    if args.nats_cluster not in (0, 3):
        print("--nats-cluster takes 3 (or 0 for one NATS server)", file=sys.stderr)
        return 2
    config = ClusterConfig(
        data_dir=Path(args.data_dir) if args.data_dir else settings.data_dir,
        replicas=args.replicas,
        split=args.split,
        nats_cluster=args.nats_cluster,
        sandbox=args.sandbox,
        port=args.port or settings.port,
    )
    return run_cluster(settings, config)


def _cmd_chaos(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.chaos.run import ChaosConfig, run_chaos
    from aivedio.chaos.schedule import FaultKind

    kinds = tuple(FaultKind)
    if args.faults:
        try:
            kinds = tuple(FaultKind(k) for k in args.faults.split(",") if k)
        except ValueError:
            known = ", ".join(k.value for k in FaultKind)
            print(f"--faults takes a comma-separated list of: {known}", file=sys.stderr)
            return 2
    config = ChaosConfig(
        seed=args.seed,
        tasks=args.tasks,
        projects=args.projects,
        replicas=args.replicas,
        split=args.split,
        nats_cluster=args.nats_cluster,
        window_s=args.window_s,
        interval_s=args.interval_s,
        kinds=kinds,
        data_dir=Path(args.data_dir) if args.data_dir else None,
        keep=args.keep,
    )
    return run_chaos(settings, config)


def _cmd_sandbox(args: argparse.Namespace, settings: Settings) -> int:
    from urllib.parse import urlsplit

    from aivedio.demo import sandbox_config
    from aivedio.sandbox import serve

    where = urlsplit(settings.sandbox_url)
    asyncio.run(
        serve(
            sandbox_config(settings),
            args.host or where.hostname or "127.0.0.1",
            args.port or where.port or 8100,
        )
    )
    return 0


def _cmd_inbox(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.ingest.retries import list_dead_letters, replay

    async def go() -> int:
        db = await _database(settings)
        try:
            if args.inbox_command == "dead-letters":
                rows = await list_dead_letters(db, args.limit)
                for row in rows:
                    _print_json(row)
                _print_json({"count": len(rows)})  # as bus and outbox dead-letters end
                return 0
            ok = await replay(db, args.id)
            _print_json({"id": args.id, "requeued": ok})
            return 0 if ok else 1
        finally:
            await db.close()

    return asyncio.run(go())


def _cmd_bus(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.propagation.dead_letters import dead_letters_command, replay_command
    from aivedio.runtime import resolve_urls

    urls = resolve_urls(settings)
    config = BusConfig.from_settings(settings, urls.nats_url, urls.redis_url)
    if args.bus_command == "dead-letters":
        code: int = asyncio.run(dead_letters_command(config, args.group, args.limit))
    else:
        code = asyncio.run(replay_command(config, args.group, args.id))
    return code


def _cmd_outbox(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.propagation.outbox_admin import dead_letters_command, replay_command

    async def go() -> int:
        db = await _database(settings)
        try:
            if args.outbox_command == "dead-letters":
                return await dead_letters_command(db, args.limit)
            return await replay_command(db, args.id)
        finally:
            await db.close()

    return asyncio.run(go())


def _cmd_operator(args: argparse.Namespace, settings: Settings) -> int:
    """``tasks resubmit`` and ``reconcile list|resolve``: audited operator actions."""
    from aivedio.errors import Conflict, NotFound
    from aivedio.reconcile.items import list_items, resolve_item
    from aivedio.submission.resubmit import resubmit

    async def go() -> int:
        db = await _database(settings)
        try:
            if args.command == "tasks":
                done = await resubmit(db, args.task_id, args.reason, args.operator)
                _print_json(done.as_dict())
            elif args.reconcile_command == "list":
                state = None if args.state == "all" else args.state
                for item in await list_items(db, state, args.limit):
                    _print_json(item)
            else:
                _print_json(await resolve_item(db, args.item_id, args.resolution, args.operator))
            return 0
        except (Conflict, NotFound, ValueError) as exc:
            code = exc.code if isinstance(exc, Conflict) else type(exc).__name__
            _print_json({"error": code, "message": str(exc)})
            return 1
        finally:
            await db.close()

    return asyncio.run(go())


async def _database(settings: Settings) -> Database:
    from aivedio.admin import resolve_database_url
    from aivedio.db.pool import Database

    return await Database.connect(settings.database(resolve_database_url(settings)))


def _cmd_bench(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.bench import run_bench

    code: int = run_bench(settings, args.name, args.options)
    return code


def _cmd_capacity(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.bench.common import BenchUsageError
    from aivedio.capacity import run_capacity

    try:
        return run_capacity(args.options)
    except BenchUsageError as exc:
        print(f"capacity: {exc}", file=sys.stderr)
        return 2


def _cmd_status(args: argparse.Namespace, settings: Settings) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aivedio", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    services = sub.add_parser("services", help="start or stop the embedded PostgreSQL/NATS/Valkey")
    services.add_argument("action", choices=("up", "down"))
    services.add_argument("--data-dir", default=None)
    services.set_defaults(func=_cmd_services)

    migrate = sub.add_parser("migrate", help="apply the database migrations (idempotent)")
    migrate.set_defaults(func=_cmd_migrate)

    admin = sub.add_parser("admin", help="administration")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    create = admin_sub.add_parser("create-project", help="create a tenant's project and API key")
    create.add_argument("--tenant", required=True)
    create.add_argument("--project", required=True)
    create.set_defaults(func=_cmd_admin)
    bump = admin_sub.add_parser(
        "bump-epoch",
        help="a new epoch for one project's stream or all (after a restore): every cursor "
        "issued before gets `reset`",
    )
    bump.add_argument("--project", type=uuid.UUID, default=None)
    bump.add_argument("--all", action="store_true")
    bump.set_defaults(func=_cmd_bump_epoch)
    maint = admin_sub.add_parser(
        "maintenance",
        help="one maintenance round now (partitions ahead, event retention with floors, outbox "
        "and inbox purges); JSON line last",
    )
    maint.set_defaults(func=_cmd_maintenance)

    run = sub.add_parser("run", help="run roles in this process")
    run.add_argument("--role", action="append", required=True, help=", ".join(ROLES))
    run.add_argument("--port", type=int, default=None)
    run.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind with SO_REUSEPORT: start one such process per core on the same port "
        "(AIVEDIO_REUSE_PORT=1)",
    )
    run.set_defaults(func=_cmd_run)

    demo = sub.add_parser("demo", help="everything on embedded services, with the web UI")
    demo.add_argument("--port", type=int, default=None)
    demo.set_defaults(func=_cmd_demo)

    cluster = sub.add_parser(
        "cluster", help="N supervised processes of every role on this machine (JSON line first)"
    )
    cluster.add_argument("--replicas", type=int, default=2, help="processes per role kind")
    cluster.add_argument(
        "--split", action="store_true", help="one process kind per role instead of --role all"
    )
    cluster.add_argument(
        "--nats-cluster",
        type=int,
        default=0,
        metavar="3",
        help="run a three-node NATS JetStream cluster (streams with 3 replicas)",
    )
    cluster.add_argument("--sandbox", action="store_true", help="also run the sandbox provider")
    cluster.add_argument("--port", type=int, default=None)
    cluster.add_argument("--data-dir", default=None)
    cluster.set_defaults(func=_cmd_cluster)

    chaos = sub.add_parser(
        "chaos",
        help="a cluster under a fault schedule with every sandbox chaos knob on; the invariant "
        "table, then one JSON line; exit 1 on any violation",
    )
    chaos.add_argument("--seed", type=int, default=1, help="the same seed, the same schedule")
    chaos.add_argument("--tasks", type=int, default=40)
    chaos.add_argument("--projects", type=int, default=3)
    chaos.add_argument("--replicas", type=int, default=2)
    chaos.add_argument("--split", action="store_true")
    chaos.add_argument("--nats-cluster", type=int, default=0, choices=(0, 3))
    chaos.add_argument("--window-s", type=float, default=60.0, help="faults within this window")
    chaos.add_argument("--interval-s", type=float, default=6.0, help="about one fault this often")
    chaos.add_argument("--faults", default="", help="only these fault kinds (comma-separated)")
    chaos.add_argument("--data-dir", default=None, help="default: a new temporary folder")
    chaos.add_argument("--keep", action="store_true", help="keep the data folder (logs)")
    chaos.set_defaults(func=_cmd_chaos)

    inbox = sub.add_parser("inbox", help="callback inbox operations")
    inbox_sub = inbox.add_subparsers(dest="inbox_command", required=True)
    dead = inbox_sub.add_parser("dead-letters", help="list dead-lettered callbacks (JSON lines)")
    dead.add_argument("--limit", type=int, default=50)
    dead.set_defaults(func=_cmd_inbox)
    requeue = inbox_sub.add_parser("replay", help="requeue one inbox row")
    requeue.add_argument("id", type=int)
    requeue.set_defaults(func=_cmd_inbox)

    bus = sub.add_parser("bus", help="message bus operations")
    bus_sub = bus.add_subparsers(dest="bus_command", required=True)
    letters = bus_sub.add_parser("dead-letters", help="list a group's dead letters (JSON lines)")
    letters.add_argument("--group", required=True)
    letters.add_argument("--limit", type=int, default=100)
    letters.set_defaults(func=_cmd_bus)
    again = bus_sub.add_parser("replay", help="deliver one dead letter again to its group only")
    again.add_argument("--group", required=True)
    again.add_argument("id")
    again.set_defaults(func=_cmd_bus)

    outbox = sub.add_parser("outbox", help="outbox operations")
    outbox_sub = outbox.add_subparsers(dest="outbox_command", required=True)
    dead_rows = outbox_sub.add_parser("dead-letters", help="list dead outbox rows (JSON lines)")
    dead_rows.add_argument("--limit", type=int, default=50)
    dead_rows.set_defaults(func=_cmd_outbox)
    requeue_row = outbox_sub.add_parser("replay", help="put one dead outbox row back to pending")
    requeue_row.add_argument("id", type=int)
    requeue_row.set_defaults(func=_cmd_outbox)

    tasks = sub.add_parser("tasks", help="operator actions on tasks")
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True)
    again_task = tasks_sub.add_parser(
        "resubmit", help="audited compensation: a new attempt for a task whose outcome is unknown"
    )
    again_task.add_argument("task_id", type=uuid.UUID)
    again_task.add_argument("--reason", required=True)
    again_task.add_argument("--operator", default=getpass.getuser())
    again_task.set_defaults(func=_cmd_operator)

    reconcile = sub.add_parser("reconcile", help="the reconciliation queue")
    reconcile_sub = reconcile.add_subparsers(dest="reconcile_command", required=True)
    items = reconcile_sub.add_parser("list", help="reconciliation items (JSON lines)")
    items.add_argument("--state", choices=("open", "resolved", "all"), default="open")
    items.add_argument("--limit", type=int, default=100)
    items.set_defaults(func=_cmd_operator)
    resolve = reconcile_sub.add_parser("resolve", help="close an item with a resolution")
    resolve.add_argument("item_id", type=int)
    resolve.add_argument("--resolution", required=True)
    resolve.add_argument("--operator", default=getpass.getuser())
    resolve.set_defaults(func=_cmd_operator)

    sandbox = sub.add_parser("sandbox-provider", help="run the fake video provider")
    sandbox.add_argument("--host", default=None)
    sandbox.add_argument("--port", type=int, default=None)
    sandbox.set_defaults(func=_cmd_sandbox)

    bench = sub.add_parser("bench", help="benchmarks; the last line printed is JSON")
    bench.add_argument("name")
    bench.add_argument("options", nargs="*", help="key=value options of the benchmark")
    bench.set_defaults(func=_cmd_bench)

    capacity = sub.add_parser(
        "capacity", help="a deployment plan from measured figures; the last line is JSON"
    )
    capacity.add_argument(
        "options", nargs="*", help="key=value: e2e=FILE or measure=1, workload (see the docs)"
    )
    capacity.set_defaults(func=_cmd_capacity)

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
    status.set_defaults(func=_cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
    except pydantic.ValidationError as exc:
        for error in exc.errors():
            name = "AIVEDIO_" + "_".join(str(part) for part in error["loc"]).upper()
            print(f"aivedio: configuration error: {name}: {error['msg']}", file=sys.stderr)
        return 2
    func: Callable[[argparse.Namespace, Settings], int] = args.func
    try:
        return func(args, settings)
    except ConfigError as exc:
        print(f"aivedio: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
