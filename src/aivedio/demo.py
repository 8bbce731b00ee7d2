"""``aivedio demo``: everything on embedded services, the sandbox provider and the web UI.

Starts (or reuses) the embedded PostgreSQL / NATS / Valkey unless ``AIVEDIO_*_URL`` are set,
migrates, creates a demo project and key, starts the sandbox provider and every available role
in this one process, and prints how to use it.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import uvicorn

from aivedio.admin import create_project_in
from aivedio.config import Settings
from aivedio.db.migrate import migrate
from aivedio.logs import setup_logging
from aivedio.process.eventloop import run_loop
from aivedio.process.http_server import QuietServer
from aivedio.roles import AVAILABLE, serve
from aivedio.runtime import Runtime, resolve_urls
from aivedio.sandbox import SandboxConfig, create_app

BODY = '{"provider": "sandbox", "model": "sbx-1", "prompt": "a cat", "params": {}}'


def sandbox_config(settings: Settings) -> SandboxConfig:
    secrets = tuple(s.strip() for s in settings.sandbox_webhook_secrets.split(",") if s.strip())
    return SandboxConfig(
        api_key=settings.sandbox_api_key,
        webhook_secrets=secrets,
        public_url=settings.sandbox_url,
    )


async def _demo(settings: Settings, port: int) -> int:
    setup_logging(settings.log_level)
    urls = resolve_urls(settings)
    import asyncpg

    conn = await asyncpg.connect(urls.database_url)
    try:
        await migrate(conn)
        project = await create_project_in(conn, "demo", "demo")
    finally:
        await conn.close()
    sandbox = urlsplit(settings.sandbox_url)
    base = f"http://{settings.host}:{port}"
    print(
        json.dumps(
            {
                "api": base,
                "page": f"{base}/#project={project['project_id']}&key={project['api_key']}",
                "sandbox_provider": settings.sandbox_url,
                "project_id": project["project_id"],
                "api_key": project["api_key"],
                **urls.as_dict(),
            }
        ),
        flush=True,
    )
    print(
        f"\naivedio demo is running.\n"
        f"  create a task:\n"
        f"    curl -s -X POST {base}/v1/projects/{project['project_id']}/tasks \\\n"
        f"      -H 'Authorization: Bearer {project['api_key']}' -H 'Idempotency-Key: demo-1' \\\n"
        f"      -H 'Content-Type: application/json' \\\n"
        f"      -d '{BODY}'\n"
        f"  open the page: {base}/#project={project['project_id']}&key={project['api_key']}\n"
        f"  read it back: GET {base}/v1/projects/{project['project_id']}/tasks/<id>\n"
        f"  Ctrl-C stops the demo; `aivedio services down` stops the embedded servers.\n",
        flush=True,
    )
    rt = await Runtime.open(settings, urls)
    provider = QuietServer(
        uvicorn.Config(
            create_app(sandbox_config(settings)),
            host=sandbox.hostname or "127.0.0.1",
            port=sandbox.port or 8100,
            access_log=False,
            log_config=None,
        )
    )
    provider_job = asyncio.create_task(provider.serve())
    try:
        return await serve(rt, list(AVAILABLE), port)
    finally:
        provider.should_exit = True
        await asyncio.gather(provider_job, return_exceptions=True)
        await rt.close()


def run_demo(settings: Settings, port: int | None = None) -> int:
    port = port or settings.port
    return run_loop(_demo(settings.listening_on(port), port))
