"""The page recovers from a reset after retention dropped the events below its cursor."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import httpx

from tests.browser.conftest import Stack, _run_aside, aivedio
from tests.browser.test_browser import FAST, READY_WITHIN_MS, generate, open_page, wait_ready
from tests.waiting import eventually_sync

if TYPE_CHECKING:
    from playwright.sync_api import Page

# Every event so far into a day 10 days ago (the partition that day's maintenance made then).
AGE_EVERY_EVENT = """
DO $$
DECLARE
    low timestamptz := date_trunc('day', now() AT TIME ZONE 'UTC' - interval '10 days')
                       AT TIME ZONE 'UTC';
    part text := 'task_events_p' || to_char(low AT TIME ZONE 'UTC', 'YYYYMMDD');
BEGIN
    EXECUTE format('CREATE TABLE %I (LIKE task_events INCLUDING DEFAULTS)', part);
    EXECUTE format('ALTER TABLE task_events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                   part, low, low + interval '1 day');
    UPDATE task_events SET created_at = low + interval '1 hour';
END
$$;
"""


def test_a_cursor_below_the_floor_resets_and_the_page_goes_on(
    page: Page, demo: Stack, env: dict[str, str]
) -> None:
    """A task reaches ready; its events age past the retention and a maintenance round drops
    them (the floor rises to the head). The page opens with a cursor below the floor (rewritten
    on its way out): the server answers ``event: reset`` (below_floor), the page re-reads the
    snapshot and goes on: the old task shows ready, a new one reaches ready on the same
    stream."""
    from playwright.sync_api import Route, expect

    headers = {"Authorization": f"Bearer {demo.api_key}", "Idempotency-Key": "before-the-drop"}
    body = {"provider": "sandbox", "model": "m", "prompt": "p", "params": {}}
    url = f"{demo.base}/v1/projects/{demo.project_id}/tasks"
    created = httpx.post(url, headers=headers, json=body)
    assert created.status_code == 202
    earlier = str(created.json()["task"]["id"])
    task_url = f"{url}/{earlier}"
    auth = {"Authorization": f"Bearer {demo.api_key}"}
    eventually_sync(
        lambda: httpx.get(task_url, headers=auth).json()["task"]["status"] == "ready",
        "the task to reach ready",
        90,
        interval=0.1,
    )
    cursor = str(httpx.get(task_url, headers=auth).json()["task"]["cursor"])
    epoch, head = cursor.split("-")

    _run_aside(AGE_EVERY_EVENT, env["AIVEDIO_DATABASE_URL"])
    result = aivedio(env, "admin", "maintenance")
    assert len(result["partitions_dropped"]) == 1, result

    rewritten: list[str] = []

    def below_floor(route: Route) -> None:
        if rewritten:
            route.continue_()
            return
        rewritten.append(route.request.url)
        route.continue_(
            url=re.sub(r"after=[^&]+", f"after={epoch}-{int(head) - 1}", route.request.url)
        )

    page.route(re.compile(r".*/events\?.*"), below_floor)
    console = open_page(page, demo)
    expect(page.locator(f'#tasks li[data-task-id="{earlier}"]')).to_have_attribute(
        "data-status", "ready", timeout=READY_WITHIN_MS
    )
    later = wait_ready(generate(page, "after the drop", FAST))
    assert console.statuses(later)[-1] == "ready"
    assert any(line.startswith("aivedio reset below_floor") for line in console.lines)
    assert console.states() == ["connecting", "live"]  # the reset did not drop the stream
    assert len(rewritten) == 1
