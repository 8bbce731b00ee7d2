"""The roles of ingest: ``callbacks`` (the callback gateway on the shared HTTP port) and ``inbox``
(the inbox processor)."""

from __future__ import annotations

import asyncio

from aivedio.ingest.gateway import CallbackConfig, callback_routes
from aivedio.ingest.group_commit import GroupCommitConfig, InboxWriter
from aivedio.ingest.processor import InboxConfig, InboxProcessor
from aivedio.process.parts import RoleLoop, RoleParts
from aivedio.providers.registry import build_providers, callback_providers, providers_config
from aivedio.runtime import Runtime


async def callbacks_role(rt: Runtime) -> RoleParts:
    adapters = build_providers(providers_config(rt.settings))
    writer = InboxWriter(
        rt.db,
        GroupCommitConfig(max_inflight=rt.settings.callback_max_inflight),
        on_stored=rt.wakeups.inbox.fire,
        handoff=rt.wakeups.inbox_rows,
    )
    writer.start()

    async def close() -> None:
        # After the HTTP server stopped: what is queued is committed, then the adapters close.
        await writer.close()
        for adapter in adapters.values():
            await adapter.aclose()

    providers = callback_providers(adapters)
    return RoleParts(
        routes=callback_routes(CallbackConfig(), providers, writer),
        http=True,
        on_stop=[close],
    )


async def inbox_role(rt: Runtime) -> RoleParts:
    """``aivedio run --role inbox``: one processor loop over the configured adapters."""
    adapters = build_providers(providers_config(rt.settings))
    processor = InboxProcessor(
        rt.db,
        rt.state,
        adapters,
        InboxConfig(
            lease_s=rt.settings.inbox_lease_s,
            confirm_terminals=rt.settings.inbox_confirm_terminals,
        ),
        applied=rt.wakeups.outbox,
        handoff=rt.wakeups.inbox_rows,
    )

    async def loop(stopping: asyncio.Event) -> None:
        rt.wakeups.inbox.subscribe(processor.idle.kick)
        try:
            await processor.run(stopping)
        finally:
            rt.wakeups.inbox.unsubscribe(processor.idle.kick)
            for adapter in adapters.values():
                await adapter.aclose()

    return RoleParts(loops=[RoleLoop("processor", loop)])
