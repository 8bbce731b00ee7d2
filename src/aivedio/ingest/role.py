"""``aivedio run --role callbacks``: the callback gateway on the shared HTTP port."""

from __future__ import annotations

from aivedio.ingest.gateway import CallbackConfig, callback_routes
from aivedio.ingest.group_commit import GroupCommitConfig, InboxWriter
from aivedio.process.parts import RoleParts
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
