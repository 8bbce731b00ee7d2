"""The sandbox provider's runtime: generations, chaos, webhooks, files and counters wired together.

``SandboxProvider`` owns every piece of state; the HTTP layer (``app.py``) only parses requests,
calls it and renders answers. ``start``/``stop`` run in the app lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections import Counter
from typing import Any

from aivedio.sandbox.chaos import Chaos, Dice
from aivedio.sandbox.config import SandboxConfig
from aivedio.sandbox.media import CONTENT_TYPE, FileSigner, sample_mp4
from aivedio.sandbox.scheduler import Scheduler
from aivedio.sandbox.simulation import (
    FAILED,
    SUCCEEDED,
    CreateRequest,
    Generation,
    Simulator,
    iso,
)
from aivedio.sandbox.stats import RateCap, Stats
from aivedio.sandbox.webhooks import Delivery, WebhookDispatcher

CONTRADICTION_DELAY_S = (0.1, 0.5)
CONTRADICTORY_ERROR = {
    "code": "contradictory_terminal",
    "message": "The sandbox provider changed its mind about this generation.",
}


class SandboxProvider:
    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.chaos = Chaos(seed=config.seed)
        self.dice = Dice(config.seed)
        self.stats = Stats(config.stats_window_s)
        self.rate_cap = RateCap(config.rate_cap_qps)
        self.scheduler = Scheduler()
        self.simulator = Simulator(
            self.scheduler,
            self._changed,
            queue_s=config.queue_s,
            duration_s=config.duration_s,
            steps=config.steps,
        )
        self.webhooks = WebhookDispatcher(
            config, self.scheduler, self.stats, self.dice, lambda: self.chaos
        )
        file_key = hmac.new(config.api_key.encode(), b"sandbox-files", hashlib.sha256).digest()
        self.files = FileSigner(file_key, config.base_url)
        self.video = b""
        self._loop_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.video = await asyncio.to_thread(sample_mp4)
        await self.webhooks.start()
        self._loop_task = asyncio.create_task(self.scheduler.run())

    @property
    def started(self) -> bool:
        return self._loop_task is not None

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        await self.webhooks.close()

    # -- chaos and counters ------------------------------------------------------------------

    def set_chaos(self, chaos: Chaos) -> None:
        if chaos.seed != self.chaos.seed:
            self.dice.reseed(chaos.seed)
        self.chaos = chaos

    def reset(self) -> None:
        """Every knob back to its default and every counter to zero; generations stay."""
        self.chaos = Chaos(seed=self.config.seed)
        self.dice.reseed(self.config.seed)
        self.stats.reset()
        self.rate_cap = RateCap(self.config.rate_cap_qps)

    def stats_json(self, *, keys: bool, delivered: bool = False) -> dict[str, Any]:
        by_status = Counter(g.status for g in self.simulator.generations.values())
        return self.stats.to_json(
            in_flight=len(self.simulator.generations)
            - sum(by_status[s] for s in ("succeeded", "failed", "canceled")),
            stored=len(self.simulator.generations),
            by_status=dict(by_status),
            keys=keys,
            delivered=delivered,
        )

    # -- generations -------------------------------------------------------------------------

    def view(self, generation: Generation) -> dict[str, Any]:
        """The ``GET /v1/generations/{id}`` body (also the webhook's ``data``)."""
        output = None
        if generation.status == SUCCEEDED:
            output = self._output(generation.id)
        return {
            "id": generation.id,
            "status": generation.status,
            "progress": generation.progress,
            "sequence": generation.sequence,
            "updated_at": iso(generation.updated_at),
            "error": generation.error,
            "output": output,
            "metadata": generation.request.metadata,
        }

    def _output(self, generation_id: str) -> dict[str, Any]:
        url, expires = self.files.url(generation_id, time.time() + self.config.output_url_ttl_s)
        return {"url": url, "content_type": CONTENT_TYPE, "expires_at": iso(expires)}

    async def create(self, key: str, request: CreateRequest) -> tuple[Generation, bool]:
        """Create (or find) the generation for ``key``; applies the submit-side chaos.

        The generation is recorded before any chaos wait, so a client that times out has still
        created exactly one generation, and its retry with the same key finds it.
        """
        self.stats.create_requests += 1
        self.stats.keys[key] += 1
        chaos = self.chaos
        generation, created = self.simulator.create(key, request, fast=chaos.fast)
        if not created:
            self.stats.replays += 1
            return generation, False
        self.stats.created += 1
        # A held generation sends no webhook of its own: not even the creation's, early or not.
        urgent = not request.script.hold and self.dice.roll(chaos.callback_before_submit_response)
        delivery = None if request.script.hold else self._announce(generation, urgent=urgent)
        if urgent and delivery is not None and delivery.answered is not None:
            self.stats.chaos["callback_before_submit_response"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(delivery.answered), self.config.callback_wait_s
                )
        if self.dice.roll(chaos.submit_timeout_after_accept):
            self.stats.chaos["submit_timeout_after_accept"] += 1
            await asyncio.sleep(self.config.submit_hold_s)
        return generation, True

    def cancel(self, generation: Generation) -> bool:
        return self.simulator.cancel(generation)

    def _changed(self, generation: Generation) -> None:
        self._announce(generation, urgent=False)
        if generation.status in (SUCCEEDED, FAILED) and self.dice.roll(
            self.chaos.contradictory_terminal
        ):
            self.stats.chaos["contradictory_terminal"] += 1
            self.scheduler.call_later(
                self.dice.uniform(*CONTRADICTION_DELAY_S), lambda: self._contradict(generation)
            )

    def _announce(self, generation: Generation, *, urgent: bool) -> Delivery | None:
        url = generation.request.webhook_url
        if url is None:
            return None
        return self.webhooks.publish(
            generation.id, generation.sequence, url, self.view(generation), urgent=urgent
        )

    def _contradict(self, generation: Generation) -> None:
        """A webhook with the other terminal status and the next sequence; the record stays."""
        url = generation.request.webhook_url
        if url is None:
            return
        data = self.view(generation)
        if generation.status == SUCCEEDED:
            data.update(status=FAILED, error=CONTRADICTORY_ERROR, output=None)
        else:
            data.update(
                status=SUCCEEDED, progress=100, error=None, output=self._output(generation.id)
            )
        data["sequence"] = generation.sequence + 1
        data["updated_at"] = iso(time.time())
        self.webhooks.publish(generation.id, generation.sequence + 1, url, data, urgent=False)
