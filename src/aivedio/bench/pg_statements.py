"""Where PostgreSQL spends a bench step, statement by statement: ``pg_stat_statements`` read
before and after the step, the run's database only, when the server has it loaded.

The embedded PostgreSQL loads it (``services/postgres_server.py``); a configured server may not,
and then there are no figures and no error. The snapshots only read the view (no reset: that
would clear other databases' figures on a shared server). Execution time only: planning,
parsing, the protocol and the commit are not in it, so the sum is less than the backends' CPU
that ``bench e2e`` reads from /proc. Each statement is named as in ``db/queries`` (matched on
its text with comments, literals and parameters taken out, as pg_stat_statements normalizes
them), else by its first words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import asyncpg

from aivedio.db.queries import load

__all__ = ["Snapshot", "StatementFigures", "between", "snapshot"]

_READ = """
SELECT queryid, calls, total_exec_time, rows, query
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND queryid IS NOT NULL
"""

_CREATED = "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements')"

_COMMENT = re.compile(r"--[^\n]*|/\*.*?\*/", re.DOTALL)
_LITERAL = re.compile(r"'(?:[^']|'')*'|\$\d+|\b\d+(?:\.\d+)?\b")
_SPACE = re.compile(r"\s+")
_PUNCTUATION = re.compile(r" ?([(),]) ?")

Snapshot = dict[int, tuple[int, float, int, str]]
"""queryid -> (calls, total execution ms, rows, query text)."""


@dataclass(frozen=True, slots=True)
class StatementFigures:
    name: str  # the query's name in db/queries, else the statement's first words
    calls: int
    exec_ms: float
    rows: int


def _shape(sql: str) -> str:
    """Without comments, constants as ``?``, one space between words, none around punctuation."""
    text = _SPACE.sub(" ", _LITERAL.sub("?", _COMMENT.sub(" ", sql)))
    return _PUNCTUATION.sub(r"\1", text).strip()


@cache
def _shapes() -> list[tuple[str, str]]:
    return [(_shape(sql), name) for name, sql in load().items()]


@cache
def name_of(query: str) -> str:
    """The ``db/queries`` name of a statement as pg_stat_statements shows it, else its start.

    Its ``$n`` may stand for any constant of the source, including some that are not literals
    there (``extract(epoch FROM ...)`` is shown as ``extract($1 FROM ...)``, and PostgreSQL 18
    shows a list of constants as ``IN ($1 /*, ... */)``), so each one matches any text."""
    shape = _shape(query)
    pattern = re.compile(".+?".join(re.escape(part) for part in shape.split("?")))
    for source, name in _shapes():
        if pattern.fullmatch(source):
            return name
    return shape[:60]


async def snapshot(conn: asyncpg.Connection) -> Snapshot | None:
    """The statements' counters of the connection's database; None when the server does not
    keep them (the library not loaded, or the extension not creatable by this user)."""
    try:
        if not await conn.fetchval(_CREATED):
            await conn.execute("CREATE EXTENSION pg_stat_statements")
        rows = await conn.fetch(_READ)
    except asyncpg.PostgresError:
        return None
    return {r["queryid"]: (r["calls"], r["total_exec_time"], r["rows"], r["query"]) for r in rows}


def between(before: Snapshot, after: Snapshot) -> list[StatementFigures]:
    """Every statement that ran between two snapshots, by name, the most execution time first."""
    summed: dict[str, list[float]] = {}
    for queryid, (calls, exec_ms, rows, query) in after.items():
        was = before.get(queryid, (0, 0.0, 0, query))
        if calls <= was[0]:
            continue
        acc = summed.setdefault(name_of(query), [0, 0.0, 0])
        acc[0] += calls - was[0]
        acc[1] += exec_ms - was[1]
        acc[2] += rows - was[2]
    ranked = sorted(summed.items(), key=lambda kv: kv[1][1], reverse=True)
    return [StatementFigures(n, int(c), e, int(r)) for n, (c, e, r) in ranked]
