"""``serve_http(reuse_port=True)`` (``AIVEDIO_REUSE_PORT``, ``aivedio run --reuse-port``): several
servers share one port and the kernel spreads new connections over them; a port held by an
ordinary listener is not shared."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections import Counter
from typing import Any

import httpx
import pytest

from aivedio.process.http_server import reuse_port_socket, serve_http
from tests.waiting import eventually


def _named_app(name: str) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": name.encode()})

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_two_servers_share_one_port() -> None:
    port = _free_port()
    stopping = asyncio.Event()
    servers = [
        asyncio.create_task(
            serve_http(_named_app(name), "127.0.0.1", port, None, stopping, None, reuse_port=True)
        )
        for name in ("first", "second")
    ]
    try:
        answered: Counter[str] = Counter()

        async def served() -> bool:
            if any(s.done() for s in servers):
                return True  # the assert below names the error
            for _ in range(40):  # a new connection each time: the kernel picks a listener
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                    answered[(await client.get("/")).text] += 1
            return True

        # httpx.ConnectError: not listening yet
        await eventually(served, "both servers to listen", 4, ignoring=(httpx.ConnectError,))
        assert not any(s.done() for s in servers), [s.exception() for s in servers if s.done()]
        assert sum(answered.values()) == 40
        assert set(answered) == {"first", "second"}, answered
    finally:
        stopping.set()
        await asyncio.gather(*servers)


def test_a_port_held_without_reuse_port_is_not_shared() -> None:
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        port = plain.getsockname()[1]
        with pytest.raises(OSError, match="in use") as caught:
            reuse_port_socket("127.0.0.1", port, 128).close()
        assert caught.value.errno == errno.EADDRINUSE
