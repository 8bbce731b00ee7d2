"""The end of a chaos run: the clients caught up, the invariants counted, the table printed and the
report (the JSON line) built."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from aivedio.chaos import invariants
from aivedio.chaos.check import _connect_retrying, _duplicates, _streams
from aivedio.chaos.config import Run
from aivedio.chaos.schedule import FaultKind

Heads = dict[str, tuple[int, dict[int, tuple[str, str, str] | None]]]
"""Per project: its stream's head, and the coalescing key of each event (None for a final)."""


@dataclass(frozen=True, slots=True)
class _Read:
    """What the database and the sandbox hold once the clients caught up."""

    heads: Heads
    stats: dict[str, Any]  # the sandbox's /_sandbox/stats
    stored: set[str]  # the inbox's dedup keys
    attempts: set[str]  # the attempts' client request ids
    duplicates: dict[str, int]


async def _report(
    run: Run,
    sandbox: httpx.AsyncClient,
    watchers: list[Any],
    outcomes: list[invariants.TaskOutcome],
    converged_s: float | None,
) -> dict[str, Any]:
    read = await _catch_up_and_read(run, sandbox, watchers)
    webhooks = read.stats["webhooks"]
    counts = _counts(outcomes, read)
    clients = _client_checks(run, watchers, outcomes, read.heads)
    for name in ("gaps", "duplicates", "misordered", "finals_missing"):
        counts[f"client_{name}"] = sum(int(c[name]) for c in clients)
    counts["unplanned_process_exits"] = _unplanned_exits(run)
    counts["not_converged"] = 0 if converged_s is not None else 1
    ok = not any(counts.values())
    _print_table(run, counts, clients, converged_s, webhooks)
    wrong = invariants.wrong_final_states(outcomes)
    return {
        "ok": ok,
        **counts,
        "convergence_s": round(converged_s, 1) if converged_s is not None else None,
        "flagged_for_reconciliation": sum(o.flagged for o in outcomes),
        "wrong_tasks": [
            {"task_id": o.task_id, "status": o.status, "provider_status": o.provider_status}
            for o in wrong
        ],
        "seed": run.config.seed,
        "tasks": len(run.created),
        "faults": [f"{f.kind}: {what}" for f, what in run.faults_done],
        "clients": clients,
        "restarts": {m.name: m.restarts for m in (run.cluster.members if run.cluster else [])},
        "data_dir": str(run.folder),
    }


async def _catch_up_and_read(run: Run, sandbox: httpx.AsyncClient, watchers: list[Any]) -> _Read:
    """The streams' heads; the clients given ``catch_up_timeout_s`` to read up to them; then
    the sandbox's stats and the rows the invariants are counted on."""
    conn = await _connect_retrying(run.real_database_url)
    try:
        heads: Heads = {}
        for project in run.projects:
            heads[project["project_id"]] = await _streams(conn, project["project_id"])
        deadline = time.monotonic() + run.config.catch_up_timeout_s
        behind = [w for w in watchers if w.last_seq < heads[w.log.project_id][0]]
        while behind and time.monotonic() < deadline:
            await asyncio.sleep(0.5)  # the clients reconnect and replay by themselves
            behind = [w for w in behind if w.last_seq < heads[w.log.project_id][0]]
        stats = (
            await sandbox.get("/_sandbox/stats", params={"keys": "1", "delivered": "1"})
        ).json()
        stored = {
            r["dedup_key"]
            for r in await conn.fetch(
                "SELECT dedup_key FROM provider_callback_inbox WHERE provider = 'sandbox'"
            )
        }
        attempts = {
            r["client_request_id"]
            for r in await conn.fetch("SELECT client_request_id FROM task_attempts")
        }
        duplicates = await _duplicates(conn)
    finally:
        await conn.close()
    return _Read(heads, stats, stored, attempts, duplicates)


def _counts(outcomes: list[invariants.TaskOutcome], read: _Read) -> dict[str, int]:
    """The violations of the server side: final states, generations, webhooks, side effects."""
    stats, stored, attempts = read.stats, read.stored, read.attempts
    keys = stats["generations"].get("create_requests_by_key", {})
    webhooks = stats["webhooks"]
    counts: dict[str, int] = {
        "wrong_final_state": len(invariants.wrong_final_states(outcomes)),
        "duplicate_generations": stats["generations"]["created"]
        - len(keys)
        + len(set(keys) - attempts),
        "forged_accepted": int(webhooks.get("forged_accepted", 0)),
        "stale_accepted": int(webhooks.get("stale_accepted", 0)),
        "acknowledged_not_stored": len(set(stats.get("webhooks_delivered_ids", [])) - stored),
        **read.duplicates,
    }
    return counts


def _client_checks(
    run: Run, watchers: list[Any], outcomes: list[invariants.TaskOutcome], heads: Heads
) -> list[dict[str, Any]]:
    """Every client's stream checked against its project's head and final states."""
    finals = {
        project["project_id"]: {
            o.task_id: (o.status, o.version)
            for o in outcomes
            if o.project_id == project["project_id"]
        }
        for project in run.projects
    }
    clients: list[dict[str, Any]] = []
    for w in watchers:
        log_ = w.finish()
        head, coalesce = heads[log_.project_id]
        check = invariants.check_stream(log_, head, finals[log_.project_id], coalesce)
        clients.append(
            {
                "client": log_.name,
                "transport": log_.transport,
                "frames": len(log_.frames),
                "connects": log_.connects,
                "evictions": log_.evictions,
                **{
                    k: getattr(check, k)
                    for k in ("gaps", "duplicates", "misordered", "finals_missing", "resets")
                },
            }
        )
    return clients


def _unplanned_exits(run: Run) -> int:
    """Role process exits that the schedule did not cause."""
    # A role process may exit only when the schedule killed it: an outage must pause it, never
    # end it (the cluster would restart it, which would hide the bug).
    killed = sum(
        1
        for fault, what in run.faults_done
        if fault.kind is FaultKind.KILL_PROCESS and what.startswith("SIGKILL")
    )
    members = run.cluster.members if run.cluster else []
    restarts = sum(m.restarts for m in members if m.kind == "role")
    return max(0, restarts - killed)


def _print_table(
    run: Run,
    counts: dict[str, int],
    clients: list[dict[str, Any]],
    converged_s: float | None,
    webhooks: dict[str, Any],
) -> None:
    print("\nfaults injected:")
    for fault, what in run.faults_done:
        print(f"  {fault.at_s:6.1f}s  {fault.kind:<18} {what}")
    print("\ninvariants (violations; every one must be 0):")
    print(invariants.table(sorted(counts.items())))
    took = f"{converged_s:.1f} s" if converged_s is not None else "NOT within the timeout"
    print(f"\nconvergence after the last fault: {took}")
    print("webhooks: " + ", ".join(f"{k} {v}" for k, v in sorted(webhooks.items())))
    print("\nclients:")
    for c in clients:
        print("  " + "  ".join(f"{k}={v}" for k, v in c.items()))
    print(flush=True)
