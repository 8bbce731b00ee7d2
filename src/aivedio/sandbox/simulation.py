"""Simulated generations: the request, the per-generation script, the timeline and the store.

A generation is queued, then running through a number of progress steps, then terminal
(``succeeded``, ``failed`` or ``canceled``, as ``params.sandbox`` scripts it). Every change
increments ``sequence``. Only the next transition of each generation sits in the scheduler.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aivedio.sandbox.scheduler import Scheduler

QUEUED = "queued"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELED = "canceled"
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELED})

# ``chaos.fast``: the default timeline shrinks so a generation finishes well under one second.
FAST_QUEUE_S = 0.1
FAST_DURATION_S = 0.5
FAST_MAX_STEPS = 3

MAX_STEPS = 100
DEFAULT_ERROR_CODE = "generation_failed"
DEFAULT_ERROR_MESSAGE = "The sandbox provider failed this generation as scripted."


class RequestError(ValueError):
    """A create request the sandbox rejects with 422; ``code`` is stable, the message is prose."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def iso(ts: float) -> str:
    """A unix time as ISO 8601 UTC with a ``Z``."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class Script:
    """How one generation plays out (``params.sandbox``; unset fields take the defaults)."""

    outcome: str = SUCCEEDED
    queue_s: float | None = None
    duration_s: float | None = None
    steps: int | None = None
    error_code: str = DEFAULT_ERROR_CODE
    error_message: str = DEFAULT_ERROR_MESSAGE
    hold: bool = False
    """Stay ``queued``: no timeline and no webhook of its own (not even the creation's), so
    only the caller moves it (a cancel; a benchmark's own webhooks to the receiver)."""


def _number(name: str, value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise RequestError("invalid_sandbox_params", f"params.sandbox.{name} is a number >= 0")


def parse_script(params: dict[str, Any]) -> Script:
    raw = params.get("sandbox")
    if raw is None:
        return Script()
    if not isinstance(raw, dict):
        raise RequestError("invalid_sandbox_params", "params.sandbox is an object")
    unknown = sorted(set(raw) - set(Script.__dataclass_fields__))
    if unknown:
        raise RequestError(
            "invalid_sandbox_params", f"unknown params.sandbox fields: {', '.join(unknown)}"
        )
    outcome = raw.get("outcome", SUCCEEDED)
    if outcome not in TERMINAL:
        raise RequestError(
            "invalid_sandbox_params", "params.sandbox.outcome is succeeded, failed or canceled"
        )
    steps = raw.get("steps")
    if steps is not None and (
        not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS
    ):
        raise RequestError("invalid_sandbox_params", f"params.sandbox.steps is 1..{MAX_STEPS}")
    for name in ("error_code", "error_message"):
        if name in raw and not isinstance(raw[name], str):
            raise RequestError("invalid_sandbox_params", f"params.sandbox.{name} is a string")
    hold = raw.get("hold", False)
    if not isinstance(hold, bool):
        raise RequestError("invalid_sandbox_params", "params.sandbox.hold is true or false")
    return Script(
        outcome=outcome,
        queue_s=_number("queue_s", raw["queue_s"]) if "queue_s" in raw else None,
        duration_s=_number("duration_s", raw["duration_s"]) if "duration_s" in raw else None,
        steps=steps,
        error_code=raw.get("error_code", DEFAULT_ERROR_CODE),
        error_message=raw.get("error_message", DEFAULT_ERROR_MESSAGE),
        hold=hold,
    )


@dataclass(frozen=True, slots=True)
class CreateRequest:
    model: str
    prompt: str
    params: dict[str, Any]
    webhook_url: str | None
    metadata: dict[str, Any]
    script: Script


def parse_create(body: object) -> CreateRequest:
    if not isinstance(body, dict):
        raise RequestError("invalid_body", "the body is a JSON object")
    model, prompt = body.get("model"), body.get("prompt", "")
    if not isinstance(model, str) or not model:
        raise RequestError("invalid_body", "model is a non-empty string")
    if not isinstance(prompt, str):
        raise RequestError("invalid_body", "prompt is a string")
    params = body.get("params") or {}
    metadata = body.get("metadata") or {}
    if not isinstance(params, dict) or not isinstance(metadata, dict):
        raise RequestError("invalid_body", "params and metadata are objects")
    webhook_url = body.get("webhook_url")
    if webhook_url is not None and (
        not isinstance(webhook_url, str) or not webhook_url.startswith(("http://", "https://"))
    ):
        raise RequestError("invalid_body", "webhook_url is an http(s) URL or null")
    return CreateRequest(model, prompt, params, webhook_url, metadata, parse_script(params))


@dataclass(frozen=True, slots=True)
class Step:
    at: float  # seconds after creation
    status: str
    progress: int


def plan(script: Script, queue_s: float, duration_s: float, steps: int) -> tuple[Step, ...]:
    """The timeline: queued at 0, running at ``queue_s``, progress steps, then the outcome;
    a held generation's is only ``queued`` at 0."""
    if script.hold:
        return (Step(0.0, QUEUED, 0),)
    queue_s = script.queue_s if script.queue_s is not None else queue_s
    duration_s = script.duration_s if script.duration_s is not None else duration_s
    steps = script.steps if script.steps is not None else steps
    timeline = [Step(0.0, QUEUED, 0), Step(queue_s, RUNNING, 0)]
    for i in range(1, steps):
        timeline.append(Step(queue_s + duration_s * i / steps, RUNNING, round(100 * i / steps)))
    final = 100 if script.outcome == SUCCEEDED else timeline[-1].progress
    timeline.append(Step(queue_s + duration_s, script.outcome, final))
    return tuple(timeline)


@dataclass(slots=True, eq=False)
class Generation:
    id: str
    idempotency_key: str
    request: CreateRequest
    timeline: tuple[Step, ...]
    created_at: float  # unix time
    created_mono: float
    updated_at: float
    status: str = QUEUED
    progress: int = 0
    sequence: int = 1
    step: int = 0
    error: dict[str, str] | None = field(default=None)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def move(self, status: str, progress: int, now: float) -> None:
        self.status, self.progress, self.updated_at = status, progress, now
        self.sequence += 1
        if status == FAILED:
            script = self.request.script
            self.error = {"code": script.error_code, "message": script.error_message}
        elif status == CANCELED:
            self.error = {"code": "canceled", "message": "The generation was canceled."}


Listener = Callable[[Generation], None]


class Simulator:
    """The generation store and its clockwork; ``listener`` hears every change (the webhooks)."""

    def __init__(
        self,
        scheduler: Scheduler,
        listener: Listener,
        *,
        queue_s: float,
        duration_s: float,
        steps: int,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.scheduler = scheduler
        self.listener = listener
        self.defaults = (queue_s, duration_s, steps)
        self.wall = wall
        self.generations: dict[str, Generation] = {}
        self.by_key: dict[str, Generation] = {}

    def in_flight(self) -> int:
        return sum(1 for g in self.generations.values() if not g.terminal)

    def create(self, key: str, request: CreateRequest, *, fast: bool) -> tuple[Generation, bool]:
        """The generation for ``key``: the existing one (``False``) or a new one (``True``).

        The caller announces a new generation (its first, ``queued`` webhook); the listener hears
        only the changes after it.
        """
        existing = self.by_key.get(key)
        if existing is not None:
            return existing, False
        if fast:
            queue_s, duration_s, steps = FAST_QUEUE_S, FAST_DURATION_S, FAST_MAX_STEPS
            steps = min(steps, self.defaults[2])
        else:
            queue_s, duration_s, steps = self.defaults
        now = self.wall()
        generation = Generation(
            id="gen_" + secrets.token_hex(12),
            idempotency_key=key,
            request=request,
            timeline=plan(request.script, queue_s, duration_s, steps),
            created_at=now,
            created_mono=self.scheduler.clock(),
            updated_at=now,
        )
        self.generations[generation.id] = generation
        self.by_key[key] = generation
        self._schedule_next(generation)
        return generation, True

    def cancel(self, generation: Generation) -> bool:
        """Cancel a generation that is not terminal; ``False`` when it already is."""
        if generation.terminal:
            return generation.status == CANCELED
        generation.step = len(generation.timeline)
        generation.move(CANCELED, generation.progress, self.wall())
        self.listener(generation)
        return True

    def _schedule_next(self, generation: Generation) -> None:
        index = generation.step + 1
        if index >= len(generation.timeline):
            return
        due = generation.created_mono + generation.timeline[index].at
        self.scheduler.call_at(due, lambda: self._advance(generation, index))

    def _advance(self, generation: Generation, index: int) -> None:
        if generation.step != index - 1 or generation.terminal:
            return  # canceled (or otherwise moved) since this transition was scheduled
        step = generation.timeline[index]
        generation.step = index
        if (step.status, step.progress) != (generation.status, generation.progress):
            generation.move(step.status, step.progress, self.wall())
            self.listener(generation)
        self._schedule_next(generation)
