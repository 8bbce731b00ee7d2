"""Dead letters for operators: ``aivedio bus dead-letters --group G`` and ``aivedio bus replay``.

The functions take a connected :class:`~aivedio.bus.Bus`; the ``*_command`` ones connect with a
:class:`~aivedio.bus.BusConfig`, print JSON lines (the last one a summary) and return an exit code.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from aivedio.bus import Bus, BusConfig, BusError, DeadLetter
from aivedio.bus.connect import connect

__all__ = [
    "dead_letters_command",
    "list_dead_letters",
    "replay_command",
    "replay_dead_letter",
]

DATA_PREVIEW = 2000  # characters of a dead letter's body shown in a listing


def _as_dict(letter: DeadLetter) -> dict[str, Any]:
    text = letter.data.decode("utf-8", errors="replace")
    return {
        "id": letter.id,
        "group": letter.group,
        "topic": letter.topic,
        "key": letter.key,
        "dedup_id": letter.dedup_id,
        "deliveries": letter.deliveries,
        "reason": letter.reason,
        "dead_at": datetime.fromtimestamp(letter.dead_at, UTC).isoformat(),
        "headers": dict(letter.headers),
        "size": len(letter.data),
        "data": text[:DATA_PREVIEW],
        "truncated": len(text) > DATA_PREVIEW,
    }


async def list_dead_letters(bus: Bus, group: str, limit: int = 100) -> list[dict[str, Any]]:
    """The oldest ``limit`` dead letters of ``group`` as JSON-ready dicts (id, topic, key,
    dedup_id, deliveries, reason, dead_at, headers, size, data preview)."""
    return [_as_dict(letter) for letter in await bus.dead_letters(group, limit)]


async def replay_dead_letter(bus: Bus, group: str, dead_letter_id: str) -> dict[str, Any]:
    """Deliver one dead letter again to ``group`` only; raises ``BusError`` if it is not there."""
    ack = await bus.replay_dead_letter(group, dead_letter_id)
    return {
        "replayed": dead_letter_id,
        "group": group,
        "stream": ack.stream,
        "sequence": ack.sequence,
        "duplicate": ack.duplicate,
    }


async def _connect(config: BusConfig) -> Bus:
    return await connect(config)


async def dead_letters_command(config: BusConfig, group: str, limit: int = 100) -> int:
    """Print one JSON line per dead letter, then ``{"group": ..., "count": ...}``."""
    bus = await _connect(config)
    try:
        letters = await list_dead_letters(bus, group, limit)
    finally:
        await bus.close()
    for letter in letters:
        print(json.dumps(letter), flush=True)
    print(json.dumps({"group": group, "count": len(letters)}), flush=True)
    return 0


async def replay_command(config: BusConfig, group: str, dead_letter_id: str) -> int:
    """Replay one dead letter; print the result as one JSON line; 1 if it does not exist."""
    bus = await _connect(config)
    try:
        result = await replay_dead_letter(bus, group, dead_letter_id)
    except BusError as exc:
        print(json.dumps({"error": str(exc), "group": group, "id": dead_letter_id}), flush=True)
        return 1
    finally:
        await bus.close()
    print(json.dumps(result), flush=True)
    return 0
