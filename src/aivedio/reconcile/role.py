"""The loops of the ``reconciler`` role (``aivedio run --role reconciler``); the role factory in
``aivedio.roles`` wraps this list in ``RoleParts(loops=...)``."""

from __future__ import annotations

from collections.abc import Mapping

from aivedio.db.pool import Database
from aivedio.process.parts import RoleLoop
from aivedio.providers.port import ProviderAdapter
from aivedio.reconcile.config import ReconcilerConfig
from aivedio.reconcile.reconciler import Reconciler
from aivedio.state.service import StateService


def reconciler_loops(
    db: Database,
    state: StateService,
    adapters: Mapping[str, ProviderAdapter],
    config: ReconcilerConfig | None = None,
) -> list[RoleLoop]:
    return [RoleLoop("reconciler", Reconciler(db, state, adapters, config).run)]
