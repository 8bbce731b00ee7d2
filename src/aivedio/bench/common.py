"""What every benchmark shares: options, percentiles, the JSON line, a scratch database."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from aivedio.admin import resolve_database_url
from aivedio.config import Settings
from aivedio.db.migrate import migrate
from aivedio.errors import AivedioError


class BenchUsageError(AivedioError):
    """A benchmark was asked for something it does not understand (name, option, value)."""


def parse_options(options: Sequence[str]) -> dict[str, str]:
    """``["tasks=100", "seconds=2"]`` -> ``{"tasks": "100", "seconds": "2"}``."""
    parsed: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key:
            raise BenchUsageError(f"option {option!r} is not key=value")
        parsed[key.strip()] = value.strip()
    return parsed


T = TypeVar("T")


def build_options(cls: type[T], options: Mapping[str, str]) -> T:
    """Fill the dataclass ``cls`` from ``key=value`` strings, converted by each field's default."""
    assert is_dataclass(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise BenchUsageError(
            f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    values: dict[str, Any] = {}
    defaults = cls()
    for key, raw in options.items():
        default = getattr(defaults, key)
        try:
            values[key] = type(default)(raw)
        except ValueError as exc:
            kind = type(default).__name__
            raise BenchUsageError(f"option {key}={raw!r}: expected {kind}") from exc
    return cls(**values)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def print_json_line(figures: Mapping[str, Any]) -> None:
    """The operator contract: the last line a benchmark prints is one JSON object."""
    print(json.dumps(figures, default=str, allow_nan=False), flush=True)


def database_url(settings: Settings) -> str:
    """``AIVEDIO_DATABASE_URL``, else the embedded server (started when it is not running)."""
    return resolve_database_url(settings)


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


@asynccontextmanager
async def scratch_database(admin_url: str, prefix: str = "aivedio_bench") -> AsyncIterator[str]:
    """A freshly created and migrated database for one run, dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    url = with_database(admin_url, name)
    try:
        conn = await asyncpg.connect(url)
        try:
            await migrate(conn)
        finally:
            await conn.close()
        yield url
    finally:
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


def rounded(value: float, digits: int = 3) -> float | None:
    """A figure for the JSON line (``None`` where it could not be measured)."""
    if math.isnan(value) or math.isinf(value):
        return None
    return round(value, digits)
