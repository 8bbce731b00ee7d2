"""The web console in real Chromium against ``aivedio demo`` (real processes, the sandbox provider
beside them): create, watch to ready, inline playback, cancel, retry, the timeline and the audit
trail, a killed realtime connection ("paused" then "resumed", no event missing), the transport
switch, the chaos panel, keyboard use and a phone-width window. No console errors in any test.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.browser.conftest import Stack, aivedio, free_port, start_core

if TYPE_CHECKING:
    from playwright.sync_api import ConsoleMessage, Locator, Page

pytestmark = pytest.mark.browser

READY_WITHIN_MS = 90_000  # a bound, not a timing assertion
STEPS = '{"sandbox": {"queue_s": 0.3, "duration_s": 2, "steps": 4}}'
LONG = '{"sandbox": {"queue_s": 0.2, "duration_s": 60, "steps": 4}}'
FAILS = '{"sandbox": {"queue_s": 0.2, "duration_s": 0.5, "steps": 1, "outcome": "failed"}}'
# What Chromium itself logs, as errors, for a stream the test cut on purpose (a refused
# EventSource or WebSocket handshake); nothing else may be an error.
NETWORK_NOISE = re.compile(
    r"(Failed to load resource: the server responded with a status of 503"
    r"|EventSource's response has a MIME type"
    r"|WebSocket connection to '.*' failed)"
)


@dataclass
class Watch:
    """The page's console: every error, and the errors the test allowed (a deliberate outage)."""

    errors: list[str] = field(default_factory=list)
    allow_network_noise: bool = False
    allowed: re.Pattern[str] | None = None  # what else Chromium may log for what the test broke

    def __call__(self, message: ConsoleMessage) -> None:
        if message.type != "error":
            return
        if self.allow_network_noise and NETWORK_NOISE.search(message.text):
            return
        if self.allowed is not None and self.allowed.search(message.text):
            return
        self.errors.append(message.text)

    def assert_clean(self) -> None:
        assert self.errors == [], self.errors


def open_console(page: Page, stack: Stack, transport: str | None = None) -> Watch:
    from playwright.sync_api import expect

    watch = Watch()
    page.on("console", watch)
    page.on("pageerror", lambda error: watch.errors.append(f"pageerror {error}"))
    page.goto(stack.url(transport))
    try:
        expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=30_000)
    except AssertionError as exc:
        raise AssertionError(f"the console never went live: {watch.errors}") from exc
    return watch


def generate(page: Page, prompt: str, params: str) -> Locator:
    from playwright.sync_api import expect

    page.locator("details").evaluate("details => { details.open = true; }")
    page.locator("#params").fill(params)
    page.locator("#prompt").fill(prompt)
    page.locator("#generate").click()
    row = page.locator("#tasks li").filter(has=page.locator(".prompt", has_text=prompt))
    expect(row).to_have_count(1)
    return row


def task_id_of(row: Locator) -> str:
    task_id = row.get_attribute("data-task-id")
    assert task_id is not None
    return task_id


def api(stack: Stack, method: str, path: str, body: Any = None, **headers: str) -> Any:
    r = httpx.request(
        method,
        f"{stack.base}{path}",
        headers={"Authorization": f"Bearer {stack.api_key}", **headers},
        json=body,
    )
    assert r.status_code < 300, r.text
    return r.json()


def api_events(stack: Stack, task_id: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = api(
        stack, "GET", f"/v1/projects/{stack.project_id}/tasks/{task_id}/events"
    )["events"]
    return events


def timeline(page: Page) -> list[tuple[int, str]]:
    """The detail's timeline: (seq, via) per row, in the order shown."""
    rows = page.locator("#timeline tbody tr")
    return [
        (int(str(r.get_attribute("data-seq"))), str(r.get_attribute("data-via")))
        for r in rows.all()
    ]


def wait_timeline_matches(page: Page, stack: Stack, task_id: str) -> list[dict[str, Any]]:
    """The timeline shows exactly the task's public events (the API's read), in seq order."""
    from playwright.sync_api import expect

    events = api_events(stack, task_id)
    expect(page.locator("#timeline tbody tr")).to_have_count(len(events))
    assert [seq for seq, _ in timeline(page)] == [e["event_id"] for e in events]
    return events


def test_create_watch_to_ready_play_inline_and_read_the_timeline(page: Page, demo: Stack) -> None:
    from playwright.sync_api import expect

    watch = open_console(page, demo)
    row = generate(page, "a heron at dawn", STEPS)
    task_id = task_id_of(row)
    # open the detail with the keyboard while the task runs
    row.locator(".open").focus()
    page.keyboard.press("Enter")
    detail = page.locator("#detail")
    expect(detail).to_be_visible()
    expect(page.locator("#detail-title")).to_be_focused()
    expect(row).to_have_attribute("data-status", "ready", timeout=READY_WITHIN_MS)
    # the board: version and last event id of the snapshot
    snapshot = api(demo, "GET", f"/v1/projects/{demo.project_id}/tasks/{task_id}")["task"]
    expect(row).to_have_attribute("data-version", str(snapshot["task_version"]))
    expect(row.locator(".meta")).to_contain_text(f"event #{snapshot['last_event_id']}")
    # a finished task: both commands greyed, with the reason
    expect(row.locator(".cancel")).to_be_disabled()
    expect(row.locator(".cancel")).to_have_attribute("title", "the task has finished")
    expect(row.locator(".retry")).to_be_disabled()
    expect(row.locator(".why")).to_contain_text("only a failed or canceled task can be retried")
    # the timeline: every public event, in seq order, with what changed
    events = wait_timeline_matches(page, demo, task_id)
    assert events[0]["payload"]["status"] == "queued"
    assert events[-1]["payload"]["status"] == "ready"
    assert "asset_id" in events[-1]["changed"] or any("asset_id" in e["changed"] for e in events)
    expect(page.locator("#timeline tbody tr").last).to_contain_text("status: processing_media")
    # every event after the first the detail saw came over the stream
    vias = [via for _, via in timeline(page)]
    first_streamed = vias.index("stream")
    expect(page.locator("#timeline tbody tr[data-via=read]")).to_have_count(first_streamed)
    vias = [via for _, via in timeline(page)]
    assert all(via == "stream" for via in vias[first_streamed:]), vias
    # inline playback through the signed link, which the page asked the API for
    player = page.locator("#player")
    expect(player).to_be_visible()
    expect(player).to_have_attribute("src", re.compile(r"/v1/media/[^?]+\?exp=\d+&sig="))
    expect(player).to_have_attribute("data-loaded", "1", timeout=30_000)
    assert page.evaluate("document.getElementById('player').videoWidth") > 0
    # every task version is in the timeline (a public event) or in the audit trail (a version
    # that changed no public field): the page shows the whole history
    page.wait_for_function(
        """(n) => {
            const versions = (sel) =>
                [...document.querySelectorAll(sel)].map((r) => Number(r.dataset.version));
            const shown = versions("#timeline tbody tr");
            const unpublished = versions("#audit tbody tr[data-outcome=applied]");
            const all = new Set([...shown, ...unpublished]);
            if (all.size !== shown.length + unpublished.length || all.size !== n) return false;
            return [...all].every((v) => v >= 1 && v <= n);
        }""",
        arg=snapshot["task_version"],
    )
    # the OpenAPI reference is one link away
    expect(page.locator("#api-docs")).to_have_attribute("href", "/docs")
    assert httpx.get(f"{demo.base}/docs").status_code == 200
    shot = os.environ.get("AIVEDIO_CONSOLE_SCREENSHOT")
    if shot:  # the README's picture
        page.set_viewport_size({"width": 1400, "height": 900})
        page.locator("#prompt").fill("a lighthouse in a storm")
        page.screenshot(path=shot, full_page=True)
    # Escape closes the detail and gives the focus back to the task
    page.keyboard.press("Escape")
    expect(detail).to_be_hidden()
    expect(row.locator(".open")).to_be_focused()
    watch.assert_clean()


def test_an_expired_playback_link_is_asked_for_again(page: Page, demo: Stack) -> None:
    """The first signed link is refused (as an expired one is, 403): the player asks the API for
    a fresh link, once, and plays that one."""
    from playwright.sync_api import Route, expect

    refused: list[str] = []

    def expire_first(route: Route) -> None:
        if refused:
            route.continue_()
            return
        refused.append(route.request.url)
        route.fulfill(status=403, content_type="application/json", body='{"error": {}}')

    page.route(re.compile(r".*/v1/media/.*"), expire_first)
    watch = open_console(page, demo)
    watch.allowed = re.compile(r"status of 403")  # Chromium's line about the refused link
    row = generate(page, "played twice", STEPS)
    row.locator(".open").click()
    expect(row).to_have_attribute("data-status", "ready", timeout=READY_WITHIN_MS)
    player = page.locator("#player")
    expect(player).to_have_attribute("data-link", "reauthorised", timeout=30_000)
    expect(player).to_have_attribute("data-loaded", "1", timeout=30_000)
    assert len(refused) == 1
    watch.assert_clean()


def test_cancel_a_running_task(page: Page, demo: Stack) -> None:
    from playwright.sync_api import expect

    watch = open_console(page, demo)
    row = generate(page, "a long one", LONG)
    expect(row).to_have_attribute("data-status", "running", timeout=30_000)
    expect(row.locator(".retry")).to_be_disabled()
    cancel = row.locator(".cancel")
    expect(cancel).to_be_enabled()
    cancel.click()
    expect(row).to_have_attribute("data-status", "canceled", timeout=READY_WITHIN_MS)
    task_id = task_id_of(row)
    assert api(demo, "GET", f"/v1/projects/{demo.project_id}/tasks/{task_id}")["task"][
        "status"
    ] == ("canceled")
    expect(cancel).to_be_disabled()
    expect(cancel).to_have_attribute("title", "the task is canceled")
    expect(row.locator(".retry")).to_be_enabled()
    statuses = [e["payload"]["status"] for e in api_events(demo, task_id)]
    assert "cancel_requested" in statuses
    assert statuses[-1] == "canceled"
    watch.assert_clean()


def test_retry_a_failed_task(page: Page, demo: Stack) -> None:
    from playwright.sync_api import expect

    watch = open_console(page, demo)
    row = generate(page, "bound to fail", FAILS)
    expect(row).to_have_attribute("data-status", "failed", timeout=READY_WITHIN_MS)
    failed_version = int(str(row.get_attribute("data-version")))
    expect(row.locator(".meta")).to_contain_text("could not be generated")
    row.locator(".open").click()
    task_id = task_id_of(row)
    first = wait_timeline_matches(page, demo, task_id)
    retry = row.locator(".retry")
    expect(retry).to_be_enabled()
    retry.click()
    # a new attempt: queued again with a higher version, then (same script) failed again
    expect(row).not_to_have_attribute("data-version", str(failed_version))
    expect(row).to_have_attribute("data-status", "failed", timeout=READY_WITHIN_MS)
    assert int(str(row.get_attribute("data-version"))) > failed_version
    events = wait_timeline_matches(page, demo, task_id)
    assert len(events) > len(first)
    statuses = [e["payload"]["status"] for e in events]
    assert statuses.count("failed") == 2
    assert statuses[len(first)] == "queued"
    watch.assert_clean()


@pytest.mark.parametrize("transport", ["sse", "websocket"])
def test_a_killed_connection_pauses_then_resumes_with_no_event_missing(
    page: Page, demo: Stack, transport: str
) -> None:
    """The chaos panel's kill: the gateway cuts the stream without a goodbye and refuses the
    project's streams for a while. The page retries, says "live updates paused" and polls, then
    resumes from its cursor: the events of the outage arrive over the stream (replayed), so the
    timeline has every event, each one delivered by the stream."""
    from playwright.sync_api import expect

    watch = open_console(page, demo, transport)
    watch.allow_network_noise = True  # the refused reconnects are logged by Chromium itself
    expect(page.locator("#chaos")).to_be_visible()
    row = generate(page, "through an outage", '{"sandbox": {"duration_s": 14, "steps": 7}}')
    row.locator(".open").click()
    expect(row).to_have_attribute("data-status", "running", timeout=30_000)
    expect(page.locator("#timeline tbody tr[data-via=stream]")).not_to_have_count(0)
    before = page.locator("#conn-log li").count()
    page.locator("#outage-seconds").fill("6")
    page.locator("#outage-start").click()
    indicator = page.locator("#live")
    expect(indicator).to_have_attribute("data-state", "paused", timeout=30_000)
    expect(indicator).to_have_text("live updates paused")
    expect(page.locator("#conn-log li[data-kind=paused]")).to_have_count(1)
    expect(indicator).to_have_attribute("data-state", "live", timeout=60_000)
    expect(page.locator("#conn-log li[data-kind=resumed]")).to_have_count(1)
    expect(page.locator("#conn-log li[data-kind=open]").first).to_contain_text("resuming after")
    assert page.locator("#conn-log li").count() > before
    assert int(page.locator("#conn-resumes").inner_text()) >= 1
    assert int(page.locator("#conn-failures").inner_text()) >= 3
    expect(row).to_have_attribute("data-status", "ready", timeout=READY_WITHIN_MS)
    task_id = task_id_of(row)
    wait_timeline_matches(page, demo, task_id)
    vias = [via for _, via in timeline(page)]
    first_streamed = vias.index("stream")
    # from the first event the detail saw on: the stream delivered every one, outage included
    expect(page.locator("#timeline tbody tr[data-via=read]")).to_have_count(first_streamed)
    vias = [via for _, via in timeline(page)]
    assert all(via == "stream" for via in vias[first_streamed:]), vias
    watch.assert_clean()


def test_a_reset_shows_in_the_connection_panel(page: Page, demo: Stack) -> None:
    """The first stream request carries a cursor of another epoch (rewritten on its way out):
    the server answers ``reset``; the panel counts it and logs it, and the stream goes on."""
    from playwright.sync_api import Route, expect

    rewritten: list[str] = []

    def stale_cursor(route: Route) -> None:
        if rewritten:
            route.continue_()
            return
        rewritten.append(route.request.url)
        route.continue_(url=re.sub(r"after=[^&]+", "after=1-1", route.request.url))

    page.route(re.compile(r".*/events\?.*"), stale_cursor)
    watch = open_console(page, demo)
    expect(page.locator("#conn-resets")).to_have_text("1")
    expect(page.locator("#conn-log li[data-kind=reset]")).to_contain_text("other_epoch")
    row = generate(page, "after a reset", STEPS)
    expect(row).to_have_attribute("data-status", "ready", timeout=READY_WITHIN_MS)
    expect(page.locator("#conn-reconnects")).to_have_text("0")
    assert len(rewritten) == 1
    watch.assert_clean()


def test_the_transport_switch_shows_in_the_connection_panel(page: Page, demo: Stack) -> None:
    from playwright.sync_api import expect

    watch = open_console(page, demo)
    expect(page.locator("#conn-transport")).to_have_text("SSE")
    page.locator("#transport").select_option("websocket")
    page.wait_for_url(re.compile(r"\?transport=websocket$"))
    expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=30_000)
    expect(page.locator("#conn-transport")).to_have_text("WebSocket")
    row = generate(page, "over the websocket", STEPS)
    expect(row).to_have_attribute("data-status", "ready", timeout=READY_WITHIN_MS)
    cursor = page.locator("#conn-cursor").inner_text()
    assert re.fullmatch(r"\d+-\d+", cursor), cursor
    watch.assert_clean()


def test_the_chaos_panel_and_the_true_final_state(page: Page, demo: Stack) -> None:
    """Webhooks dropped, duplicated and reordered, a 429 storm and slow queries, set from the
    panel: a task that succeeds at the provider still becomes ready, and one that fails there
    still becomes failed (polling and the state rules compensate)."""
    from playwright.sync_api import expect

    watch = open_console(page, demo)
    panel = page.locator("#chaos")
    expect(panel).to_be_visible()
    for knob, value in [
        ("drop_rate", "0.5"),
        ("duplicate_rate", "0.5"),
        ("reorder", "0.5"),
        ("query_429_rate", "0.3"),
        ("query_slow_ms", "300"),
    ]:
        page.locator(f"#chaos-{knob}").fill(value)
    page.locator("#chaos-apply").click()
    expect(page.locator("#chaos-state")).to_contain_text("drop 0.5")
    knobs = api(demo, "GET", "/v1/sandbox/chaos")
    assert knobs["drop_rate"] == 0.5
    assert knobs["duplicate_rate"] == 0.5
    assert knobs["reorder"] == 0.5
    assert knobs["query_429_rate"] == 0.3
    assert knobs["query_slow_ms"] == [150, 300]
    good = generate(page, "through the storm", STEPS)
    bad = generate(page, "failing in the storm", FAILS)
    expect(good).to_have_attribute("data-status", "ready", timeout=READY_WITHIN_MS)
    expect(bad).to_have_attribute("data-status", "failed", timeout=READY_WITHIN_MS)
    for row, final in ((good, "ready"), (bad, "failed")):
        task_id = task_id_of(row)
        snapshot = api(demo, "GET", f"/v1/projects/{demo.project_id}/tasks/{task_id}")["task"]
        assert snapshot["status"] == final
        statuses = [e["payload"]["status"] for e in api_events(demo, task_id)]
        assert statuses[-1] == final
        assert statuses.count(final) == 1  # duplicates and reordering made no second terminal
    page.locator("#chaos-reset").click()
    expect(page.locator("#chaos-state")).to_have_text("no chaos")
    assert api(demo, "GET", "/v1/sandbox/chaos")["drop_rate"] == 0
    watch.assert_clean()


def test_a_phone_width_window_and_the_keyboard(page: Page, demo: Stack) -> None:
    from playwright.sync_api import expect

    page.set_viewport_size({"width": 390, "height": 844})
    watch = open_console(page, demo)
    # create with the keyboard only: the prompt, Enter
    page.locator("#prompt").focus()
    page.keyboard.type("typed, not clicked")
    page.keyboard.press("Enter")
    row = page.locator("#tasks li").filter(has_text="typed, not clicked")
    expect(row).to_have_count(1)
    expect(row).to_have_attribute("data-status", re.compile(r"."))
    # nothing wider than the window
    width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], width
    # Tab reaches the task's detail button; Enter opens the detail
    for _ in range(40):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.classList.contains('open')"):
            break
    else:
        raise AssertionError("Tab never reached the task")
    page.keyboard.press("Enter")
    expect(page.locator("#detail")).to_be_visible()
    width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], width
    watch.assert_clean()


def test_the_console_api_answers_as_documented(demo: Stack) -> None:
    """The operations the console adds: a task's timeline, the chaos knobs (bad ones refused),
    and a stream outage for a project of the caller's only."""
    made = api(
        demo,
        "POST",
        f"/v1/projects/{demo.project_id}/tasks",
        {"provider": "sandbox", "model": "m", "prompt": "p", "params": {}},
        **{"Idempotency-Key": "console-api"},
    )
    task_id = made["task"]["id"]
    events = api_events(demo, task_id)
    assert events[0]["event_id"] >= 1
    assert events[0]["changed"][0] == "status"
    auth = {"Authorization": f"Bearer {demo.api_key}"}
    bad = httpx.put(f"{demo.base}/v1/sandbox/chaos", json={"drop_rate": 2}, headers=auth)
    assert bad.status_code == 422
    assert bad.json()["error"]["code"] == "validation_failed"
    unknown = httpx.put(f"{demo.base}/v1/sandbox/chaos", json={"nope": 1}, headers=auth)
    assert unknown.status_code == 422
    assert httpx.get(f"{demo.base}/v1/sandbox/chaos").status_code == 401
    other = "00000000-0000-4000-8000-000000000000"
    refused = httpx.post(
        f"{demo.base}/v1/projects/{other}/sandbox/stream-outage", json={"seconds": 1}, headers=auth
    )
    assert refused.status_code == 404
    none = httpx.get(
        f"{demo.base}/v1/projects/{demo.project_id}/tasks/{other}/events", headers=auth
    )
    assert none.status_code == 404


def test_without_the_sandbox_there_is_no_chaos_panel_and_no_console_error(
    page: Page, env: dict[str, str], tmp_path: Path, stacks: list[Stack]
) -> None:
    """A deployment with the sandbox provider off: the page does not even probe its knobs (a
    404 would be an error in the browser's console) and shows no chaos panel."""
    from playwright.sync_api import expect

    env = env | {"AIVEDIO_SANDBOX_ENABLED": "false", "AIVEDIO_PORT": str(free_port())}
    made = aivedio(env, "admin", "create-project", "--tenant", "plain", "--project", "plain")
    stack = Stack(
        f"http://127.0.0.1:{env['AIVEDIO_PORT']}",
        str(made["project_id"]),
        str(made["api_key"]),
        [],
        env,
        tmp_path,
    )
    stacks.append(stack)
    start_core(stack)
    probes: list[str] = []
    page.on("request", lambda r: probes.append(r.url) if "/sandbox/" in r.url else None)
    watch = open_console(page, stack)
    expect(page.locator("#chaos")).to_be_hidden()
    assert probes == []
    watch.assert_clean()
