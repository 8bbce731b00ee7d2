"""The ``maintenance`` role (registered in ``roles.AVAILABLE``)."""

from __future__ import annotations

from aivedio.process.parts import RoleLoop, RoleParts
from aivedio.retention.config import RetentionConfig
from aivedio.retention.maintenance import Maintenance
from aivedio.runtime import Runtime


async def maintenance_role(rt: Runtime) -> RoleParts:
    return RoleParts(
        loops=[
            RoleLoop(
                "maintenance", Maintenance(rt.db, RetentionConfig.from_settings(rt.settings)).run
            )
        ]
    )
