"""The route table of the HTTP API: every operation with its parameters, body, answers and
credentials, for ``api.openapi`` to turn into the OpenAPI document.

Bodies and answers name their models in ``api.models`` (the handlers validate and serialise with
the same models). ``tests/integration/test_openapi.py`` checks that every route the processes
mount is here, and that nothing here is mounted nowhere.
"""

from __future__ import annotations

from aivedio.api.contract.access import ACCESS_OPERATIONS
from aivedio.api.contract.base import SECURITY_SCHEMES, Body, Operation, Param, Reply
from aivedio.api.contract.sandbox import SANDBOX_OPERATIONS
from aivedio.api.contract.service import OPS_OPERATIONS
from aivedio.api.contract.streams import CALLBACK_OPERATIONS, STREAM_OPERATIONS
from aivedio.api.contract.tasks import TASK_OPERATIONS

__all__ = ["OPERATIONS", "SECURITY_SCHEMES", "Body", "Operation", "Param", "Reply"]

OPERATIONS: list[Operation] = [
    *TASK_OPERATIONS,
    *ACCESS_OPERATIONS,
    *STREAM_OPERATIONS,
    *CALLBACK_OPERATIONS,
    *SANDBOX_OPERATIONS,
    *OPS_OPERATIONS,
]
