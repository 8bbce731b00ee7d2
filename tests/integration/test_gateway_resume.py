"""Exact resume: every reset case, and subscribe-then-replay while events keep committing."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.test_gateway_harness import EnvFactory, collect, make_env, seqs

__all__ = ["make_env"]


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("other_epoch", "other_epoch"),
        ("ahead", "ahead_of_head"),
        ("below_floor", "below_floor"),
        ("too_large", "replay_too_large"),
    ],
)
async def test_every_reset_case(make_env: EnvFactory, case: str, reason: str) -> None:
    env = await make_env(replay_cap=3)
    for _ in range(5):
        await env.new_task()
    epoch, head = await env.head()
    cursor = {
        "other_epoch": f"{epoch + 1}-2",
        "ahead": f"{epoch}-{head + 10}",
        "below_floor": f"{epoch}-1",
        "too_large": f"{epoch}-0",
    }[case]
    if case == "below_floor":
        async with env.db.connection() as conn:
            await conn.execute(
                "UPDATE event_streams SET floor = 3 WHERE project_id = $1",
                env.project.project_id,
            )
    client = env.client()
    client.view.cursor = cursor
    frames = client.connect_once()
    got = await collect(frames, lambda fs: any(f.event == "reset" for f in fs))
    reset = got[-1]
    assert reset.data["reason"] == reason
    assert reset.data["cursor"] == f"{epoch}-{head}"
    assert reset.id == f"{epoch}-{head}"
    assert seqs(got) == []  # never a silent partial replay
    # The stream goes on from the reset position.
    await env.new_task()
    more = await collect(frames, lambda fs: len(seqs(fs)) >= 1)
    assert seqs(more) == [head + 1]
    await frames.aclose()
    await client.aclose()


async def test_a_valid_cursor_gets_no_reset(make_env: EnvFactory) -> None:
    env = await make_env(replay_cap=3, publish=False)
    for _ in range(5):
        await env.new_task()
    epoch, _ = await env.head()
    client = env.client()
    client.view.cursor = f"{epoch}-2"  # exactly at the cap
    got = await collect(client.connect_once(), lambda fs: len(seqs(fs)) >= 3)
    assert seqs(got) == [3, 4, 5]
    assert not [f for f in got if f.event == "reset"]
    await client.aclose()


async def test_events_committed_during_the_replay_are_neither_lost_nor_doubled(
    make_env: EnvFactory,
) -> None:
    env = await make_env(replay_page=20, replay_cap=1000)
    for _ in range(300):
        await env.new_task()
    epoch, _ = await env.head()
    done = asyncio.Event()

    async def write_more() -> None:
        for _ in range(150):
            await env.new_task()
        done.set()

    client = env.client()
    client.view.cursor = f"{epoch}-0"
    writer = asyncio.create_task(write_more())
    await asyncio.sleep(0.05)  # commits are under way while the client replays
    got = await collect(client.connect_once(), lambda fs: len(seqs(fs)) >= 450, timeout=60)
    await writer
    assert seqs(got) == list(range(1, 451))
    await client.aclose()
