"""The loops of the ``submitter`` role (``aivedio run --role submitter``); the role factory in
``aivedio.roles`` wraps this list in ``RoleParts(loops=...)``."""

from __future__ import annotations

from collections.abc import Mapping

from aivedio.db.pool import Database
from aivedio.process.parts import RoleLoop
from aivedio.providers.port import ProviderAdapter
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
