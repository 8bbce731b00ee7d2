from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from aivedio.api.app import create_app
from aivedio.config import ApiConfig
from aivedio.db.pool import Database
from aivedio.state.service import StateService
from tests.integration.helpers import Project, make_project, store


@dataclass
class Api:
    client: httpx.AsyncClient
    project: Project
    db: Database
    state: StateService

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.project.api_key}"}

    def tasks_url(self, project_id: object | None = None) -> str:
        return f"/v1/projects/{project_id or self.project.project_id}/tasks"


@pytest.fixture
async def api(db: Database) -> AsyncIterator[Api]:
    state = StateService(db)
    app = create_app(db, store(db, state), ApiConfig())
    project = await make_project(db)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield Api(client, project, db, state)
