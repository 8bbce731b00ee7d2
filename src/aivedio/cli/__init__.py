"""The ``aivedio`` command (operator contract in DESIGN.md).

The CLI is the edge: it reads ``Settings`` from the environment once and hands each command the
config objects it needs. Commands that print a result print one JSON line last.

Each command's handler imports what it runs (the roles, the demo, a bench) when it runs, not at
the top of its module, so ``aivedio --help`` does not import the roles, the demo and the benches
(timed by hand with ``/usr/bin/time``, not a bench: 0.35-0.50 s against 1.6-1.7 s, 2 cores,
2026-12-03). No import cycle is dodged by it: every one of
them may move to the top of its module, and the import-linter contracts see them either way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import pydantic

from aivedio.cli import admin, figures, operations, serving
from aivedio.cli.common import Subcommands
from aivedio.config import Settings
from aivedio.errors import ConfigError

__all__ = ["build_parser", "main"]

# One step per command, in the order ``aivedio --help`` lists them.
COMMANDS: tuple[Callable[[Subcommands], None], ...] = (
    serving.add_services,
    serving.add_migrate,
    admin.add_admin,
    serving.add_run,
    serving.add_demo,
    serving.add_cluster,
    serving.add_chaos,
    operations.add_inbox,
    operations.add_bus,
    operations.add_outbox,
    operations.add_tasks,
    operations.add_reconcile,
    serving.add_sandbox_provider,
    figures.add_bench,
    figures.add_capacity,
    figures.add_status,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aivedio", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
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
