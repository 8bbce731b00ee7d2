"""The task operations."""

from __future__ import annotations

from aivedio.api import models as m
from aivedio.api.contract.base import (
    CSRF,
    MEDIA_TYPE,
    NOT_FOUND,
    PROJECT,
    READ,
    TASK,
    TOO_LARGE,
    UNAUTHORIZED,
    UNAVAILABLE,
    WRITE,
    Body,
    Operation,
    Param,
    Reply,
    error,
    task_links,
    task_reply,
)
from aivedio.config import ApiConfig

_PAGE_MAX = ApiConfig().page_size_max

# -- tasks ---------------------------------------------------------------------------------------

TASKS = "/v1/projects/{project_id}/tasks"
TASK_PATH = TASKS + "/{task_id}"

TASK_OPERATIONS = [
    Operation(
        "post",
        TASKS,
        "CreateTask",
        "tasks",
        "Create a task",
        description="The same `Idempotency-Key` with the same body (compared as canonical JSON) "
        "answers the same task with `Idempotent-Replayed: true`; with another body, 422 "
        "`idempotency_key_reused`. Keys are scoped to the project and kept for 24 h.",
        security=WRITE,
        params=(
            PROJECT,
            Param(
                "Idempotency-Key",
                "header",
                {"type": "string", "minLength": 1, "maxLength": 255, "pattern": r"^[!-~]+$"},
                "1-255 printable characters",
                required=True,
            ),
        ),
        body=Body(m.CreateTaskBody),
        replies={
            202: Reply(
                "the task (new, or the one this key created)",
                m.TaskResponse,
                headers=(("Idempotent-Replayed", "`true` when the key named an earlier task"),),
                links=task_links(),
            ),
            401: UNAUTHORIZED,
            403: CSRF,
            404: NOT_FOUND,
            413: TOO_LARGE,
            415: MEDIA_TYPE,
            422: error(
                "`invalid_json`, `validation_failed` (also a missing or malformed "
                "`Idempotency-Key`, an unknown provider), `idempotency_key_reused`"
            ),
            503: UNAVAILABLE,
        },
    ),
    Operation(
        "get",
        TASKS,
        "ListTasks",
        "tasks",
        "List tasks, newest first",
        description="All snapshots and the cursor are read at one stream position.",
        security=READ,
        params=(
            PROJECT,
            Param(
                "limit",
                "query",
                {"type": "integer", "minimum": 1, "maximum": _PAGE_MAX, "default": 50},
                f"1..{_PAGE_MAX} (the API's `page_size_max`)",
            ),
            Param("page", "query", {"type": "string"}, "`next_page` of the previous answer"),
        ),
        replies={
            200: Reply("a page of tasks", m.TaskList),
            401: UNAUTHORIZED,
            404: NOT_FOUND,
            422: error("`validation_failed`: `limit` out of range, or a `page` not from this API"),
            503: UNAVAILABLE,
        },
    ),
    Operation(
        "get",
        TASK_PATH,
        "GetTask",
        "tasks",
        "Read a task's snapshot",
        description="Task and stream head are read in one transaction: replaying the stream "
        "from `cursor` is exact.",
        security=READ,
        params=(PROJECT, TASK),
        replies={
            200: Reply("the snapshot", m.TaskResponse, links=task_links(include_get=False)),
            401: UNAUTHORIZED,
            404: NOT_FOUND,
            503: UNAVAILABLE,
        },
    ),
    Operation(
        "post",
        TASK_PATH + "/cancel",
        "CancelTask",
        "tasks",
        "Ask to cancel a task",
        description="Moves the task to `cancel_requested` until the provider confirms; asking "
        "again answers the same snapshot.",
        security=WRITE,
        params=(PROJECT, TASK),
        replies={
            202: task_reply("the task, `cancel_requested`"),
            401: UNAUTHORIZED,
            403: CSRF,
            404: NOT_FOUND,
            409: error("`not_cancelable`: past the provider's work, or finished"),
            503: UNAVAILABLE,
        },
    ),
    Operation(
        "post",
        TASK_PATH + "/retry",
        "RetryTask",
        "tasks",
        "Retry a failed or canceled task",
        description="A new attempt; the task starts over as `queued`.",
        security=WRITE,
        params=(PROJECT, TASK),
        replies={
            202: task_reply("the task, `queued` again"),
            401: UNAUTHORIZED,
            403: CSRF,
            404: NOT_FOUND,
            409: error("`not_retryable`: the task is not `failed` or `canceled`"),
            503: UNAVAILABLE,
        },
    ),
    Operation(
        "get",
        TASK_PATH + "/audit",
        "GetTaskAudit",
        "tasks",
        "Read a task's audit trail",
        description="Its events, the observations that changed nothing, and the versions that "
        "changed no public field.",
        security=READ,
        params=(PROJECT, TASK),
        replies={
            200: Reply("the audit trail", m.AuditResponse),
            401: UNAUTHORIZED,
            404: NOT_FOUND,
            503: UNAVAILABLE,
        },
    ),
    Operation(
        "get",
        TASK_PATH + "/events",
        "GetTaskEvents",
        "tasks",
        "Read a task's public event timeline",
        description="Every public event of the task in seq order, as the stream delivered it "
        "(the same payload as a `task.status` frame), with the public fields each one changed.",
        security=READ,
        params=(PROJECT, TASK),
        replies={
            200: Reply("the timeline", m.TaskEvents),
            401: UNAUTHORIZED,
            404: NOT_FOUND,
            503: UNAVAILABLE,
        },
    ),
]
