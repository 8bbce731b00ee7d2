"""What the command modules share: the sub-command table type, JSON output, the database."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any, TypeAlias

from aivedio.config import Settings

if TYPE_CHECKING:
    from aivedio.db.pool import Database

# What ``ArgumentParser.add_subparsers`` returns; each command module adds its commands to it.
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def print_json(value: Any) -> None:
    print(json.dumps(value, default=str), flush=True)


async def database(settings: Settings) -> Database:
    from aivedio.admin import resolve_database_url
    from aivedio.db.pool import Database

    return await Database.connect(settings.database(resolve_database_url(settings)))


def check_providers(settings: Settings) -> None:
    """Fail before anything starts when a provider section is half set (``ConfigError``)."""
    from aivedio.providers.registry import providers_config

    providers_config(settings)
