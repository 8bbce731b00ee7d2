"""The pgbench script of ``aivedio bench transitions``: our own SQL statements, per transaction as
``StateService.apply`` or ``apply_many`` runs them, with their constant parameters."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime

from aivedio.db.queries import q
from aivedio.domain.observation import ProviderStatus, Source
from aivedio.domain.public import public_event
from aivedio.domain.statuses import STATUS_TABLE, Status
from aivedio.domain.transitions import TaskChange
from aivedio.state.events import TaskRef, domain_payload, stored_payload

_PARAM = re.compile(r"\$(\d+)")


def _sql_with(name: str, params: Mapping[int, str]) -> str:
    """The named query with its comment lines dropped and each ``$n`` replaced by ``params[n]``."""
    lines = [line for line in q(name).splitlines() if not line.lstrip().startswith("--")]
    return _PARAM.sub(lambda m: params[int(m.group(1))], "\n".join(lines))


_WRITE_PARAMS = {
    1: ":l_project_id",
    2: ":l_id",
    3: ":l_attempt_id",
    4: ":next_version",
    5: ":stored_payload",
    6: ":source",
    7: "NULL",  # trace_id
    8: ":status",
    9: ":stage",
    10: ":progress",
    11: "NULL",  # error_code
    12: "NULL",  # error_message
    13: "NULL",  # asset_id
    14: ":terminal",
    15: ":domain_payload",
    16: ":record_attempt",
    17: ":provider_status",
    18: ":next_version",  # last_provider_seq
    19: ":occurred_at",  # last_provider_at
    20: "NULL",  # inbox id
    21: "true",  # a public event (progress moved): no audit row, the audit columns are NULL
    **dict.fromkeys(range(22, 29), "NULL"),
    29: "'task.progress.changed'",  # the outbox row's routing class: only the progress moved
}


def pgbench_script(attempts: int, batch: int = 1, clients: int = 1) -> str:
    """One transaction as ``StateService.apply`` (``batch`` 1) or ``apply_many`` runs it.

    ``lock_task_for_attempt``'s ``$1`` is a random attempt (by row number from the helper table
    ``bench_attempts``); ``locked_attempts`` then reads it, as our code does after the lock, and
    its row is kept with ``\\gset`` and feeds ``write_event``. Constant parameters come as
    ``-D`` variables (``pgbench_variables``); the ones our observation sends as NULL are NULL
    literals.

    For a batch (``_batch_script``) the transaction is ours: BEGIN; ``lock_tasks_for_attempts``;
    ``write_events``; COMMIT.
    """
    if batch > 1:
        return _batch_script(attempts // batch, batch, clients)
    attempt = "(SELECT attempt_id FROM bench_attempts WHERE n = :n)"
    lock = _sql_with("lock_task_for_attempt", {1: attempt})
    read = _sql_with("locked_attempts", {1: f"ARRAY[{attempt}]"})
    write = _sql_with("write_event", _WRITE_PARAMS)
    return (
        f"\\set n random(1, {attempts})\n"
        "\\set progress random(0, 100)\n"
        "BEGIN;\n"
        f"{lock};\n"
        f"{read} \\gset l_\n"
        "\\set next_version :l_version + 1\n"
        f"{write};\n"
        "COMMIT;\n"
    )


def _batch_script(blocks: int, batch: int, clients: int) -> str:
    """``apply_many``'s transaction for one block of ``batch`` tasks (a row of ``bench_blocks``:
    tasks in creation order, as our round-robin queue hands them out, by project within the
    block, the order ``apply_many`` writes in). Each client takes blocks of its own
    (``:client_id``), as our workers never share a task.

    pgbench cannot keep the rows of a multi-row result, so the arrays ours builds from the
    locked rows are sub-selects here: the block's ids from ``bench_blocks`` and the next
    versions from ``generation_tasks`` (read after the lock, as ours does; one index lookup per
    task more than ours). Constants are ``array_fill``-ed ``-D`` variables.
    """
    blocks = max(1, blocks)
    if blocks >= clients:
        pick = f":client_id + {clients} * random(0, {blocks // clients - 1})"
    else:
        pick = f"random(0, {blocks - 1})"
    lock = _sql_with("lock_tasks_for_attempts", {1: _block("attempt_ids")})
    write = _sql_with("write_events", _batch_write_params(batch))
    return f"\\set b {pick}\n\\set progress random(0, 100)\nBEGIN;\n{lock};\n{write};\nCOMMIT;\n"


def _block(column: str) -> str:
    """A column of the block's row of ``bench_blocks``."""
    return f"(SELECT {column} FROM bench_blocks WHERE b = :b)"


def _batch_write_params(batch: int) -> dict[int, str]:
    """``write_events``' parameters for one block: its ids, the next versions read after the
    lock, and the constants ``array_fill``-ed to ``batch``."""

    def fill(value: str, kind: str) -> str:
        return f"array_fill({value}::{kind}, ARRAY[{batch}])"

    versions = (
        "ARRAY(SELECT t.version + 1 FROM unnest("
        + _block("task_ids")
        + ") WITH ORDINALITY AS u (id, o) JOIN generation_tasks t ON t.id = u.id ORDER BY u.o)"
    )
    return {
        1: _block("project_ids"),
        2: _block("task_ids"),
        3: _block("attempt_ids"),
        4: versions,
        5: fill(":stored_payload", "text"),
        6: fill(":source", "text"),
        7: fill("NULL", "text"),  # trace_id
        8: fill(":status", "text"),
        9: fill(":stage", "text"),
        10: fill(":progress", "smallint"),
        11: fill("NULL", "text"),  # error_code
        12: fill("NULL", "text"),  # error_message
        13: fill("NULL", "uuid"),  # asset_id
        14: fill(":terminal", "boolean"),
        15: fill(":domain_payload", "text"),
        16: fill(":record_attempt", "boolean"),
        17: fill(":provider_status", "text"),
        18: versions,  # last_provider_seq
        19: fill(":occurred_at", "timestamptz"),
        20: fill("NULL", "bigint"),  # inbox id
        21: fill("true", "boolean"),  # public events (progress moved): no audit rows
        22: fill("NULL", "text"),  # audit reason
        23: fill("NULL", "text"),  # audit observed
        24: fill("NULL", "timestamptz"),  # audit received_at
        25: fill("NULL", "text"),  # audit provider
        26: fill("NULL", "bigint"),  # audit provider_sequence
        27: fill("NULL", "smallint"),  # audit progress
        28: fill("NULL", "text"),  # audit dedup key
        29: fill("'task.progress.changed'", "text"),  # routing class: only the progress moved
    }


def pgbench_variables() -> dict[str, str]:
    """The constant parameters, as our code encodes them for a running observation."""
    ref = TaskRef(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4())
    change = TaskChange(
        status=Status.RUNNING,
        stage=STATUS_TABLE[Status.RUNNING].stage,
        progress=50,
        error_code=None,
        error_message=None,
        asset_id=None,
    )
    occurred_at = datetime.now(UTC)
    public = public_event(
        task_id=ref.task_id,
        task_version=10,
        status=change.status,
        stage=str(change.stage),
        progress=change.progress,
        asset_id=None,
        error_code=None,
    )
    payload = domain_payload(
        ref,
        attempt_id=uuid.uuid4(),
        version=10,
        change=change,
        source=str(Source.POLL),
        trace_id=None,
        occurred_at=occurred_at,
        public=public,
    )
    return {
        "stored_payload": stored_payload(public),
        "domain_payload": json.dumps(payload),
        "source": str(Source.POLL),
        "occurred_at": occurred_at.isoformat(),
        "status": str(change.status),
        "stage": str(change.stage),
        "terminal": "false",
        "record_attempt": "true",
        "provider_status": str(ProviderStatus.RUNNING),
    }


def _blocks_statement(batch: int) -> str:
    """``bench_blocks``: block number -> the ids of ``batch`` tasks, in creation order in blocks
    of ``batch`` (as our queue hands them out), by project within a block (``apply_many``'s write
    order). Full blocks only."""
    return (
        "CREATE TABLE bench_blocks AS"
        " WITH src AS (SELECT a.id AS attempt_id, t.id AS task_id, t.project_id,"
        " row_number() OVER (ORDER BY t.created_at, t.id) - 1 AS k"
        " FROM task_attempts a JOIN generation_tasks t ON t.id = a.task_id)"
        f" SELECT (k / {batch})::int AS b,"
        " array_agg(project_id ORDER BY project_id, k) AS project_ids,"
        " array_agg(task_id ORDER BY project_id, k) AS task_ids,"
        " array_agg(attempt_id ORDER BY project_id, k) AS attempt_ids"
        f" FROM src GROUP BY 1 HAVING count(*) = {batch};"
        " ALTER TABLE bench_blocks ADD PRIMARY KEY (b)"
    )
