"""The ``task.status`` bus message as consumers read it, and the loop every consumer runs.

The outbox relay publishes each outbox row's ``payload`` (``state.events.domain_payload``) with
the task id as key: on topic ``task.status`` for a status change, on ``task.progress`` for a
version that moves only the progress (read by the notification dispatcher alone; the message
is the same object). Consumers read the INTERNAL ``status`` and are idempotent by their own
business keys; this module only parses and settles deliveries: ack after the handler
committed, nak with a delay when it failed (so a message that keeps failing reaches the dead
letters after ``max_deliver``), term for a message that is not parseable at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aivedio.bus.port import BusClosed, BusError, Consumer, Delivery
from aivedio.errors import DatabaseUnavailable
from aivedio.logs import log, trace_id_var
from aivedio.process import health

__all__ = ["TOPIC", "ConsumerSettings", "InvalidEvent", "StatusEvent", "parse_status_event"]

TOPIC = "task.status"
EVENT_TYPE = "task.status.changed"


class InvalidEvent(ValueError):
    """The message is not a task status event this code can read (a poison message)."""


@dataclass(frozen=True, slots=True)
class StatusEvent:
    task_id: uuid.UUID
    attempt_id: uuid.UUID | None
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    version: int
    status: str  # the internal status (domain.statuses.Status values)
    error_code: str | None
    trace_id: str | None


def _uuid(body: dict[str, Any], name: str, *, optional: bool = False) -> uuid.UUID | None:
    value = body.get(name)
    if value is None and optional:
        return None
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise InvalidEvent(f"{name} is not a UUID") from None


def parse_status_event(data: bytes) -> StatusEvent | None:
    """The event, or ``None`` for another event type (consumers ack and skip those)."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise InvalidEvent("not JSON") from None
    if not isinstance(body, dict):
        raise InvalidEvent("not a JSON object")
    if body.get("event_type") != EVENT_TYPE:
        return None
    version, status = body.get("aggregate_version"), body.get("status")
    if not isinstance(version, int) or not isinstance(status, str):
        raise InvalidEvent("aggregate_version or status missing")
    task_id, tenant_id, project_id = (
        _uuid(body, "aggregate_id"),
        _uuid(body, "tenant_id"),
        _uuid(body, "project_id"),
    )
    assert task_id is not None
    assert tenant_id is not None
    assert project_id is not None
    error_code, trace_id = body.get("error_code"), body.get("trace_id")
    return StatusEvent(
        task_id=task_id,
        attempt_id=_uuid(body, "attempt_id", optional=True),
        tenant_id=tenant_id,
        project_id=project_id,
        version=version,
        status=status,
        error_code=error_code if isinstance(error_code, str) else None,
        trace_id=trace_id if isinstance(trace_id, str) else None,
    )


@dataclass(frozen=True, slots=True)
class ConsumerSettings:
    batch: int = 100
    fetch_timeout_s: float = 1.0
    retry_delay_s: float = 2.0  # nak delay after a failed handler; pause after a bus outage


Handler = Callable[[StatusEvent], Awaitable[None]]


async def settle(
    delivery: Delivery,
    handle: Handler,
    settings: ConsumerSettings,
    logger: logging.Logger,
    stopping: asyncio.Event | None = None,
    held: Sequence[Delivery] = (),
) -> bool:
    """Parse, handle, then ack (or nak / term). Never raises for one bad message.

    A database outage is not the message's fault: a nak would count a delivery, and
    ``max_deliver`` of them would dead-letter a good message during a long enough outage. So
    the delivery, and ``held`` (the rest of its batch), are kept in progress (no redelivery,
    no delivery counted) and the handler is tried again every ``retry_delay_s`` until it works
    (True) or ``stopping`` is set (False: the delivery is nak'ed, ``held`` is left alone).
    """
    try:
        event = parse_status_event(delivery.data)
    except InvalidEvent as exc:
        log(logger, logging.ERROR, "poison message", dedup_id=delivery.dedup_id, error=str(exc))
        await delivery.term(f"invalid event: {exc}")
        return True
    token = trace_id_var.set(event.trace_id if event else None)
    try:
        while event is not None:
            try:
                await handle(event)
                break
            except DatabaseUnavailable as exc:
                if stopping is None or stopping.is_set():
                    await delivery.nak(settings.retry_delay_s)
                    return False
                log(logger, logging.WARNING, "database unavailable; holding the delivery")
                health.outage("database", exc)
                await _keep_in_progress([delivery, *held])
                await _pause(stopping, settings.retry_delay_s)
    except Exception as exc:  # the message comes back; after max_deliver it is dead-lettered
        log(
            logger,
            logging.WARNING,
            "handler failed, message will be redelivered",
            dedup_id=delivery.dedup_id,
            deliveries=delivery.deliveries,
            error=type(exc).__name__,
        )
        await delivery.nak(settings.retry_delay_s)
        return True
    finally:
        trace_id_var.reset(token)
    await delivery.ack()
    return True


async def consume(
    consumer: Consumer,
    handle: Handler,
    stopping: asyncio.Event,
    settings: ConsumerSettings,
    logger: logging.Logger,
) -> None:
    """Fetch and settle until ``stopping`` is set; a bus or database outage pauses, never ends,
    the loop."""
    while not stopping.is_set():
        try:
            deliveries = await consumer.fetch(settings.batch, settings.fetch_timeout_s)
        except BusClosed:
            if stopping.is_set():
                return
            raise
        except BusError as exc:
            log(logger, logging.WARNING, "bus unavailable", error=type(exc).__name__)
            health.outage("bus", exc)
            await _pause(stopping, settings.retry_delay_s)
            continue
        health.recovered()
        for i, delivery in enumerate(deliveries):
            try:
                if not await settle(
                    delivery, handle, settings, logger, stopping, deliveries[i + 1 :]
                ):
                    break  # stopping during an outage: the rest comes back after ack_wait
            except (
                BusError
            ) as exc:  # ack / nak lost: the message comes back, handlers are idempotent
                log(logger, logging.WARNING, "settle failed", error=type(exc).__name__)


async def _keep_in_progress(deliveries: Sequence[Delivery]) -> None:
    """Reset the ack wait of each (best effort: one that is redelivered meanwhile is handled
    again, idempotently)."""
    for delivery in deliveries:
        try:
            await delivery.in_progress()
        except BusError:
            return  # the bus is away too; the deliveries come back after ack_wait


async def _pause(stopping: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)
