"""The per-connection queue used while a socket is not writable: bounded, coalescing.

A healthy connection never has one: frames go straight to the socket. When the socket's buffer
passes its high-water mark, events wait here. A progress-only event replaces the queued event of
the same task with the same status and stage (only the newest progress matters); a status or
stage change and a final event are never dropped. Past the bounds the connection is closed with
``slow`` and resumes by cursor.
"""

from __future__ import annotations

from aivedio.gateway.frames import Event


class PendingQueue:
    __slots__ = ("events", "max_bytes", "max_events", "size")

    def __init__(self, max_events: int, max_bytes: int) -> None:
        self.events: list[Event] = []
        self.size = 0
        self.max_events = max_events
        self.max_bytes = max_bytes

    def push(self, event: Event) -> bool:
        """Queue ``event``; ``False`` when the queue is over its bounds (the caller evicts)."""
        if event.coalesce is not None:
            for i in range(len(self.events) - 1, -1, -1):
                older = self.events[i]
                if older.task_id == event.task_id:
                    if older.coalesce == event.coalesce:
                        del self.events[i]
                        self.size -= len(older.frame)
                    break
        self.events.append(event)
        self.size += len(event.frame)
        return len(self.events) <= self.max_events and self.size <= self.max_bytes

    def take(self) -> list[Event]:
        events, self.events, self.size = self.events, [], 0
        return events

    def __len__(self) -> int:
        return len(self.events)
