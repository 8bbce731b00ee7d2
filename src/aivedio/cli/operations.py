"""Operator commands: dead letters of the inbox, the bus and the outbox, replays, task
resubmission and the reconciliation queue (each audited where it changes something)."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import uuid

from aivedio.bus.port import BusConfig
from aivedio.cli.common import Subcommands, database, print_json
from aivedio.config import Settings


def add_inbox(sub: Subcommands) -> None:
    """``aivedio inbox dead-letters|replay``."""
    inbox = sub.add_parser("inbox", help="callback inbox operations")
    inbox_sub = inbox.add_subparsers(dest="inbox_command", required=True)
    dead = inbox_sub.add_parser("dead-letters", help="list dead-lettered callbacks (JSON lines)")
    dead.add_argument("--limit", type=int, default=50)
    dead.set_defaults(func=_inbox)
    requeue = inbox_sub.add_parser("replay", help="requeue one inbox row")
    requeue.add_argument("id", type=int)
    requeue.set_defaults(func=_inbox)


def _inbox(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.ingest.retries import list_dead_letters, replay

    async def go() -> int:
        db = await database(settings)
        try:
            if args.inbox_command == "dead-letters":
                rows = await list_dead_letters(db, args.limit)
                for row in rows:
                    print_json(row)
                print_json({"count": len(rows)})  # as bus and outbox dead-letters end
                return 0
            ok = await replay(db, args.id)
            print_json({"id": args.id, "requeued": ok})
            return 0 if ok else 1
        finally:
            await db.close()

    return asyncio.run(go())


def add_bus(sub: Subcommands) -> None:
    """``aivedio bus dead-letters|replay``."""
    bus = sub.add_parser("bus", help="message bus operations")
    bus_sub = bus.add_subparsers(dest="bus_command", required=True)
    letters = bus_sub.add_parser("dead-letters", help="list a group's dead letters (JSON lines)")
    letters.add_argument("--group", required=True)
    letters.add_argument("--limit", type=int, default=100)
    letters.set_defaults(func=_bus)
    again = bus_sub.add_parser("replay", help="deliver one dead letter again to its group only")
    again.add_argument("--group", required=True)
    again.add_argument("id")
    again.set_defaults(func=_bus)


def _bus(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.propagation.dead_letters import dead_letters_command, replay_command
    from aivedio.runtime import resolve_urls

    urls = resolve_urls(settings)
    config = BusConfig.from_settings(settings, urls.nats_url, urls.redis_url)
    if args.bus_command == "dead-letters":
        code: int = asyncio.run(dead_letters_command(config, args.group, args.limit))
    else:
        code = asyncio.run(replay_command(config, args.group, args.id))
    return code


def add_outbox(sub: Subcommands) -> None:
    """``aivedio outbox dead-letters|replay``."""
    outbox = sub.add_parser("outbox", help="outbox operations")
    outbox_sub = outbox.add_subparsers(dest="outbox_command", required=True)
    dead_rows = outbox_sub.add_parser("dead-letters", help="list dead outbox rows (JSON lines)")
    dead_rows.add_argument("--limit", type=int, default=50)
    dead_rows.set_defaults(func=_outbox)
    requeue_row = outbox_sub.add_parser("replay", help="put one dead outbox row back to pending")
    requeue_row.add_argument("id", type=int)
    requeue_row.set_defaults(func=_outbox)


def _outbox(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.propagation.outbox_admin import dead_letters_command, replay_command

    async def go() -> int:
        db = await database(settings)
        try:
            if args.outbox_command == "dead-letters":
                return await dead_letters_command(db, args.limit)
            return await replay_command(db, args.id)
        finally:
            await db.close()

    return asyncio.run(go())


def add_tasks(sub: Subcommands) -> None:
    """``aivedio tasks resubmit``."""
    tasks = sub.add_parser("tasks", help="operator actions on tasks")
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True)
    again_task = tasks_sub.add_parser(
        "resubmit", help="audited compensation: a new attempt for a task whose outcome is unknown"
    )
    again_task.add_argument("task_id", type=uuid.UUID)
    again_task.add_argument("--reason", required=True)
    again_task.add_argument("--operator", default=getpass.getuser())
    again_task.set_defaults(func=_operator)


def add_reconcile(sub: Subcommands) -> None:
    """``aivedio reconcile list|resolve``."""
    reconcile = sub.add_parser("reconcile", help="the reconciliation queue")
    reconcile_sub = reconcile.add_subparsers(dest="reconcile_command", required=True)
    items = reconcile_sub.add_parser("list", help="reconciliation items (JSON lines)")
    items.add_argument("--state", choices=("open", "resolved", "all"), default="open")
    items.add_argument("--limit", type=int, default=100)
    items.set_defaults(func=_operator)
    resolve = reconcile_sub.add_parser("resolve", help="close an item with a resolution")
    resolve.add_argument("item_id", type=int)
    resolve.add_argument("--resolution", required=True)
    resolve.add_argument("--operator", default=getpass.getuser())
    resolve.set_defaults(func=_operator)


def _operator(args: argparse.Namespace, settings: Settings) -> int:
    """``tasks resubmit`` and ``reconcile list|resolve``: audited operator actions."""
    from aivedio.errors import Conflict, NotFound
    from aivedio.reconcile.items import list_items, resolve_item
    from aivedio.submission.resubmit import resubmit

    async def go() -> int:
        db = await database(settings)
        try:
            if args.command == "tasks":
                done = await resubmit(db, args.task_id, args.reason, args.operator)
                print_json(done.as_dict())
            elif args.reconcile_command == "list":
                state = None if args.state == "all" else args.state
                for item in await list_items(db, state, args.limit):
                    print_json(item)
            else:
                print_json(await resolve_item(db, args.item_id, args.resolution, args.operator))
            return 0
        except (Conflict, NotFound, ValueError) as exc:
            code = exc.code if isinstance(exc, Conflict) else type(exc).__name__
            print_json({"error": code, "message": str(exc)})
            return 1
        finally:
            await db.close()

    return asyncio.run(go())
