"""The loops of the ``submitter`` and ``reconciler`` roles (``aivedio run --role ...``); the role
factories in ``aivedio.roles`` wrap these lists in ``RoleParts(loops=...)``."""

from __future__ import annotations

from collections.abc import Mapping

from aivedio.db.pool import Database
from aivedio.process.parts import RoleLoop
from aivedio.providers.base import ProviderAdapter
from aivedio.reconcile.config import ReconcilerConfig
from aivedio.reconcile.reconciler import Reconciler
from aivedio.state.service import StateService
from aivedio.submission.cancel import CancelWorker
from aivedio.submission.config import CancelConfig, SubmitterConfig
from aivedio.submission.submitter import Submitter


def submitter_loops(
    db: Database,
    state: StateService,
    adapters: Mapping[str, ProviderAdapter],
    submit: SubmitterConfig | None = None,
    cancel: CancelConfig | None = None,
) -> list[RoleLoop]:
    """The submitter and the cancel worker: both send commands to providers."""
    return [
        RoleLoop("submitter", Submitter(db, state, adapters, submit).run),
        RoleLoop("cancel", CancelWorker(db, state, adapters, cancel).run),
    ]


def reconciler_loops(
    db: Database,
    state: StateService,
    adapters: Mapping[str, ProviderAdapter],
    config: ReconcilerConfig | None = None,
) -> list[RoleLoop]:
    return [RoleLoop("reconciler", Reconciler(db, state, adapters, config).run)]
