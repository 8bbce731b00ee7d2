"""Real Chromium (the Debian package, driven by Playwright) against real ``aivedio`` processes.

The tests skip only where Chromium or Playwright is missing AND ``CI`` is not set; on CI they
must run, so a missing browser fails them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
import httpx
import pytest

from tests.conftest import with_database
from tests.waiting import eventually_sync

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = os.environ.get("AIVEDIO_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _missing() -> str | None:
    if shutil.which(CHROMIUM) is None:
        return f"Chromium not found at {CHROMIUM} (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright)"
    return None


@pytest.fixture(scope="module")
def browser(template_database: str) -> Iterator[Browser]:
    # Playwright's sync API runs an event loop in this thread while it is open: the template
    # database (asyncio.run) is made before it starts, and the module scope stops it before the
    # next module's tests (which run event loops of their own).
    missing = _missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"browser tests must run on CI: {missing}")
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


def _run_aside(sql: str, admin_url: str) -> None:
    """Run one statement from a thread of its own: Playwright's sync API keeps an event loop
    running in the test's thread, where ``asyncio.run`` refuses to start."""
    failure: list[BaseException] = []

    async def run() -> None:
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    def target() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # re-raised in the test's thread
            failure.append(exc)

    worker = threading.Thread(target=target)
    worker.start()
    worker.join()
    if failure:
        raise failure[0]


@pytest.fixture
def database_url(admin_database_url: str, template_database: str) -> Iterator[str]:
    """As the shared fixture (a fresh database cloned from the template), safe beside Playwright."""
    name = f"aivedio_t_{uuid.uuid4().hex[:12]}"
    _run_aside(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"', admin_database_url)
    yield with_database(admin_database_url, name)
    _run_aside(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', admin_database_url)


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context()
    opened = context.new_page()
    opened.set_default_timeout(10_000)
    try:
        yield opened
    finally:
        context.close()


@dataclass
class Proc:
    """A process with its output in files (a pipe nobody reads would block it)."""

    args: list[str]
    env: dict[str, str]
    out: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with self.out.open("ab") as sink:
            self.popen = subprocess.Popen(
                self.args, env=self.env, stdout=sink, stderr=subprocess.STDOUT, cwd=self.out.parent
            )
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye frame; the browser sees the stream break."""
        assert self.popen is not None
        self.popen.kill()
        self.popen.wait(timeout=15)

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def tail(self) -> str:
        return self.out.read_text(errors="replace")[-4000:] if self.out.exists() else ""


def wait_ok(url: str, proc: Proc, timeout_s: float = 60) -> None:
    def ok() -> bool:
        assert proc.alive(), "the process exited"
        return httpx.get(url, timeout=1).status_code == 200

    try:
        eventually_sync(ok, f"200 from {url}", timeout_s, interval=0.2, ignoring=(httpx.HTTPError,))
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{proc.tail()}") from None


@dataclass
class Stack:
    """What a test drives: the API base URL, the project, its key and the processes."""

    base: str
    project_id: str
    api_key: str
    procs: list[Proc] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None

    @property
    def page_url(self) -> str:
        """The link ``aivedio demo`` prints (the key in the fragment, exchanged for a cookie)."""
        return self.url()

    def url(self, transport: str | None = None) -> str:
        query = f"?transport={transport}" if transport else ""
        return f"{self.base}/{query}#project={self.project_id}&key={self.api_key}"


@pytest.fixture
def env(database_url: str, redis_url: str, nats_url: str, tmp_path: Path) -> dict[str, str]:
    return os.environ | {
        "AIVEDIO_DATABASE_URL": database_url,
        "AIVEDIO_REDIS_URL": redis_url,
        "AIVEDIO_NATS_URL": nats_url,
        "AIVEDIO_DATA_DIR": str(tmp_path / "data"),
        "AIVEDIO_LOG_LEVEL": "WARNING",
    }


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    made: list[Stack] = []
    yield made
    for stack in made:
        for proc in reversed(stack.procs):
            proc.stop()


def first_json_line(proc: Proc, timeout_s: float = 60) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        assert proc.alive(), "the process exited"
        for line in proc.out.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with_keys: dict[str, Any] = json.loads(line)
                if "project_id" in with_keys:
                    return with_keys
        return None

    try:
        line: dict[str, Any] = eventually_sync(found, "a JSON line", timeout_s, interval=0.1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{proc.tail()}") from None
    return line


@pytest.fixture
def demo(env: dict[str, str], tmp_path: Path, stacks: list[Stack]) -> Stack:
    """``aivedio demo`` as a subprocess, on free ports."""
    port, sandbox_port = free_port(), free_port()
    proc = Proc(
        [sys.executable, "-m", "aivedio", "demo"],
        env
        | {
            "AIVEDIO_PORT": str(port),
            "AIVEDIO_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
        },
        tmp_path / "demo.log",
    ).start()
    stack = Stack(f"http://127.0.0.1:{port}", "", "", [proc])
    stacks.append(stack)
    first = first_json_line(proc)
    stack.project_id, stack.api_key = str(first["project_id"]), str(first["api_key"])
    wait_ok(f"{stack.base}/readyz", proc)
    wait_ok(f"http://127.0.0.1:{sandbox_port}/healthz", proc)
    return stack


def aivedio(env: dict[str, str], *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "aivedio", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def split(env: dict[str, str], tmp_path: Path, stacks: list[Stack]) -> Stack:
    """The sandbox provider in a process of its own, every aivedio role in another (which the
    test may kill and start again on the same port): the provider keeps its generations."""
    port, sandbox_port = free_port(), free_port()
    env = env | {
        "AIVEDIO_PORT": str(port),
        "AIVEDIO_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
    }
    made = aivedio(env, "admin", "create-project", "--tenant", "web", "--project", "web")
    provider = Proc(
        [sys.executable, "-m", "aivedio", "sandbox-provider", "--port", str(sandbox_port)],
        env,
        tmp_path / "sandbox.log",
    ).start()
    stack = Stack(
        f"http://127.0.0.1:{port}",
        str(made["project_id"]),
        str(made["api_key"]),
        [provider],
        env,
        tmp_path,
    )
    stacks.append(stack)
    wait_ok(f"http://127.0.0.1:{sandbox_port}/healthz", provider)
    start_core(stack)
    return stack


def start_core(stack: Stack) -> Proc:
    """Every aivedio role in one process, on the stack's port (again, after a kill)."""
    assert stack.workdir is not None
    port = stack.base.rsplit(":", 1)[1]
    core = Proc(
        [sys.executable, "-m", "aivedio", "run", "--role", "all", "--port", port],
        stack.env,
        stack.workdir / "core.log",
    ).start()
    stack.procs.append(core)
    wait_ok(f"{stack.base}/readyz", core)
    return core


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: real Chromium against real aivedio processes")
