"""The commands that start something: embedded servers, migrations, roles, the demo, a cluster,
a chaos run, the sandbox provider."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from aivedio.cli.common import Subcommands, check_providers, print_json
from aivedio.config import Settings
from aivedio.process.eventloop import run_loop

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


def add_services(sub: Subcommands) -> None:
    """``aivedio services up|down``: the embedded servers."""
    services = sub.add_parser("services", help="start or stop the embedded PostgreSQL/NATS/Valkey")
    services.add_argument("action", choices=("up", "down"))
    services.add_argument("--data-dir", default=None)
    services.set_defaults(func=_services)


def _services(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.services import embedded

    if args.action == "up":
        cfg = settings.services
        if args.data_dir:
            cfg = embedded.with_data_dir(cfg, args.data_dir)
        print_json(embedded.up(cfg).as_dict())
    else:
        cfg = settings.services
        if args.data_dir:
            cfg = embedded.with_data_dir(cfg, args.data_dir)
        embedded.down(cfg)
    return 0


def add_migrate(sub: Subcommands) -> None:
    """``aivedio migrate``."""
    migrate = sub.add_parser("migrate", help="apply the database migrations (idempotent)")
    migrate.set_defaults(func=_migrate)


def _migrate(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.admin import run_migrate

    applied = asyncio.run(run_migrate(settings))
    print_json({"applied": applied})
    return 0


def add_run(sub: Subcommands) -> None:
    """``aivedio run --role ...``: roles in this process."""
    run = sub.add_parser("run", help="run roles in this process")
    run.add_argument("--role", action="append", required=True, help=", ".join(ROLES))
    run.add_argument("--port", type=int, default=None)
    run.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind with SO_REUSEPORT: start one such process per core on the same port "
        "(AIVEDIO_REUSE_PORT=1)",
    )
    run.set_defaults(func=_run)


def _run(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.roles import run_roles

    roles = [r for part in args.role for r in part.split(",") if r]
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        print(f"unknown role(s): {', '.join(unknown)}; known: {', '.join(ROLES)}", file=sys.stderr)
        return 2
    check_providers(settings)
    if args.reuse_port:
        settings = settings.model_copy(update={"reuse_port": True})
    code: int = run_loop(run_roles(settings, roles, port=args.port))
    return code


def add_demo(sub: Subcommands) -> None:
    """``aivedio demo``."""
    demo = sub.add_parser("demo", help="everything on embedded services, with the web UI")
    demo.add_argument("--port", type=int, default=None)
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.demo import run_demo

    check_providers(settings)
    code: int = run_demo(settings, port=args.port)
    return code


def add_cluster(sub: Subcommands) -> None:
    """``aivedio cluster``: supervised processes on this machine."""
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
    cluster.set_defaults(func=_cluster)


def _cluster(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.cluster import ClusterConfig, run_cluster

    check_providers(settings)
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


def add_chaos(sub: Subcommands) -> None:
    """``aivedio chaos``: a cluster under a fault schedule."""
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
    chaos.set_defaults(func=_chaos)


def _chaos(args: argparse.Namespace, settings: Settings) -> int:
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


def add_sandbox_provider(sub: Subcommands) -> None:
    """``aivedio sandbox-provider``: the fake video provider."""
    sandbox = sub.add_parser("sandbox-provider", help="run the fake video provider")
    sandbox.add_argument("--host", default=None)
    sandbox.add_argument("--port", type=int, default=None)
    sandbox.set_defaults(func=_sandbox_provider)


def _sandbox_provider(args: argparse.Namespace, settings: Settings) -> int:
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
