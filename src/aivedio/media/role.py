"""The ``media`` role: the media consumer plus a media worker in one process.

Register in ``roles.AVAILABLE`` as ``"media": media_role``. Configuration comes from the runtime's
settings: the bus at ``urls.nats_url``, the object store under ``settings.data_dir / "media"``,
the sandbox locator at ``settings.sandbox_url`` with ``settings.sandbox_api_key``.
"""

from __future__ import annotations

import asyncio

import httpx
from starlette.routing import BaseRoute

from aivedio.bus.port import BusConfig
from aivedio.media.config import MediaConfig
from aivedio.media.consumer import MediaConsumer
from aivedio.media.playback import PlaybackConfig, playback_routes
from aivedio.media.sandbox_locator import SandboxLocatorConfig, SandboxOutputLocator
from aivedio.media.worker import MediaWorker
from aivedio.process.parts import RoleLoop, RoleParts
from aivedio.propagation.roles import connect_bus
from aivedio.runtime import Runtime
from aivedio.storage.filesystem import FileSystemObjectStore, FileSystemStoreConfig


async def media_role(
    rt: Runtime, config: MediaConfig | None = None, bus_config: BusConfig | None = None
) -> RoleParts:
    config = config or MediaConfig(lease_s=rt.settings.media_lease_s)
    settings = rt.settings
    store = media_store(rt)

    async def consume(stopping: asyncio.Event) -> None:
        bus = await connect_bus(
            bus_config or BusConfig.from_settings(rt.settings, rt.urls.nats_url, rt.urls.redis_url),
            stopping,
        )
        if bus is None:
            return
        try:
            await MediaConsumer(rt.db, config).run(bus, stopping)
        finally:
            await bus.close()

    async def work(stopping: asyncio.Event) -> None:
        async with httpx.AsyncClient(max_redirects=config.fetch.max_redirects) as http:
            locator = SandboxOutputLocator(
                SandboxLocatorConfig(settings.sandbox_url, settings.sandbox_api_key), http
            )
            worker = MediaWorker(rt.db, rt.state, store, locator, http, config)
            await worker.run(stopping)

    return RoleParts(loops=[RoleLoop("consumer", consume), RoleLoop("worker", work)])


def media_store(rt: Runtime) -> FileSystemObjectStore:
    """The object store every media role and the API share (``<data_dir>/media``)."""
    return FileSystemObjectStore(FileSystemStoreConfig(root=rt.settings.data_dir / "media"))


def playback_routes_for(rt: Runtime, ttl_s: int = 300) -> list[BaseRoute]:
    """The playback routes for the ``api`` role: ``RoleParts(routes=playback_routes_for(rt))``.
    The signing key is derived from the master secret for this purpose only."""
    config = PlaybackConfig(secret=rt.settings.derived_secret("media-playback"), ttl_s=ttl_s)
    return playback_routes(rt.db, media_store(rt), config)
