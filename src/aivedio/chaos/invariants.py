"""What must hold after a chaos run, as pure checks over what the run observed.

Each check returns a count of violations; :func:`table` lays them out for the terminal and
``ok`` is true only when every count is zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "ClientLog",
    "StreamCheck",
    "TaskOutcome",
    "check_stream",
    "table",
    "wrong_final_states",
]

PROVIDER_TO_TASK = {"succeeded": "ready", "failed": "failed", "canceled": "canceled"}


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    task_id: str
    project_id: str
    provider_status: str | None  # the sandbox's stored (true) status of the generation
    status: str  # the task's status in aivedio at the end
    version: int
    flagged: bool = False  # an open contradictory-terminal reconciliation item names the task


def wrong_final_states(tasks: Iterable[TaskOutcome]) -> list[TaskOutcome]:
    """Tasks whose final status is not the one the provider's truth implies, and that no open
    reconciliation item flags.

    A provider that contradicts itself (``contradictory_terminal``: ``failed`` with the next
    sequence after ``succeeded``, or the reverse) may be believed in the wrong order: the later
    sequence wins, and the task keeps the terminal it reached first; the contradiction opens a
    reconciliation item for an operator instead of overwriting a terminal state (seed 004).
    Such a task is flagged, not wrong, once it is final; one that is wrong and unflagged, or
    flagged but not final, is a violation."""
    wrong = []
    finals = set(PROVIDER_TO_TASK.values())
    for task in tasks:
        expected = PROVIDER_TO_TASK.get(task.provider_status or "")
        if expected is not None and task.status == expected:
            continue
        if task.flagged and task.status in finals:
            continue
        wrong.append(task)
    return wrong


@dataclass
class ClientLog:
    """What one chaos client saw, in arrival order."""

    name: str
    project_id: str
    transport: str
    start_seq: int  # the cursor it started from (the snapshot's seq)
    frames: list[tuple[str, int | None, dict[str, object]]] = field(default_factory=list)
    """(event, seq, data) of every frame received, duplicates included."""
    connects: int = 0
    evictions: int = 0


@dataclass(frozen=True, slots=True)
class StreamCheck:
    gaps: int  # seqs up to the head that never arrived (and were not coalesced away)
    duplicates: int  # frames with a seq that had arrived before
    misordered: int  # frames with a seq below one that arrived before them (not a duplicate)
    finals_missing: int  # tasks of the project whose final event did not arrive
    resets: int  # `reset` frames (none expected: the run never moves a floor or an epoch)


def check_stream(
    log: ClientLog,
    head: int,
    finals: Mapping[str, tuple[str, int]],
    coalesce_keys: Mapping[int, tuple[str, str, str] | None],
) -> StreamCheck:
    """One client against its project's stream head, its tasks' final (status, version), and
    each event's coalescing key (``(task, status, stage)`` for a non-final event, else None).

    A seq that never arrived is not a gap when the gateway may have coalesced it away: a later
    seq with the same key arrived (a slow connection's queue keeps only the newest progress of a
    task's stage, docs/explanation/realtime-gateway.md)."""
    seen: set[int] = set()
    duplicates = misordered = resets = 0
    highest = log.start_seq
    expected_from = log.start_seq
    got_final: set[str] = set()
    for event, seq, data in log.frames:
        if event == "reset":
            resets += 1
            if seq is not None:  # the stream goes on from the reset cursor
                expected_from = max(expected_from, seq)
                highest = max(highest, seq)
            continue
        if event != "task.status" or seq is None:
            continue
        if seq in seen:
            duplicates += 1
            continue
        if seq < highest:
            misordered += 1
        seen.add(seq)
        highest = max(highest, seq)
        task_id = str(data.get("task_id"))
        final = finals.get(task_id)
        if (
            final is not None
            and data.get("status") == final[0]
            and data.get("task_version") == final[1]
        ):
            got_final.add(task_id)
    arrived_keys = {coalesce_keys.get(s) for s in seen} - {None}
    later: dict[tuple[str, str, str], int] = {}
    for s in seen:
        key = coalesce_keys.get(s)
        if key is not None:
            later[key] = max(later.get(key, 0), s)
    missing = set(range(expected_from + 1, head + 1)) - seen
    gaps = 0
    for s in missing:
        key = coalesce_keys.get(s)
        if key is None or key not in arrived_keys or later[key] < s:
            gaps += 1
    finals_missing = len(set(finals) - got_final)
    return StreamCheck(gaps, duplicates, misordered, finals_missing, resets)


def table(rows: Sequence[tuple[str, int | float | str]]) -> str:
    """``invariant  value`` rows, aligned."""
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name.ljust(width)}  {value}" for name, value in rows)
