"""Standard Webhooks delivery: signing, chaos (drop, duplicate, reorder, delay, forge), retries.

Each change of a generation becomes one message ``msg_<generation id>_<sequence>``. A fixed pool
of worker tasks sends the queued deliveries with httpx; delays, reorder holds and retries wait in
the shared scheduler, not in a task per message. A non-2xx answer or a transport error is retried
with exponential backoff (jittered) up to ``webhook_max_attempts`` times, with the same message id.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from aivedio.sandbox.chaos import Chaos, Dice
from aivedio.sandbox.config import SandboxConfig
from aivedio.sandbox.scheduler import Scheduler
from aivedio.sandbox.stats import Stats

log = logging.getLogger(__name__)

EVENT_TYPE = "generation.updated"
DUPLICATE_GAP_S = (0.0, 0.2)  # how long after the original a duplicate goes out
STALE_BY_S = 3600  # a stale copy's timestamp is this far back (Standard Webhooks tolerate 300 s)


def sign(keys: Sequence[bytes], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: ``v1,<base64 HMAC-SHA256>`` per key, space-separated."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return " ".join(
        "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
        for key in keys
    )


def event_body(data: dict[str, Any]) -> bytes:
    return json.dumps({"type": EVENT_TYPE, "data": data}, separators=(",", ":")).encode()


@dataclass(slots=True, eq=False)
class Delivery:
    msg_id: str
    generation_id: str
    url: str
    body: bytes
    forged: bool = False
    stale: bool = False  # signed correctly with a timestamp STALE_BY_S in the past: a replay
    attempts: int = 0
    # resolved with "the receiver answered 2xx" after the first attempt (callback before submit)
    answered: asyncio.Future[bool] | None = None
    # held (reordered) deliveries of the same generation, sent after this one's first attempt
    then_send: list[Delivery] = field(default_factory=list)

    def copy(self, *, forged: bool = False, stale: bool = False) -> Delivery:
        return Delivery(
            self.msg_id, self.generation_id, self.url, self.body, forged=forged, stale=stale
        )


class WebhookDispatcher:
    def __init__(
        self,
        config: SandboxConfig,
        scheduler: Scheduler,
        stats: Stats,
        dice: Dice,
        chaos: Callable[[], Chaos],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.keys = config.webhook_keys
        self.scheduler = scheduler
        self.stats = stats
        self.dice = dice
        self.chaos = chaos
        self.wall = wall
        self._forged_key = secrets.token_bytes(32)
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self._held: dict[str, Delivery] = {}
        self._workers: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        n = self.config.webhook_concurrency
        self._client = httpx.AsyncClient(
            timeout=self.config.webhook_timeout_s,
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            trust_env=False,
        )
        self._workers = [asyncio.create_task(self._work()) for _ in range(n)]

    async def close(self) -> None:
        for worker in self._workers:
            worker.cancel()
        for worker in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        self._workers = []
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def publish(
        self, generation_id: str, sequence: int, url: str, data: dict[str, Any], *, urgent: bool
    ) -> Delivery | None:
        """Queue one message, with the chaos knobs applied; ``None`` when nothing will be sent.

        ``urgent`` (the callback before the submit response) skips drop, delay and reorder.
        """
        chaos = self.chaos()
        counts = self.stats.webhooks
        if not chaos.webhooks_enabled:
            counts["disabled"] += 1
            return None
        counts["events"] += 1
        if not urgent and self.dice.roll(chaos.drop_rate):
            counts["dropped"] += 1
            return None
        delivery = Delivery(f"msg_{generation_id}_{sequence}", generation_id, url, event_body(data))
        if self.dice.roll(chaos.forge_signature_rate):
            counts["forged"] += 1
            self._later(self.dice.millis(chaos.delay_ms), delivery.copy(forged=True))
        if self.dice.roll(chaos.stale_signature_rate):
            counts["stale"] += 1
            self._later(self.dice.millis(chaos.delay_ms), delivery.copy(stale=True))
        if self.dice.roll(chaos.duplicate_rate):
            counts["duplicated"] += 1
            gap = self.dice.uniform(*DUPLICATE_GAP_S)
            self._later(self.dice.millis(chaos.delay_ms) + gap, delivery.copy())
        held = self._held.pop(generation_id, None)
        if held is not None:
            delivery.then_send.append(held)
        elif not urgent and self.dice.roll(chaos.reorder):
            counts["reordered"] += 1
            self._held[generation_id] = delivery
            self.scheduler.call_later(
                self.config.reorder_hold_s, lambda: self._release(generation_id, delivery)
            )
            return delivery
        if urgent:
            delivery.answered = asyncio.get_running_loop().create_future()
            self._queue.put_nowait(delivery)
        else:
            self._later(self.dice.millis(chaos.delay_ms), delivery)
        return delivery

    def _later(self, delay: float, delivery: Delivery) -> None:
        if delay <= 0:
            self._queue.put_nowait(delivery)
        else:
            self.scheduler.call_later(delay, lambda: self._queue.put_nowait(delivery))

    def _release(self, generation_id: str, delivery: Delivery) -> None:
        """A held message whose generation sent nothing newer within the hold goes out now."""
        if self._held.get(generation_id) is delivery:
            del self._held[generation_id]
            self._queue.put_nowait(delivery)

    async def _work(self) -> None:
        while True:
            delivery = await self._queue.get()
            try:
                await self._attempt(delivery)
            except Exception:
                log.exception("sandbox webhook delivery failed unexpectedly")

    async def _attempt(self, delivery: Delivery) -> None:
        assert self._client is not None
        timestamp = int(self.wall())
        if delivery.stale:  # correctly signed, but far outside any receiver's tolerance
            timestamp -= STALE_BY_S
        keys = (self._forged_key,) if delivery.forged else self.keys
        headers = {
            "content-type": "application/json",
            "webhook-id": delivery.msg_id,
            "webhook-timestamp": str(timestamp),
        }
        if keys:
            headers["webhook-signature"] = sign(keys, delivery.msg_id, timestamp, delivery.body)
        counts = self.stats.webhooks
        counts["sent"] += 1
        try:
            response = await self._client.post(delivery.url, content=delivery.body, headers=headers)
            ok = response.is_success
        except httpx.HTTPError as exc:
            log.debug("sandbox webhook %s to %s: %r", delivery.msg_id, delivery.url, exc)
            ok = False
        delivery.attempts += 1
        if delivery.attempts == 1:
            if delivery.answered is not None and not delivery.answered.done():
                delivery.answered.set_result(ok)
            for held in delivery.then_send:
                self._queue.put_nowait(held)
            delivery.then_send = []
        if delivery.forged:
            counts["forged_accepted" if ok else "forged_rejected"] += 1
        elif delivery.stale:
            counts["stale_accepted" if ok else "stale_rejected"] += 1
        elif ok:
            counts["delivered"] += 1
            self.stats.delivered_ids.add(delivery.msg_id)
        elif delivery.attempts < self.config.webhook_max_attempts:
            counts["retried"] += 1
            backoff = self.config.webhook_backoff_s * 2 ** (delivery.attempts - 1)
            delay = backoff * self.dice.uniform(0.8, 1.2)
            self.scheduler.call_later(delay, lambda: self._queue.put_nowait(delivery))
        else:
            counts["failed"] += 1
