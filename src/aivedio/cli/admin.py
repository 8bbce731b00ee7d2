"""``aivedio admin``: create a project, bump stream epochs, one maintenance round."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

from aivedio.cli.common import Subcommands, database, print_json
from aivedio.config import Settings


def add_admin(sub: Subcommands) -> None:
    """``aivedio admin create-project|bump-epoch|maintenance``."""
    admin = sub.add_parser("admin", help="administration")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    create = admin_sub.add_parser("create-project", help="create a tenant's project and API key")
    create.add_argument("--tenant", required=True)
    create.add_argument("--project", required=True)
    create.set_defaults(func=_create_project)
    bump = admin_sub.add_parser(
        "bump-epoch",
        help="a new epoch for one project's stream or all (after a restore): every cursor "
        "issued before gets `reset`",
    )
    bump.add_argument("--project", type=uuid.UUID, default=None)
    bump.add_argument("--all", action="store_true")
    bump.set_defaults(func=_bump_epoch)
    maint = admin_sub.add_parser(
        "maintenance",
        help="one maintenance round now (partitions ahead, event retention with floors, outbox "
        "and inbox purges); JSON line last",
    )
    maint.set_defaults(func=_maintenance)


def _create_project(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.admin import create_project

    result = asyncio.run(create_project(settings, tenant=args.tenant, project=args.project))
    print_json(result)
    return 0


def _bump_epoch(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.retention.epochs import bump_epoch

    if args.all == (args.project is not None):
        print("bump-epoch takes --project ID or --all", file=sys.stderr)
        return 2

    async def go() -> int:
        db = await database(settings)
        try:
            async with db.connection() as conn:
                streams = await bump_epoch(conn, None if args.all else [args.project])
        finally:
            await db.close()
        for stream in streams:
            print_json(stream)
        print_json({"bumped": len(streams)})
        return 0 if streams else 1

    return asyncio.run(go())


def _maintenance(args: argparse.Namespace, settings: Settings) -> int:
    from aivedio.retention.config import RetentionConfig
    from aivedio.retention.maintenance import Maintenance

    async def go() -> int:
        db = await database(settings)
        try:
            result = await Maintenance(db, RetentionConfig.from_settings(settings)).run_once()
        finally:
            await db.close()
        print_json(result.as_dict())
        return 0

    return asyncio.run(go())
