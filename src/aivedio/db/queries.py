"""Named SQL blocks loaded once from ``db/queries/*.sql`` (procrastinate's habit).

A block starts with a line ``-- name: some_name`` and runs to the next such line; the lines of
``--`` comments right under the name line are its description.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def parse(text: str) -> dict[str, str]:
    blocks: dict[str, str] = {}
    parts = _NAME.split(text)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in blocks:
            raise ValueError(f"query {name!r} is defined twice")
        blocks[name] = body.strip()
    return blocks


@cache
def load() -> dict[str, str]:
    blocks: dict[str, str] = {}
    folder = resources.files("aivedio.db") / "queries"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            for name, sql in parse(entry.read_text(encoding="utf-8")).items():
                if name in blocks:
                    raise ValueError(f"query {name!r} is defined twice")
                blocks[name] = sql
    return blocks


def q(name: str) -> str:
    """The SQL text of one named query."""
    return load()[name]
