"""The real state service against the pure model: same interleavings, same outcome."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime

from hypothesis import HealthCheck, given, settings

from aivedio.config import DatabaseConfig
from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderObservation
from aivedio.domain.statuses import Status
from aivedio.state.service import StateService
from tests.integration.helpers import make_project, make_task, store
from tests.model import FINAL_TARGET, Script, clock_after, scripts

CURRENT = uuid.UUID(int=1)
OLD = uuid.UUID(int=2)


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now()

    def __call__(self) -> datetime:
        return self.now


async def replay(url: str, script: Script) -> None:
    db = await Database.connect(DatabaseConfig(url=url, min_size=1, max_size=2))
    try:
        clock = Clock()
        state = StateService(db, clock=clock)
        project = await make_project(db, tenant=uuid.uuid4().hex, project="p")
        task_id, attempt_id = await make_task(store(db, state), project)
        applied, published = 0, [1]
        for obs, now in zip(script.arrivals, clock_after(script.gaps_ms), strict=True):
            clock.now = now
            target = attempt_id if obs.attempt_id == CURRENT else uuid.uuid4()
            real = ProviderObservation(
                provider=obs.provider,
                attempt_id=target,
                status=obs.status,
                source=obs.source,
                provider_sequence=obs.provider_sequence,
                progress=obs.progress,
            )
            result = await state.apply(real)
            if result.event is not None:
                applied += 1
                if result.event.public:  # a version that changes no public field is no event
                    published.append(result.event.version)
        async with db.connection() as conn:
            task = await conn.fetchrow("SELECT * FROM generation_tasks WHERE id = $1", task_id)
            versions = [
                r["task_version"]
                for r in await conn.fetch(
                    "SELECT task_version FROM task_events WHERE task_id = $1 ORDER BY seq", task_id
                )
            ]
        assert Status(task["status"]) is FINAL_TARGET[script.final]
        assert versions == published
        assert task["version"] == applied + 1
    finally:
        await db.close()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(script=scripts(CURRENT, OLD))
def test_real_service_converges_like_the_model(database_url: str, script: Script) -> None:
    asyncio.run(replay(database_url, script))
