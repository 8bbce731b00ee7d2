"""``process/uvicorn_internals.py``: the probe passes on the installed uvicorn and names, with the
uvicorn version, any internal that is missing; ``serve_http`` refuses to start without them."""

from __future__ import annotations

import ast
import asyncio
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aivedio.process import uvicorn_internals
from aivedio.process.http_server import serve_http
from aivedio.process.uvicorn_internals import UvicornInternalsError

ROOT = Path(__file__).resolve().parents[2]


def refusal() -> str:
    with pytest.raises(UvicornInternalsError) as caught:
        uvicorn_internals.probe()
    message = str(caught.value)
    assert f"uvicorn {uvicorn.__version__} " in message
    assert "pyproject.toml pins (uvicorn>=" in message
    return message


def test_the_installed_uvicorn_has_every_internal() -> None:
    uvicorn_internals.probe()
    for protocol in (uvicorn_internals.AutoHTTPProtocol, H11Protocol, HttpToolsProtocol):
        assert uvicorn_internals.missing_internals(protocol) == []


def test_the_pin_the_error_names_is_pyprojects_and_holds_the_installed_uvicorn() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"uvicorn{uvicorn_internals.PINNED}" in project["dependencies"]
    low, high = (v.strip("<>=") for v in uvicorn_internals.PINNED.split(","))
    installed = tuple(int(p) for p in uvicorn.__version__.split(".")[:2])
    assert (
        tuple(int(p) for p in low.split(".")) <= installed < tuple(int(p) for p in high.split("."))
    )


def test_a_missing_signal_hook_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(uvicorn.Server, "capture_signals")
    assert "Server.capture_signals" in refusal()


def test_a_protocol_without_the_expected_constructor_and_fields_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Protocol(asyncio.Protocol):
        def __init__(self, config: Any, server_state: Any, app_state: Any) -> None:
            self.cycle = None  # no timeout_keep_alive_task, no _loop keyword

    monkeypatch.setattr(uvicorn_internals, "AutoHTTPProtocol", Protocol)
    message = refusal()
    assert "Protocol.__init__(_loop=)" in message
    assert "Protocol().timeout_keep_alive_task" in message
    assert "RequestResponseCycle" in message  # this test module defines none


def test_a_cycle_without_response_complete_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    module = sys.modules[uvicorn_internals.AutoHTTPProtocol.__module__]

    class RequestResponseCycle:
        def __init__(self) -> None:
            self.more_body = True

    monkeypatch.setattr(module, "RequestResponseCycle", RequestResponseCycle)
    assert "RequestResponseCycle().response_complete" in refusal()


def test_server_state_without_connections_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    class ServerState:
        pass

    monkeypatch.setattr(uvicorn_internals, "ServerState", ServerState)
    assert "ServerState().connections" in refusal()


async def test_serve_http_refuses_to_start_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(uvicorn.Server, "capture_signals")
    with pytest.raises(UvicornInternalsError):
        await serve_http(object(), "127.0.0.1", 1, None, asyncio.Event(), callbacks=None)


async def test_detach_cancels_the_keep_alive_timer_and_forgets_the_connection() -> None:
    class Inner:
        timeout_keep_alive_task: asyncio.TimerHandle | None

    inner = Inner()
    timer = asyncio.get_running_loop().call_later(60, lambda: None)
    inner.timeout_keep_alive_task = timer
    state = uvicorn_internals.ServerState()
    uvicorn_internals.connections(state).add(inner)
    uvicorn_internals.detach(inner, state)
    assert timer.cancelled() and inner.timeout_keep_alive_task is None
    assert inner not in state.connections


def test_no_other_module_imports_uvicorn_internals() -> None:
    """Only the top-level ``uvicorn`` package (Config, Server) is public; anything below it is
    reached through ``process/uvicorn_internals.py``."""
    offenders = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        if path.name == "uvicorn_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {n}"
                for n in names
                if n.startswith("uvicorn.") or n == "h11"
            ]
    assert offenders == []
