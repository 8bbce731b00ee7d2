"""A stalled client is evicted with ``slow``; another client of the same project is unaffected."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.integration.test_gateway_harness import EnvFactory, collect, make_env, open_stalled, seqs
from tests.waiting import eventually

__all__ = ["make_env"]


def closes(caplog: pytest.LogCaptureFixture, reason: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.getMessage() == "stream closed" and getattr(r, "fields", {}).get("reason") == reason
    ]


async def test_stalled_client_is_evicted_while_others_keep_receiving(
    make_env: EnvFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aivedio.gateway")
    env = await make_env(
        socket_send_buffer=4096,
        write_high_water=4096,
        write_low_water=1024,
        queue_max_events=8,
        queue_max_bytes=4096,
        stall_timeout_s=3.0,
    )
    stalled = await open_stalled(
        env.base_url,
        f"GET /v1/projects/{env.project.project_id}/events HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {env.project.api_key}\r\n\r\n",
    )
    healthy = env.client()
    await healthy.snapshot()
    stream = healthy.connect_once()
    reader = asyncio.ensure_future(collect(stream, lambda fs: len(seqs(fs)) >= 300, timeout=60))
    await env.joined(2)  # the stalled one too
    for _ in range(300):
        await env.new_task()
    got = await reader
    assert seqs(got) == list(range(1, 301))
    await eventually(lambda: closes(caplog, "slow"), "the slow close logged", 10)
    slow = closes(caplog, "slow")
    assert len(slow) == 1
    assert slow[0].fields["duration_s"] >= 0  # type: ignore[attr-defined]
    stalled.close()
    await healthy.aclose()
