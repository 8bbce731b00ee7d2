"""The demo page and ``aivedio-client.js`` in real Chromium against real aivedio processes.

Seed 004 in a browser: the page opens its stream before it creates a task and keeps it open, so a
task that finishes in under a second is seen, a completed task does not end the stream, and a
gateway killed mid-task is survived by resuming from the cursor.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.browser.conftest import Stack, start_core

if TYPE_CHECKING:
    from playwright.sync_api import ConsoleMessage, Locator, Page

pytestmark = pytest.mark.browser

READY_WITHIN_MS = 90_000  # a bound, not a timing assertion
FAST = '{"sandbox": {"queue_s": 0.1, "duration_s": 0.2, "steps": 1}}'
# What Chromium itself logs, as errors, for the streams and polls of a killed server
REFUSED_STREAMS = re.compile(
    r"(Failed to load resource|net::ERR_|EventSource's response has a MIME type"
    r"|WebSocket connection to '.*' failed)"
)


@dataclass
class Console:
    """What the page logged: its states and every task view it rendered."""

    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __call__(self, message: ConsoleMessage) -> None:
        self.lines.append(message.text)
        if message.type == "error":
            self.errors.append(message.text)

    def assert_no_errors(self, allowed: re.Pattern[str] | None = None) -> None:
        """No console error and no uncaught exception, but what Chromium itself logs for what
        the test broke on purpose (``allowed``)."""
        errors = [e for e in self.errors if allowed is None or not allowed.search(e)]
        assert errors == [], errors

    def states(self) -> list[str]:
        return [line.split()[2] for line in self.lines if line.startswith("aivedio state ")]

    def websockets(self) -> list[str]:
        return [line.split()[1] for line in self.lines if line.startswith("websocket ")]

    def event_streams(self) -> list[str]:
        return [
            line.split()[1]
            for line in self.lines
            if line.startswith("request ") and "/events" in line
        ]

    def statuses(self, task_id: str) -> list[str]:
        prefix = f"aivedio task {task_id} "
        return [line.split()[-1] for line in self.lines if line.startswith(prefix)]


def open_page(page: Page, stack: Stack, transport: str | None = None) -> Console:
    console = Console()
    page.on("console", console)
    page.on("pageerror", lambda error: console.errors.append(f"pageerror {error}"))
    page.on("websocket", lambda ws: console.lines.append(f"websocket {ws.url}"))
    page.on("request", lambda request: console.lines.append(f"request {request.url}"))
    page.goto(stack.url(transport))
    indicator = page.locator("#live")
    try:
        indicator_state(indicator, "live")
    except AssertionError as exc:
        raise AssertionError(f"the page never went live: {console.lines}") from exc
    return console


def indicator_state(indicator: Locator, state: str, timeout_ms: float = 30_000) -> None:
    from playwright.sync_api import expect

    expect(indicator).to_have_attribute("data-state", state, timeout=timeout_ms)


def generate(page: Page, prompt: str, params: str | None = None) -> Locator:
    """Type a prompt, click Generate; the task's row once the page knows its id."""
    from playwright.sync_api import expect

    if params is not None:
        page.locator("details").evaluate("details => { details.open = true; }")
        page.locator("#params").fill(params)
    page.locator("#prompt").fill(prompt)
    page.locator("#generate").click()
    row = page.locator("#tasks li").filter(has=page.locator(".prompt", has_text=prompt))
    expect(row).to_have_count(1)
    return row


def wait_ready(row: Locator) -> str:
    from playwright.sync_api import expect

    expect(row).to_have_attribute("data-status", "ready", timeout=READY_WITHIN_MS)
    task_id = row.get_attribute("data-task-id")
    assert task_id is not None
    return task_id


def snapshot_status(stack: Stack, task_id: str) -> str:
    r = httpx.get(
        f"{stack.base}/v1/projects/{stack.project_id}/tasks/{task_id}",
        headers={"Authorization": f"Bearer {stack.api_key}"},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["task"]["status"])


def test_the_page_is_served_with_its_client(demo: Stack) -> None:
    page = httpx.get(f"{demo.base}/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache"
    client = httpx.get(f"{demo.base}/static/aivedio-client.js")
    assert client.status_code == 200
    assert client.headers["content-type"].startswith("text/javascript")
    assert client.headers["cache-control"] == "no-cache"
    assert "export function createClient" in client.text
    assert httpx.get(f"{demo.base}/static/../index.html").status_code == 404


@pytest.mark.parametrize("transport", ["sse", "websocket"])
def test_a_task_reaches_ready_in_the_page(page: Page, demo: Stack, transport: str) -> None:
    console = open_page(page, demo, transport)
    row = generate(page, "a cat on a skateboard", '{"sandbox": {"duration_s": 1.5, "steps": 3}}')
    task_id = wait_ready(row)
    statuses = console.statuses(task_id)
    assert statuses[-1] == "ready"
    assert "running" in statuses  # it was followed live, not only read back at the end
    link = row.locator("a.asset")
    from playwright.sync_api import expect

    expect(link).to_be_visible()
    expect(link).to_have_attribute("href", re.compile(r"/v1/media/"))
    assert snapshot_status(demo, task_id) == "ready"
    assert console.states() == ["connecting", "live"]
    assert_transport(console, transport)
    shot = os.environ.get("AIVEDIO_SCREENSHOT")
    if shot:
        page.screenshot(path=shot, full_page=True)
    console.assert_no_errors()


def test_a_task_that_finishes_in_under_a_second_is_seen(page: Page, demo: Stack) -> None:
    console = open_page(page, demo)
    task_id = wait_ready(generate(page, "one quick frame", FAST))
    assert console.statuses(task_id)[-1] == "ready"
    assert console.states() == ["connecting", "live"]  # seen on the stream, never by polling
    console.assert_no_errors()


def test_the_stream_stays_open_after_a_task_completes(page: Page, demo: Stack) -> None:
    console = open_page(page, demo)
    first = wait_ready(generate(page, "the first", FAST))
    second = wait_ready(generate(page, "the second", FAST))
    assert first != second
    assert console.statuses(second)[-1] == "ready"
    # one stream for both: it never closed, so the page never (re)connected again
    assert console.states() == ["connecting", "live"]
    console.assert_no_errors()


@pytest.mark.parametrize("transport", ["sse", "websocket"])
def test_the_page_survives_a_gateway_killed_mid_task(
    page: Page, split: Stack, transport: str
) -> None:
    """SIGKILL the process that serves the API and the stream while the task runs at the
    provider; start it again on the same port. The page resumes from its cursor (the session
    cookie lives in PostgreSQL, so the restarted process accepts it)."""
    from playwright.sync_api import expect

    console = open_page(page, split, transport)
    row = generate(page, "through a crash", '{"sandbox": {"duration_s": 6, "steps": 3}}')
    expect(row).to_have_attribute("data-status", "running", timeout=30_000)
    core = split.procs[-1]
    core.kill()
    indicator = page.locator("#live")
    # three failed reconnects in a row: the page polls the snapshot and says so
    indicator_state(indicator, "paused")
    expect(indicator).to_have_text("live updates paused")
    start_core(split)  # the same port; the client keeps reconnecting in the background
    task_id = wait_ready(row)
    indicator_state(indicator, "live", READY_WITHIN_MS)
    assert snapshot_status(split, task_id) == "ready"
    assert console.statuses(task_id)[-1] == "ready"
    states = console.states()
    assert states[:2] == ["connecting", "live"]
    assert states[-1] == "live"
    assert "paused" in states  # it did lose the stream, and came back
    assert_transport(console, transport)
    console.assert_no_errors(allowed=REFUSED_STREAMS)


def test_a_reset_rereads_the_snapshot_and_the_stream_goes_on(page: Page, demo: Stack) -> None:
    """The first stream request carries a cursor of another epoch (rewritten on its way out):
    the server answers ``event: reset``; the page re-reads the snapshot and goes on from the
    reset's cursor on the same stream: a task created before the page opened and one created
    after both reach ready in the page."""
    from playwright.sync_api import Route

    headers = {"Authorization": f"Bearer {demo.api_key}", "Idempotency-Key": "before-the-page"}
    body = {"provider": "sandbox", "model": "m", "prompt": "p", "params": {}}
    r = httpx.post(f"{demo.base}/v1/projects/{demo.project_id}/tasks", headers=headers, json=body)
    assert r.status_code == 202
    earlier = str(r.json()["task"]["id"])
    rewritten: list[str] = []

    def stale_cursor(route: Route) -> None:
        url = route.request.url
        if rewritten:
            route.continue_()
            return
        rewritten.append(url)
        route.continue_(url=re.sub(r"after=[^&]+", "after=1-1", url))

    page.route(re.compile(r".*/events\?.*"), stale_cursor)
    console = open_page(page, demo)
    from playwright.sync_api import expect

    expect(page.locator(f'#tasks li[data-task-id="{earlier}"]')).to_have_attribute(
        "data-status", "ready", timeout=READY_WITHIN_MS
    )
    assert any(line.startswith("aivedio reset other_epoch") for line in console.lines)
    later = wait_ready(generate(page, "after the reset", FAST))
    assert console.statuses(later)[-1] == "ready"
    assert console.states() == ["connecting", "live"]  # the reset did not drop the stream
    assert len(rewritten) == 1
    console.assert_no_errors()


def assert_transport(console: Console, transport: str) -> None:
    """Every stream the page opened used ``transport``, with no credential in its URL."""
    opened = console.websockets() if transport == "websocket" else console.event_streams()
    other = console.event_streams() if transport == "websocket" else console.websockets()
    assert opened, console.lines
    assert not other, other
    assert all("token=" not in url and "key=" not in url for url in opened), opened
    assert all(re.search(r"/v1/projects/[^/]+/(events|ws)", url) for url in opened), opened


def test_the_page_trades_the_key_for_an_httponly_cookie(page: Page, demo: Stack) -> None:
    """The key in the printed link is exchanged once for the session cookie: afterwards the
    address bar, the history and every request URL are free of it, no script can read the
    cookie, and a reload still works on the cookie alone."""
    console = open_page(page, demo)
    assert demo.api_key not in page.url and "key=" not in page.url
    assert page.url == f"{demo.base}/"
    assert "aivedio_session" not in page.evaluate("document.cookie")
    cookies = {c["name"]: c for c in page.context.cookies()}
    session = cookies["aivedio_session"]
    assert session["httpOnly"] is True
    assert session["sameSite"] == "Strict"
    assert session["path"] == "/"
    assert session["secure"] is False  # the demo's public URL is http
    assert demo.api_key not in session["value"]
    # about:blank, then the page: its entry was replaced, not pushed, so Back never shows the key
    assert page.evaluate("history.length") == 2
    assert not any(demo.api_key in line for line in console.lines if line.startswith("request "))
    wait_ready(generate(page, "on the cookie", FAST))
    # a reload: no fragment any more, the cookie alone finds the project and opens the stream
    reloaded = Console()
    page.on("console", reloaded)
    page.reload()
    indicator_state(page.locator("#live"), "live")
    assert page.url == f"{demo.base}/"
    assert page.locator("#tasks li").count() >= 1
    # ending the session revokes it: the page says so, and the cookie opens nothing any more
    page.locator("#signout").click()
    from playwright.sync_api import expect

    expect(page.locator("#setup")).to_be_visible()
    status = page.evaluate(
        """async (p) => (await fetch(`/v1/projects/${p}/tasks`)).status""", demo.project_id
    )
    assert status == 401
    console.assert_no_errors(allowed=re.compile(r"status of 401"))  # the fetch just above


def test_the_transport_select_switches_to_the_websocket(page: Page, demo: Stack) -> None:
    console = open_page(page, demo)
    assert console.websockets() == []
    page.locator("#transport").select_option("websocket")
    page.wait_for_url(re.compile(r"\?transport=websocket$"))
    indicator_state(page.locator("#live"), "live")
    assert "key=" not in page.url
    assert console.websockets(), console.lines
    task_id = wait_ready(generate(page, "over the websocket", FAST))
    assert console.statuses(task_id)[-1] == "ready"
    console.assert_no_errors()
