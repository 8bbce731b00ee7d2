"""``services.json`` (the pid and port of each embedded server) and the ``flock`` that
serialises calls for one ``data_dir``, so test workers started together share one set of servers.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

STATE_FILE = "services.json"
LOCK_FILE = "services.lock"

State = dict[str, dict[str, int | None]]


@contextlib.contextmanager
def locked(data_dir: Path) -> Iterator[None]:
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / LOCK_FILE).open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def read_state(data_dir: Path) -> State:
    try:
        raw = json.loads((data_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    state: State = {}
    if isinstance(raw, dict):
        for name, record in raw.items():
            if isinstance(record, dict):
                state[str(name)] = {
                    key: value if isinstance(value, int) else None
                    for key, value in record.items()
                    if key in ("pid", "port")
                }
    return state


def write_state(data_dir: Path, state: State) -> None:
    path = data_dir / STATE_FILE
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, path)
