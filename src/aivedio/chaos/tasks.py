"""A chaos run's tasks: created over the first part of the fault window, each create retried with
its ``Idempotency-Key`` until it is accepted, each with a sandbox script of its own."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx

from aivedio.chaos.config import Created, Run

# -- tasks ----------------------------------------------------------------------------------------


def _script(rng: random.Random) -> dict[str, Any]:
    outcome = rng.choices(["succeeded", "failed", "canceled"], weights=[6, 2, 2])[0]
    if rng.random() < 0.3:  # a task that finishes in under a second
        return {"outcome": outcome, "queue_s": 0.1, "duration_s": 0.4, "steps": 2}
    return {
        "outcome": outcome,
        "queue_s": round(rng.uniform(0.1, 1.0), 2),
        "duration_s": round(rng.uniform(1.0, 6.0), 2),
        "steps": rng.randint(2, 5),
    }


async def _create_tasks(run: Run, http: httpx.AsyncClient, stopping: asyncio.Event) -> None:
    cfg = run.config
    spread = cfg.window_s * cfg.create_share
    for n in range(cfg.tasks):
        project = run.projects[n % len(run.projects)]
        key = f"chaos-{cfg.seed}-{n}"
        body = {
            "provider": "sandbox",
            "model": "sbx-1",
            "prompt": f"chaos task {n}",
            "params": {"sandbox": _script(run.rng)},
        }
        while not stopping.is_set():
            try:
                response = await http.post(
                    f"/v1/projects/{project['project_id']}/tasks",
                    json=body,
                    headers={
                        "Authorization": f"Bearer {project['api_key']}",
                        "Idempotency-Key": key,
                    },
                    timeout=10,
                )
                if response.status_code == 202:
                    task = response.json()["task"]
                    run.created.append(Created(task["id"], project["project_id"], key))
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)  # 503 while PostgreSQL is away, or the process restarting
        await asyncio.sleep(spread / max(1, cfg.tasks) * run.rng.uniform(0.5, 1.5))
